"""`StepObservers`: the engine's part for seeing inside a run — the monitors (`engine.monitor`), the flops
profiler at `flops_profiler.profile_step`, the comms logger switched on from the config, and an autotuning
experiment's probe (runtime/autotuning_probe.py), which ends the run after its profiled steps.

It is built from what it configures: the engine's `MonitorMaster`, the `flops_profiler` and `comms_logger`
blocks, and the phase timers it reports. With every block off it holds an empty `MonitorMaster` and nothing
else: no hooks on the module, no wrapped collectives, no device synchronisation.
"""

from __future__ import annotations

from shardspeed.comm import logger as comms_logger
from shardspeed.config.monitoring import CommsLoggerConfig, FlopsProfilerConfig
from shardspeed.monitor import MonitorMaster

__all__ = ["StepObservers"]


class StepObservers:
    def __init__(self, monitor: MonitorMaster, flops_profiler: FlopsProfilerConfig,
                 comms_logger_config: CommsLoggerConfig, *, timers, module, rank: int,
                 profiled_engine=None, autotuning=None):  # fmt: skip
        """`profiled_engine` is handed to DeepSpeed's `FlopsProfiler(model, ds_engine)` only, whose report
        names the engine's world size and micro-batch (DeepSpeed's contract); nothing here reads it."""
        self.monitor = monitor
        self.timers = timers
        self.autotuning = autotuning  # an AutotuningProbe with the `autotuning` block on, else None
        self.profile_config = flops_profiler
        self.flops_profiler = None
        if flops_profiler.enabled and rank == 0:  # DeepSpeed profiles rank 0 only
            from shardspeed.profiling.flops_profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(module, profiled_engine, flops_profiler.recompute_fwd_factor)
        self._profile_done = False
        if comms_logger_config.enabled:
            block = comms_logger_config
            comms_logger.configure(enabled=True, prof_all=block.prof_all, prof_ops=block.prof_ops,
                                   verbose=block.verbose, debug=block.debug)  # fmt: skip

    def before_forward(self, global_steps: int) -> None:
        """Start the flops profiler on the first forward of step `profile_step`."""
        if self.autotuning is not None:
            self.autotuning.before_forward(global_steps)
        if (
            self.flops_profiler is not None
            and not self._profile_done
            and not self.flops_profiler.started
            and global_steps == self.profile_config.profile_step
        ):
            self.flops_profiler.start_profile()

    def after_forward(self) -> None:
        """Stop counting after that forward: the report covers one forward pass, as DeepSpeed's does."""
        if self.flops_profiler is not None and self.flops_profiler.started:
            self.flops_profiler.stop_profile()
        if self.autotuning is not None:
            self.autotuning.after_forward()

    def after_step(self, global_steps: int, samples: int, window_loss, lrs: list[float],
                   loss_scale: float | None) -> None:  # fmt: skip
        """At an accumulation boundary (`global_steps` already counts this step): write the monitor events;
        print the profile of the profiled step. `loss_scale` is None when fp16 is off."""
        if self.monitor.monitors:
            self.monitor.write_events(self._events(samples, window_loss, lrs, loss_scale))
        if self.flops_profiler is not None and self.flops_profiler.started:
            cfg = self.profile_config
            self.flops_profiler.print_model_profile(
                profile_step=global_steps - 1, module_depth=cfg.module_depth,
                top_modules=cfg.top_modules, detailed=cfg.detailed, output_file=cfg.output_file,
            )  # fmt: skip
            self.flops_profiler.end_profile()
            self._profile_done = True

    def step_finished(self, global_steps: int) -> None:
        """The last thing of a boundary step (counters, throughput timer done): an autotuning experiment
        whose profiled window this step closed writes its metrics and ends the process (SystemExit)."""
        if self.autotuning is not None:
            self.autotuning.after_step(global_steps)

    def _events(self, samples: int, window_loss, lrs, loss_scale) -> list[tuple[str, float, int]]:
        """DeepSpeed's event names, at x = samples seen after this step."""
        events = []
        if window_loss is not None:
            events.append(("Train/Samples/train_loss", float(window_loss.item()), samples))
        if lrs:
            events.append(("Train/Samples/lr", float(lrs[0]), samples))
        if loss_scale is not None:
            events.append(("Train/Samples/loss_scale", float(loss_scale), samples))
        if self.timers.enabled:
            for phase, seconds in self.timers.take_window().items():
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", 1000 * seconds, samples))
        return events

    def close(self) -> None:
        self.monitor.close()
        if self.flops_profiler is not None:
            self.flops_profiler.end_profile()
