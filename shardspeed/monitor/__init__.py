"""`shardspeed.monitor`: training events to TensorBoard, CSV files, Weights & Biases and Comet
(DeepSpeed's `deepspeed.monitor`). The engine holds one `MonitorMaster` as `engine.monitor`."""

from shardspeed.monitor.monitor import Monitor, MonitorMaster

__all__ = ["Monitor", "MonitorMaster"]
