"""`engine.tput_timer` (DeepSpeed's ThroughputTimer, config block `timers.throughput`): samples per second
from the real batch size and the time a fake clock says passed, never the wall clock.

The engine checks run the loops DeepSpeed-Chat's SFT / reward-model / DPO scripts run: their own DataLoader,
`model(**batch)`, `backward`, `step`, an evaluation pass, `tput_timer.update_epoch_count()` after each
epoch; and the engine's own `training_data` loader, where loading a batch counts.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardspeed.config.monitoring import ThroughputTimerConfig
from shardspeed.runtime import throughput
from shardspeed.runtime.throughput import ThroughputTimer

from harness import run_ranks


class FakeClock:
    """Seconds that pass only when the test (or the fake model and dataset) says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _timer(clock, lines, **kwargs) -> ThroughputTimer:
    kwargs.setdefault("steps_per_output", 2)
    return ThroughputTimer(ThroughputTimerConfig(), kwargs.pop("batch_size", 8), logging_fn=lines.append,
                           clock=clock, **kwargs)  # fmt: skip


def _field(line: str, name: str) -> float:
    return float(re.search(rf"{name}=([-0-9.inf]+)", line).group(1))


def test_samples_per_second_is_the_batch_over_the_timed_micro_steps():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines, batch_size=8)
    durations = {}  # global step -> seconds of each of its 2 micro-steps
    for step in range(6):
        durations[step] = 0.25 * (step + 1)
        for micro in range(2):
            timer.start()
            clock.now += durations[step]
            timer.stop(global_step=micro == 1)
            clock.now += 100.0  # between micro-steps (the script's own work): not timed
    assert (timer.global_step_count, timer.micro_step_count) == (6, 12)
    timed = [2 * durations[s] for s in range(2, 6)]  # the first start_step=2 global steps are warm-up
    assert timer.avg_samples_per_sec() == pytest.approx(4 * 8 / sum(timed))
    # reported at the multiples of steps_per_output that were timed (step 2 was warm-up)
    assert [_field(line, "global_step") for line in lines] == [4, 6]
    assert _field(lines[0], "CurrSamplesPerSec") == pytest.approx(8 / timed[1])
    assert _field(lines[1], "RunningAvgSamplesPerSec") == pytest.approx(timer.avg_samples_per_sec())
    assert lines[0].startswith("epoch=0/micro_step=8/global_step=4, RunningAvgSamplesPerSec=")


def test_rate_follows_a_changed_batch_size():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines, batch_size=8, start_step=0)
    for step in range(4):
        if step == 2:
            timer.batch_size = 16  # what engine.set_train_batch_size does
        timer.start()
        clock.now += 1.0
        timer.stop(global_step=True)
    assert timer.avg_samples_per_sec() == pytest.approx((8 + 8 + 16 + 16) / 4.0)


def test_update_epoch_count_numbers_the_epochs_in_the_report():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines, steps_per_output=1, start_step=0)
    for _epoch in range(2):
        for _ in range(3):
            timer.start()
            clock.now += 0.5
            timer.stop(global_step=True)
        timer.update_epoch_count()
    assert timer.epoch_count == 2 and timer.micro_step_count == 0
    assert lines[-1].startswith("epoch=1/micro_step=3/global_step=6,")


def test_before_any_timed_step_the_average_is_minus_infinity():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines)
    assert timer.avg_samples_per_sec() == float("-inf")
    for _ in range(2):  # the warm-up steps: counted, not timed (DeepSpeed divides by zero here)
        timer.start()
        clock.now += 1.0
        timer.stop(global_step=True)
    assert timer.global_step_count == 2 and timer.avg_samples_per_sec() == float("-inf")


def test_stop_without_start_and_a_started_step_that_never_runs_count_nothing():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines, start_step=0)
    timer.stop(global_step=True)  # DeepSpeed: a stop without a start is ignored
    timer.start_at_fetch()
    timer.discard()  # the loader ran out
    timer.stop(global_step=True)
    assert (timer.global_step_count, timer.micro_step_count, timer.total_elapsed_time) == (0, 0, 0.0)


def test_the_forward_keeps_the_loaders_start_but_restarts_its_own():
    clock, lines = FakeClock(), []
    timer = _timer(clock, lines, start_step=0)
    timer.start_at_fetch()
    clock.now += 1.0  # loading the batch
    timer.start_at_forward()  # the forward of the fetched batch: loading counts
    clock.now += 1.0
    timer.stop(global_step=True)
    assert timer.total_elapsed_time == 2.0
    timer.start_at_forward()  # an evaluation forward (no step follows)
    clock.now += 5.0
    timer.start_at_forward()  # the next training forward starts again
    clock.now += 1.0
    timer.stop(global_step=True)
    assert timer.total_elapsed_time == 3.0


def test_synchronizes_only_when_asked_and_does_nothing_when_disabled(monkeypatch):
    calls = []
    monkeypatch.setattr(throughput.accelerator, "synchronize", lambda device: calls.append(device))
    clock = FakeClock()

    def one_timed_step(config):
        timer = ThroughputTimer(config, 8, start_step=0, device=torch.device("cpu"), clock=clock)
        timer.start()
        clock.now += 1.0
        timer.stop(global_step=True)
        return timer

    one_timed_step(ThroughputTimerConfig(synchronized=True))
    assert len(calls) == 2  # before reading the clock at start and at stop
    one_timed_step(ThroughputTimerConfig(synchronized=False))
    off = one_timed_step(ThroughputTimerConfig(enabled=False))
    assert len(calls) == 2
    assert (off.global_step_count, off.avg_samples_per_sec(), off.started) == (0, float("-inf"), False)


def test_monitor_memory_needs_psutil():
    try:
        import psutil  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="psutil"):
            ThroughputTimer(ThroughputTimerConfig(), 8, monitor_memory=True)
    else:
        lines = []
        timer = ThroughputTimer(ThroughputTimerConfig(), 8, start_step=0, steps_per_output=1,
                                monitor_memory=True, logging_fn=lines.append)  # fmt: skip
        timer.start()
        timer.stop(global_step=True)
        assert "vm %" in lines[-1]


# -- the engine, as DeepSpeed-Chat's scripts drive it --------------------------------------------------------

FORWARD_SECONDS, LOAD_SECONDS = 0.125, 0.0625  # binary fractions: the sums below are exact
MICRO, GAS, WORLD = 2, 2, 2


class _ClockedModel(nn.Module):
    """A regression model whose forward takes FORWARD_SECONDS on the fake clock; `model(**batch)` style."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.clock = clock

    def forward(self, x, y):
        self.clock.now += FORWARD_SECONDS
        return nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


class _ClockedData(torch.utils.data.Dataset):
    """16 samples, each taking LOAD_SECONDS to load."""

    def __init__(self, clock: FakeClock):
        self.clock = clock

    def __len__(self):
        return 16

    def __getitem__(self, i):
        self.clock.now += LOAD_SECONDS
        return {"x": torch.full((4,), float(i)), "y": torch.tensor(float(i % 3))}


def _engine(clock, training_data=None):
    import shardspeed

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    }
    engine, _, loader, _ = shardspeed.initialize(
        model=_ClockedModel(clock), config=config, training_data=training_data
    )
    engine.tput_timer.clock = clock
    return engine, loader


def _dschat_jobs() -> dict:
    import logging

    from torch.utils.data import DataLoader, DistributedSampler

    import shardspeed
    from shardspeed.utils.logging import logger

    shardspeed.init_distributed()
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    out = {}

    # DeepSpeed-Chat step 1/2: the script's own DataLoader, evaluation between epochs
    clock = FakeClock()
    engine, _ = _engine(clock)
    dataset = _ClockedData(clock)
    train = DataLoader(dataset, sampler=DistributedSampler(dataset), batch_size=MICRO)
    for _epoch in range(2):
        engine.train()
        for batch in train:
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            for batch in train:
                engine(**batch)  # evaluation: restarts the timer, never counted
        engine.tput_timer.update_epoch_count()
    timer = engine.tput_timer
    out["own loader"] = {
        "epochs": timer.epoch_count,
        "steps": (timer.global_step_count, engine.global_steps),
        "batch": (timer.batch_size, engine.train_batch_size()),
        "rate": timer.avg_samples_per_sec(),
        "lines": [line for line in lines if "RunningAvgSamplesPerSec" in line],
    }
    engine.set_train_batch_size(MICRO * WORLD * 4)
    out["own loader"]["batch after set"] = timer.batch_size

    # DeepSpeed-Chat's DPO step: a reference engine without an optimizer runs inside the policy's micro-step
    clock = FakeClock()
    engine, _ = _engine(clock)
    ref, *_ = shardspeed.initialize(
        model=_ClockedModel(clock),
        config={"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS},
    )
    ref.eval()
    dpo_data = DataLoader(dataset, sampler=DistributedSampler(dataset), batch_size=MICRO)
    for _epoch in range(2):
        for batch in dpo_data:
            loss = engine(**batch)
            with torch.no_grad():
                ref(**batch)
            engine.backward(loss)
            engine.step()
    out["dpo"] = {
        "rate": engine.tput_timer.avg_samples_per_sec(),
        "ref steps": ref.tput_timer.global_step_count,
    }

    # the engine's own training_data loader: fetching a batch starts the micro-step, so loading counts
    lines.clear()
    clock = FakeClock()
    engine, loader = _engine(clock, training_data=_ClockedData(clock))
    for _ in range(2):
        for batch in loader:
            engine.backward(engine(**batch))
            engine.step()
    out["engine loader"] = {
        "steps": engine.tput_timer.global_step_count,
        "rate": engine.tput_timer.avg_samples_per_sec(),
        "lines": [line for line in lines if "RunningAvgSamplesPerSec" in line],
    }
    logger.removeHandler(handler)
    return out


@pytest.fixture(scope="module")
def dschat_results():
    return run_ranks(_dschat_jobs, WORLD)


def test_dschat_loop_reports_samples_per_second_of_its_micro_steps(dschat_results):
    batch = MICRO * GAS * WORLD
    for rank, out in enumerate(dschat_results):
        own = out["own loader"]
        assert own["epochs"] == 2  # update_epoch_count() after each epoch
        assert own["steps"] == (4, 4) and own["batch"] == (batch, batch)
        # each micro-step is its forward only: loading by the script's loader and evaluation are outside it
        assert own["rate"] == batch / (GAS * FORWARD_SECONDS)
        assert own["batch after set"] == MICRO * WORLD * 4
        # steps 2 and 4 are multiples of steps_per_print; step 2 is warm-up: one line, on rank 0 only
        assert len(own["lines"]) == (1 if rank == 0 else 0)
    line = dschat_results[0]["own loader"]["lines"][0]
    assert line.startswith("epoch=1/micro_step=4/global_step=4, ")
    assert _field(line, "CurrSamplesPerSec") == batch / (GAS * FORWARD_SECONDS)


def test_dpo_loop_counts_the_reference_forward_in_the_policys_micro_step(dschat_results):
    batch = MICRO * GAS * WORLD
    for out in dschat_results:
        assert out["dpo"]["rate"] == batch / (GAS * 2 * FORWARD_SECONDS)
        assert out["dpo"]["ref steps"] == 0  # forwards only: never a step


def test_engine_training_loader_counts_loading(dschat_results):
    batch = MICRO * GAS * WORLD
    for out in dschat_results:
        loaded = out["engine loader"]
        assert loaded["steps"] == 4
        assert loaded["rate"] == batch / (GAS * (FORWARD_SECONDS + MICRO * LOAD_SECONDS))
    assert len(dschat_results[0]["engine loader"]["lines"]) == 1
