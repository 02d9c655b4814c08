"""`AutotuningProbe`: the engine's part in an autotuning experiment (the `autotuning` block, `enabled`).

Each experiment of `deepspeed --autotuning` is the user's own script run with one candidate config. With
the block enabled the engine measures the optimizer steps `start_profile_step..end_profile_step` (0-based;
the steps before warm up: allocator, caches, lazy initialisation), then rank 0 writes the metrics to
`metric_path` and every rank leaves with `SystemExit(0)` at the same step, as DeepSpeed's engine does. The
autotuner reads that file; the script needs no change.

The metrics (one JSON object):

- `latency`: milliseconds of forward + backward + optimizer step per optimizer step (all micro-batches of
  the accumulation window), averaged over the measured steps: DeepSpeed's definition (data loading and the
  script's own work between calls are not counted);
- `throughput`: samples per second at that latency (`train_batch_size / latency`). DeepSpeed 0.19.8 writes
  1000 times this number (it divides by milliseconds and multiplies by 1e6); the ranking is the same;
- `flops` (and DeepSpeed's `FLOPS_per_gpu`), only when `metric` is "flops": rank 0's training FLOP/s,
  three times the forward FLOPs of one micro-batch (counted by the flops profiler on the first forward of
  `start_profile_step`) per micro-batch. Counting costs module hooks on that one forward, so it is only done
  when asked for;
- `forward_ms`, `backward_ms`, `step_ms` (`train_batch_ms` for the pipeline engine, whose whole batch is one
  phase), `measured_steps`, `train_batch_size`: the parts and the inputs.

Timing synchronises the device around each phase (the phase timers are on while profiling), which is what
makes the numbers comparable between configs on a GPU.
"""

from __future__ import annotations

import json
import os

from shardspeed.config.features import AutotuningConfig
from shardspeed.utils.logging import log_dist

__all__ = ["AutotuningProbe", "metric_path_of"]

# the engine's phases, and the pipeline engine's whole batch (its forward/backward run inside train_batch)
PHASES = ("forward", "backward", "step", "train_batch")


def metric_path_of(block: AutotuningConfig) -> str:
    """Where the metrics go: `metric_path`, or DeepSpeed's default ./autotuning_metric.json."""
    return block.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")


class AutotuningProbe:
    """Built by the engine when `autotuning.enabled`; `after_step` is called at every optimizer step."""

    def __init__(self, block: AutotuningConfig, *, timers, rank: int, train_batch_size: int,
                 gradient_accumulation_steps: int, module=None):  # fmt: skip
        self.block = block
        self.timers = timers  # the engine's PhaseTimers, switched on for the run (they synchronise)
        self.rank = rank
        self.train_batch_size = train_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._mark = self._cumulative() if block.start_profile_step == 0 else None
        self.flops_profiler = None
        self.forward_flops = 0
        if block.metric == "flops" and rank == 0 and module is not None:
            from shardspeed.profiling.flops_profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(module)

    def _cumulative(self) -> dict[str, float]:
        return {phase: self.timers.cumulative.get(phase, 0.0) for phase in PHASES}

    def before_forward(self, global_steps: int) -> None:
        """Count the forward FLOPs of one micro-batch, on the first forward of the first measured step."""
        profiler = self.flops_profiler
        first = not self.forward_flops and global_steps == self.block.start_profile_step
        if profiler is not None and first and not profiler.started:
            profiler.start_profile()

    def after_forward(self) -> None:
        profiler = self.flops_profiler
        if profiler is not None and profiler.started:
            profiler.stop_profile()
            self.forward_flops = profiler.get_total_flops()
            profiler.end_profile()

    def after_step(self, global_steps: int) -> None:
        """`global_steps` already counts the step just taken. Mark the window's start; at its end, write
        the metrics and end the process."""
        if global_steps == self.block.start_profile_step:
            self._mark = self._cumulative()
        if global_steps == self.block.end_profile_step + 1:
            if self.rank == 0:
                self._write(global_steps)
            raise SystemExit(0)

    def metrics(self) -> dict[str, float]:
        """The measured window as DeepSpeed's metric names (see the module's docstring)."""
        steps = self.block.end_profile_step - self.block.start_profile_step + 1
        now = self._cumulative()
        mark = self._mark or dict.fromkeys(PHASES, 0.0)
        per_step = {phase: (now[phase] - mark[phase]) / steps for phase in PHASES}
        seconds = sum(per_step.values())
        result = {
            "latency": 1000.0 * seconds,
            "throughput": self.train_batch_size / seconds if seconds > 0 else 0.0,
            "forward_ms": 1000.0 * per_step["forward"],
            "backward_ms": 1000.0 * per_step["backward"],
            "step_ms": 1000.0 * per_step["step"],
            "train_batch_ms": 1000.0 * per_step["train_batch"],
            "measured_steps": steps,
            "train_batch_size": self.train_batch_size,
        }
        if self.block.metric == "flops":
            training_flops = 3 * self.forward_flops * self.gradient_accumulation_steps
            result["flops"] = result["FLOPS_per_gpu"] = training_flops / seconds if seconds > 0 else 0.0
        return result

    def _write(self, global_steps: int) -> None:
        path = metric_path_of(self.block)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.tmp"
        with open(
            temporary, "w", encoding="utf-8"
        ) as handle:  # atomic: the autotuner never reads half a file
            json.dump(self.metrics(), handle)
        os.replace(temporary, path)
        log_dist(
            f"autotuning: measured steps {self.block.start_profile_step}..{global_steps - 1}, wrote {path}"
        )
