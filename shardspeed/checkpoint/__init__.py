"""Model checkpoints: save/load for the engine, file safety rules, and (later) consolidation."""

from shardspeed.checkpoint.files import CheckpointError

__all__ = ["CheckpointError"]
