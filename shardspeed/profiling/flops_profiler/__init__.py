"""`FlopsProfiler` and `get_model_profile` (DeepSpeed's `deepspeed.profiling.flops_profiler`)."""

from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
