"""A 2-rank training run with every monitor, the flops profiler and the comms logger on writes every file
(TensorBoard's own reader finds DeepSpeed's event names); with all of them off the engine installs nothing.

TensorBoard, W&B and matplotlib are optional extras (`shardspeed[tensorboard,wandb,plot]`); the tests that
need one skip with the reason when it is not installed. Comet runs only when `comet_ml` is installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from shardspeed.config import load_config
from shardspeed.monitor import MonitorMaster

from harness import run_ranks

STEPS, MICRO, GAS, WORLD = 3, 2, 2, 2
SAMPLES_PER_STEP = MICRO * GAS * WORLD
HAVE = {
    name: importlib.util.find_spec(name) is not None
    for name in ("tensorboard", "wandb", "comet_ml", "matplotlib")
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(2)
        )

    def forward(self, x):
        from shardspeed import checkpointing

        for block in self.blocks:
            x = checkpointing.checkpoint(block, x)
        return x.pow(2).mean()


def _config(out: str, everything: bool, fp16: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if everything:
        cfg.update(
            wall_clock_breakdown=True,
            activation_checkpointing={"profile": True},
            tensorboard={
                "enabled": HAVE["tensorboard"],
                "output_path": out,
                "job_name": "tb16" if fp16 else "tb",
            },
            csv_monitor={"enabled": True, "output_path": out, "job_name": "csv16" if fp16 else "csv"},
            wandb={"enabled": HAVE["wandb"] and not fp16, "project": "shardspeed-test"},
            comet={"enabled": HAVE["comet_ml"] and not fp16, "online": False},
            flops_profiler={
                "enabled": not fp16,
                "profile_step": 1,
                "output_file": os.path.join(out, "flops.txt"),
            },
            comms_logger={"enabled": True},
        )
    return cfg


def _train(engine) -> None:
    for _ in range(STEPS * GAS):
        loss = engine(torch.randn(MICRO, 8, dtype=torch.float16 if engine.fp16_enabled() else torch.float32))
        engine.backward(loss)
        engine.step()


def _run(out: str):
    import shardspeed
    from shardspeed import checkpointing
    from shardspeed.comm import logger

    os.environ.update(WANDB_DIR=out, WANDB_SILENT="true")
    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=Net(), config=_config(out, everything=False))
    off = {
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in engine.module.modules()),
        "logger": logger.active() is None,
        "monitors": len(engine.monitor.monitors),
        "profiler": engine.observers.flops_profiler is None,
        "checkpointing_configured": checkpointing.is_configured(),
    }
    _train(engine)
    engine.destroy()

    engine, *_ = shardspeed.initialize(model=Net(), config=_config(out, everything=True))
    on = {
        "checkpointing_configured": checkpointing.is_configured(),
        "profile": checkpointing.state.current().profile,
    }
    _train(engine)
    engine.monitor.write_events([("Custom/my_metric", 1.5, 7)])  # a user's own event
    summary = shardspeed.comm.log_summary()
    engine.destroy()

    engine, *_ = shardspeed.initialize(model=Net().half(), config=_config(out, everything=True, fp16=True))
    _train(engine)
    engine.destroy()
    return {"off": off, "on": on, "summary": summary, "files": sorted(_files(out))}


def _files(root: str):
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield os.path.relpath(os.path.join(dirpath, name), root)


def _csv(path) -> list[tuple[int, float]]:
    lines = path.read_text().splitlines()
    return lines[0], [(int(a), float(b)) for a, b in (line.split(",") for line in lines[1:])]


def test_two_rank_run_writes_every_monitor_profiler_and_comms_file(tmp_path):
    results = run_ranks(_run, WORLD, str(tmp_path), timeout=300)
    rank0 = results[0]
    assert rank0["off"] == {"hooks": 0, "logger": True, "monitors": 0, "profiler": True,
                            "checkpointing_configured": False}  # fmt: skip
    assert rank0["on"] == {"checkpointing_configured": True, "profile": True}
    samples = [SAMPLES_PER_STEP * (i + 1) for i in range(STEPS)]

    # CSV: one file per event, header step,<last name part>, x = samples seen
    csv_dir = tmp_path / "csv"
    names = [
        "train_loss",
        "lr",
        "elapsed_time_ms_forward",
        "elapsed_time_ms_backward",
        "elapsed_time_ms_step",
    ]
    for name in names:
        header, rows = _csv(csv_dir / f"Train_Samples_{name}.csv")
        assert header == f"step,{name}"
        assert [x for x, _ in rows] == samples
        assert all(v > 0 or name == "lr" for _, v in rows)  # WarmupLR starts from 0
    assert not (csv_dir / "Train_Samples_loss_scale.csv").exists()  # fp32 run: no loss scale
    assert _csv(csv_dir / "Custom_my_metric.csv")[1] == [(7, 1.5)]
    header, rows = _csv(tmp_path / "csv16" / "Train_Samples_loss_scale.csv")
    assert header == "step,loss_scale" and rows[0] == (SAMPLES_PER_STEP, 256.0)
    _, lr = _csv(csv_dir / "Train_Samples_lr.csv")
    assert lr[-1][1] == pytest.approx(1e-3)  # WarmupLR reached its max after 2 steps

    # flops profiler at profile_step 1, rank 0 only, written to its output_file
    report = (tmp_path / "flops.txt").read_text()
    assert "Profile Summary at step 1:" in report and "bwd latency" in report
    assert "fwd MACs per GPU:" in report and "(blocks): ModuleList(" in report

    # comms logger: the ZeRO-1 collectives of the run
    assert "reduce_scatter_tensor" in rank0["summary"] and "all_gather_into_tensor" in rank0["summary"]
    assert results[1]["summary"]  # every rank records; rank 0 prints

    if HAVE["tensorboard"]:
        from tensorboard.backend.event_processing import event_accumulator

        acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {f"Train/Samples/{n}" for n in names} <= tags
        assert [e.step for e in acc.Scalars("Train/Samples/train_loss")] == samples
        assert [e.value for e in acc.Scalars("Train/Samples/train_loss")] == pytest.approx(
            [v for _, v in _csv(csv_dir / "Train_Samples_train_loss.csv")[1]]
        )
    if HAVE["wandb"]:
        assert any(f.endswith(".wandb") and "offline-run" in f for f in rank0["files"])
    if not all(HAVE[k] for k in ("tensorboard", "wandb")):
        pytest.skip(
            f"ran without the optional packages {[k for k in ('tensorboard', 'wandb') if not HAVE[k]]}"
        )


@pytest.mark.skipif(not HAVE["matplotlib"], reason="matplotlib (shardspeed[plot]) is not installed")
def test_plot_of_csv_monitor_curves(tmp_path):
    from shardspeed.monitor.csv_monitor import CsvMonitor
    from shardspeed.monitor.plot import main

    cfg = load_config({"train_batch_size": 1, "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    monitor = CsvMonitor(cfg.csv_monitor)
    monitor.write_events([("Train/Samples/train_loss", 3.0 - i / 10, 8 * i) for i in range(10)])
    monitor.write_events([("Train/Samples/lr", 1e-3 * i / 10, 8 * i) for i in range(10)])
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "DeepSpeedJobName"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="csv_monitor"):
        main([str(tmp_path), "--out", str(out)])


def test_missing_optional_packages_name_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were absent
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config({"train_batch_size": 1, "tensorboard": {"enabled": True}})
    with pytest.raises(ImportError, match=r"tensorboard\.enabled.*shardspeed\[tensorboard\]"):
        MonitorMaster(cfg, rank=0)
    assert MonitorMaster(cfg, rank=1).monitors == []  # other ranks never build a monitor
    with pytest.raises(ImportError, match=r"wandb\.enabled.*shardspeed\[wandb\]"):
        MonitorMaster(load_config({"train_batch_size": 1, "wandb": {"enabled": True}}), rank=0)
    if not HAVE["comet_ml"]:
        with pytest.raises(ImportError, match=r"comet\.enabled.*comet_ml"):
            MonitorMaster(load_config({"train_batch_size": 1, "comet": {"enabled": True}}), rank=0)
