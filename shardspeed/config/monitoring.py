"""Config blocks for logging and measurement: monitors, comms logger, flops profiler, timers (reference §2.8)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .blocks import PositiveInt

__all__ = [
    "CometConfig",
    "CommsLoggerConfig",
    "CsvMonitorConfig",
    "FlopsProfilerConfig",
    "TensorBoardConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "WandbConfig",
]


@dataclass(kw_only=True)
class TensorBoardConfig:
    """``tensorboard``: write training events (loss, lr, loss scale, timings) for TensorBoard."""

    enabled: bool = False
    """Write TensorBoard events on rank 0. Default false."""
    output_path: str = ""
    """Directory for the event files. Default "" (current directory)."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run. Default "DeepSpeedJobName"."""


@dataclass(kw_only=True)
class CsvMonitorConfig:
    """``csv_monitor``: write training events as CSV files, one per event."""

    enabled: bool = False
    """Write CSV files on rank 0. Default false."""
    output_path: str = ""
    """Directory for the CSV files. Default ""."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run. Default "DeepSpeedJobName"."""


@dataclass(kw_only=True)
class WandbConfig:
    """``wandb``: log training events to Weights & Biases."""

    enabled: bool = False
    """Log to W&B on rank 0. Default false."""
    group: str | None = None
    """W&B group. Default null."""
    team: str | None = None
    """W&B team (entity). Default null."""
    project: str = "deepspeed"
    """W&B project. Default "deepspeed"."""


@dataclass(kw_only=True)
class CometConfig:
    """``comet``: log training events to Comet."""

    enabled: bool = False
    """Log to Comet on rank 0. Default false."""
    samples_log_interval: PositiveInt = 100
    """Log every this many samples. Default 100."""
    project: str | None = None
    """Comet project. Default null."""
    workspace: str | None = None
    """Comet workspace. Default null."""
    api_key: str | None = None
    """Comet API key. Default null."""
    experiment_name: str | None = None
    """Experiment name. Default null."""
    experiment_key: str | None = None
    """Experiment key. Default null."""
    online: bool | None = None
    """Online or offline experiment. Default null."""
    mode: str | None = None
    """Comet start mode ("get", "create", "get_or_create"). Default null."""


@dataclass(kw_only=True)
class CommsLoggerConfig:
    """``comms_logger``: log collective operations (size, time, bandwidth)."""

    enabled: bool = False
    """Record communication operations. Default false."""
    verbose: bool = False
    """Print every operation as it happens. Default false."""
    prof_all: bool = True
    """Profile every operation (else only those in prof_ops). Default true."""
    debug: bool = False
    """Add the caller's name to each record. Default false."""
    prof_ops: list[str] = field(default_factory=list)
    """Operation names to profile when prof_all is false. Default []."""


@dataclass(kw_only=True)
class FlopsProfilerConfig:
    """``flops_profiler``: count FLOPs, parameters and latency per module at one step."""

    enabled: bool = False
    """Run the profiler (also turns on wall_clock_breakdown in DeepSpeed). Default false."""
    recompute_fwd_factor: float = 0.0
    """Extra forward FLOPs from activation recomputation, as a fraction. Default 0.0."""
    profile_step: PositiveInt = 1
    """Global step at which to profile. Default 1."""
    module_depth: int = -1
    """Depth of the per-module report; -1 = all. Default -1."""
    top_modules: PositiveInt = 1
    """Number of top modules listed in the aggregated report. Default 1."""
    detailed: bool = True
    """Print the detailed per-module profile. Default true."""
    output_file: str | None = None
    """File for the report; null = stdout. Default null."""


@dataclass(kw_only=True)
class ThroughputTimerConfig:
    """``timers.throughput``."""

    enabled: bool = True
    """Measure samples/s (`engine.tput_timer`), logged on rank 0 every `steps_per_print` steps. Default true."""
    synchronized: bool = True
    """Synchronise the device before reading the clock (exact, costs a sync). Default true."""


@dataclass(kw_only=True)
class TimersConfig:
    """``timers``: engine timers."""

    throughput: ThroughputTimerConfig = field(default_factory=ThroughputTimerConfig)
    """Throughput timer options."""
