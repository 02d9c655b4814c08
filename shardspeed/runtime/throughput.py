"""`engine.tput_timer`: DeepSpeed's `ThroughputTimer` — samples per second of training, reported every
`steps_per_print` global steps, configured by the `timers.throughput` block.

What is timed: each micro-step from its start to the end of `engine.step()`. A micro-step starts when the
engine's training loader (`training_data` / `deepspeed_io(route="train")`) hands out its batch, so loading
counts, or at the engine's forward when the script brings its own batches (DeepSpeed-Chat's loop). The
pipeline engine times each `train_batch()` whole. The first `start_step` global steps (2) are warm-up and
not timed: the allocator, compilation and autotuning make them slower than the rest. Samples per global
step are `train_batch_size` (every data-parallel rank's), so the rate is the whole job's.

Differences from DeepSpeed (docs/compatibility.md): the batch size follows `set_train_batch_size` (the
average sums the samples of each timed step), `avg_samples_per_sec()` is -inf until a step has been timed
(DeepSpeed divides by zero at steps 1-2), a forward during evaluation restarts the micro-step instead of
being counted in the next training step's time, and the pipeline engine's timer counts its batches
(DeepSpeed's starts and never stops).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shardspeed import accelerator
from shardspeed.config.monitoring import ThroughputTimerConfig
from shardspeed.utils.logging import logger

__all__ = ["ThroughputTimer"]

_GIB = 1024**3


class ThroughputTimer:
    """DeepSpeed's `ThroughputTimer(config, batch_size, start_step=2, steps_per_output=None,
    monitor_memory=False, logging_fn=None)`, and its counters under DeepSpeed's names.

    `device`: the device to synchronise before reading the clock when `config.synchronized` (CUDA kernels
    are asynchronous; one sync per start and stop). `clock`: seconds as a float (`time.perf_counter`,
    monotonic; DeepSpeed reads `time.time`).
    """

    def __init__(
        self,
        config: ThroughputTimerConfig | None = None,
        batch_size: int | None = None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], None] | None = None,
        *,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config if config is not None else ThroughputTimerConfig()
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else logger.info
        self.device, self.clock = device, clock
        if monitor_memory:
            try:
                import psutil  # noqa: F401  (only the memory report needs it)
            except ImportError as err:
                raise ImportError("ThroughputTimer(monitor_memory=True) needs the 'psutil' package") from err
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds of the timed micro-steps
        self.step_elapsed_time = 0.0  # seconds of the current global step's timed micro-steps
        self.total_samples = 0  # samples of the timed global steps (each its batch size at the time)
        self._timing = False  # this micro-step's start was stamped (past the warm-up)
        self._fetched = False  # the training loader started this micro-step; the forward keeps its start

    def update_epoch_count(self) -> None:
        """An epoch ended: the next report counts micro-steps from 0 in the next epoch."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start a micro-step (a second start before `stop` starts it again)."""
        if not self.config.enabled:
            return
        self.initialized = self.started = True
        self._timing = self.global_step_count >= self.start_step
        if self._timing:
            self.start_time = self._now()

    def start_at_fetch(self) -> None:
        """The engine's training loader is about to load a batch: the micro-step starts here."""
        self.start()
        self._fetched = self.started

    def start_at_forward(self) -> None:
        """The engine's forward: start the micro-step, unless the training loader just did (its batch is
        this forward's, and loading it counts)."""
        if self._fetched:
            self._fetched = False
            return
        self.start()

    def discard(self) -> None:
        """Forget a started micro-step that will not run (the training loader ran out)."""
        self.started = self._timing = self._fetched = False

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step; `global_step`: it was the accumulation boundary (the optimizer stepped);
        `report_speed`: log the rates if this global step is a multiple of `steps_per_output`."""
        if not self.config.enabled or not self.started:
            return
        self.started = self._fetched = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if not self._timing:
            return
        self.end_time = self._now()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        self.total_samples += self.batch_size
        if report_speed and self._is_report_boundary():
            self.logging(self._report())
            if self.monitor_memory:
                self.logging(self._memory_report())
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed global steps (those after the warm-up); -inf before any."""
        if self.total_samples == 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.total_samples / self.total_elapsed_time

    # -- internals ----------------------------------------------------------------------------------------

    def _now(self) -> float:
        if self.config.synchronized and self.device is not None:
            accelerator.synchronize(self.device)
        return self.clock()

    def _is_report_boundary(self) -> bool:
        return bool(self.steps_per_output) and self.global_step_count % self.steps_per_output == 0

    def _position(self) -> str:
        return f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"

    def _report(self) -> str:
        current = self.batch_size / self.step_elapsed_time if self.step_elapsed_time > 0 else float("inf")
        facade = accelerator.get_accelerator()
        return (
            f"{self._position()}, RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={current}, MemAllocated={round(facade.memory_allocated() / _GIB, 2)}GB, "
            f"MaxMemAllocated={round(facade.max_memory_allocated() / _GIB, 2)}GB"
        )

    def _memory_report(self) -> str:
        import psutil

        return f"{self._position()}, vm %: {psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}"
