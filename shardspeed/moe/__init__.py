"""Mixture of Experts with expert parallelism (DeepSpeed's `deepspeed.moe`).

layer.py (MoE), sharded_moe.py (gates, MOELayer), experts.py (Experts), comm.py (the all-to-all),
groups.py (expert / expert-data-parallel groups), utils.py (parameter groups), optimizer.py (the engine part
that reduces and steps expert parameters in their own groups), checkpoint.py (expert checkpoint files).
"""

from shardspeed.moe.layer import MoE

__all__ = ["MoE"]
