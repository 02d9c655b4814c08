"""ZenFlow (`zero_optimization.zenflow`): stall-free optimizer offload for ZeRO stages 1 and 2.

The important columns of each weight are updated on the device at every step; the rest accumulate and are
applied by the offloaded optimizer every `update_interval` steps. optimizer.py has the step, columns.py the
column selection over ZeRO shards, schedule.py the intervals, part.py the checkpoint state, affinity.py the
core-split rule of DeepSpeed's overlapped variant.
"""

from shardspeed.zero.zenflow.affinity import split_affinity
from shardspeed.zero.zenflow.optimizer import ZenFlowZeroOptimizer
from shardspeed.zero.zenflow.part import ZenFlowState, zenflow_parts
from shardspeed.zero.zenflow.schedule import ZenFlowSchedule

__all__ = ["ZenFlowSchedule", "ZenFlowState", "ZenFlowZeroOptimizer", "split_affinity", "zenflow_parts"]
