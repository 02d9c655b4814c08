"""DeepSpeed's `deepspeed.runtime.zero` path. ZeRO itself lives in `shardspeed/zero/`; the names DeepSpeed
has here (`Init`, `GatheredParameters`, `stage3.DeepSpeedZeroOptimizer_Stage3`, `config.DeepSpeedZeroConfig`, ...)
come from the path table (shardspeed/compat/paths.py). partition_parameters.py holds the names code patches.
"""
