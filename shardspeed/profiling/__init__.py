"""`shardspeed.profiling`: the flops profiler (DeepSpeed's `deepspeed.profiling.flops_profiler`)."""
