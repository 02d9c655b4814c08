"""`StepObservers`: the engine's part for seeing inside a run — the monitors (`engine.monitor`), the flops
profiler at `flops_profiler.profile_step`, and the comms logger switched on from the config.

With every block off it holds an empty `MonitorMaster` and nothing else: no hooks on the module, no
wrapped collectives, no device synchronisation; the engine's calls into it are an attribute check.
"""

from __future__ import annotations

from shardspeed.comm import logger as comms_logger
from shardspeed.monitor import MonitorMaster

__all__ = ["StepObservers"]


class StepObservers:
    def __init__(self, engine, config):
        self.monitor = MonitorMaster(config, engine.global_rank)
        self.profile_config = config.flops_profiler
        self.flops_profiler = None
        if config.flops_profiler.enabled and engine.global_rank == 0:  # DeepSpeed profiles rank 0 only
            from shardspeed.profiling.flops_profiler import FlopsProfiler

            self.flops_profiler = FlopsProfiler(
                engine.module, engine, config.flops_profiler.recompute_fwd_factor
            )
        self._profile_done = False
        if config.comms_logger.enabled:
            comms_logger.configure(config)

    def before_forward(self, engine) -> None:
        """Start the flops profiler on the first forward of step `profile_step`."""
        if (
            self.flops_profiler is not None
            and not self._profile_done
            and not self.flops_profiler.started
            and engine.global_steps == self.profile_config.profile_step
        ):
            self.flops_profiler.start_profile()

    def after_forward(self, engine) -> None:
        """Stop counting after that forward: the report covers one forward pass, as DeepSpeed's does."""
        if self.flops_profiler is not None and self.flops_profiler.started:
            self.flops_profiler.stop_profile()

    def after_step(self, engine, window_loss) -> None:
        """At an accumulation boundary: write the monitor events; print the profile of the profiled step."""
        if self.monitor.monitors:
            self.monitor.write_events(self._events(engine, window_loss))
        if self.flops_profiler is not None and self.flops_profiler.started:
            cfg = self.profile_config
            self.flops_profiler.print_model_profile(
                profile_step=engine.global_steps - 1, module_depth=cfg.module_depth,
                top_modules=cfg.top_modules, detailed=cfg.detailed, output_file=cfg.output_file,
            )  # fmt: skip
            self.flops_profiler.end_profile()
            self._profile_done = True

    def _events(self, engine, window_loss) -> list[tuple[str, float, int]]:
        """DeepSpeed's event names, at x = samples seen after this step."""
        samples = engine.global_samples
        events = []
        if window_loss is not None:
            events.append(("Train/Samples/train_loss", float(window_loss.item()), samples))
        lrs = engine.get_lr()
        if lrs:
            events.append(("Train/Samples/lr", float(lrs[0]), samples))
        if engine.fp16_enabled():
            events.append(("Train/Samples/loss_scale", float(engine.loss_scale()), samples))
        if engine.timers.enabled:
            for phase, seconds in engine.timers.take_window().items():
                events.append((f"Train/Samples/elapsed_time_ms_{phase}", 1000 * seconds, samples))
        return events

    def close(self) -> None:
        self.monitor.close()
        if self.flops_profiler is not None:
            self.flops_profiler.end_profile()
