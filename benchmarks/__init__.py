"""Side-by-side benchmarks: shardspeed against one process, torch DDP/ZeRO/FSDP2 and DeepSpeed (see README.md)."""
