"""DeepSpeed's `deepspeed.utils.groups` getters for the process groups of each parallel axis.

Integrations (Accelerate, Transformers) ask this module for the data-parallel and sequence-parallel groups.
Only data parallelism exists here so far: every other axis has size 1 and the rank's own position 0, which
is what DeepSpeed answers when that axis is not configured.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
]


def _get_data_parallel_group():
    return dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _get_data_parallel_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _get_model_parallel_world_size() -> int:
    return 1


def _get_model_parallel_rank() -> int:
    return 0


def _get_sequence_parallel_group():
    return None  # no sequence parallelism: Accelerate only asks when sp_size > 1, which initialize refuses


def _get_sequence_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_rank() -> int:
    return 0


def _get_sequence_data_parallel_group():
    return _get_data_parallel_group()
