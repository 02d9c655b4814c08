"""`shardspeed.profiling`: the flops profiler (DeepSpeed's `deepspeed.profiling.flops_profiler`)."""

from shardspeed.profiling import flops_profiler

__all__ = ["flops_profiler"]
