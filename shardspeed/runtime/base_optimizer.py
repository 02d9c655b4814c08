"""DeepSpeed's `deepspeed.runtime.base_optimizer` names for the optimizer wrappers the engine returns.

Lightning checks `isinstance(x, DeepSpeedOptimizer)` when restoring a checkpoint; every wrapper shardspeed
builds (stage 0's data-parallel one, ZeRO stages 1-3) derives from `OptimizerWrapper`.
"""

from shardspeed.runtime.optimizer_wrapper import OptimizerWrapper
from shardspeed.zero.optimizer import ZeroOptimizer

DeepSpeedOptimizer = OptimizerWrapper
ZeROOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
