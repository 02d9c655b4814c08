"""Which config keys shardspeed implements, and the one warning for the DeepSpeed keys it does not yet.

To mark a feature as built, add its key path to ``IMPLEMENTED`` (a whole block, e.g. ``"tensorboard"``,
or one key inside a block, e.g. ``"checkpoint.load_universal"``) and update docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["IMPLEMENTED", "unimplemented_keys"]

IMPLEMENTED: frozenset[str] = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "prescale_gradients",
        "gradient_predivide_factor",
        "communication_data_type",
        # ZeRO: every stage, and the keys the engine honours. Some are honoured by construction:
        # gradients always live in contiguous buckets (contiguous_gradients), every rank owns a slice of
        # every bucket (round_robin_gradients' balance), one collective per bucket
        # (use_multi_rank_bucket_allreduce), and checkpoints always load at any world size
        # (elastic_checkpoint). ZeRO++, MiCS and the rest are accepted and warned about.
        "zero_optimization.stage",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.reduce_scatter",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.overlap_comm",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.legacy_stage1",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_param",
        "aio.block_size",
        "aio.queue_depth",
        "aio.intra_op_parallelism",
        "aio.single_submit",
        "aio.overlap_events",
        "data_types",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dataloader_drop_last",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "checkpoint.tag_validation",
        "activation_checkpointing",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "flops_profiler",
        "comms_logger",
        # The pipeline engine reads the whole block; pipe_partitioned/grad_partitioned only matter with a
        # tensor-parallel axis, where DeepSpeed splits transfers between stages over the tensor ranks.
        "pipeline",
        "sequence_parallel_size",  # Ulysses: sequence groups from the topology (runtime/layout.py)
        "tensor_parallel",
        "compression_training",  # shardspeed/compression; the engine steps its scheduler
    }
)


def unimplemented_keys(config: Any, given: set[str]) -> list[str]:
    """Key paths the user set (in ``given``) that would change behaviour but are not implemented.

    A block with an ``enabled`` switch counts only when enabled; any other key only when its value
    differs from the default (a key restating its default changes nothing, here or in DeepSpeed).
    """
    found: list[str] = []
    for f in dataclasses.fields(config):
        if f.name in given:
            found += _walk(f.name, getattr(config, f.name), _default(f), given)
    return found


def _walk(path: str, value: Any, default: Any, given: set[str]) -> list[str]:
    if path in IMPLEMENTED:
        return []
    partly_implemented = any(key.startswith(path + ".") for key in IMPLEMENTED)
    if partly_implemented and dataclasses.is_dataclass(value):
        found: list[str] = []
        for f in dataclasses.fields(value):
            sub = f"{path}.{f.name}"
            if sub in given:
                found += _walk(sub, getattr(value, f.name), _default(f), given)
        return found
    return [path] if _has_effect(value, default) else []


def _has_effect(value: Any, default: Any) -> bool:
    if dataclasses.is_dataclass(value):
        if isinstance(getattr(value, "enabled", None), bool):
            return value.enabled
        if getattr(type(value), "ACTIVE_WHEN_PRESENT", False):
            return True
    return value != default


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
