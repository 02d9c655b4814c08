"""Turning the `expert_parallel` block on for a model: parse and check the block, build the expert-parallel
groups, find the MoE blocks and replace them by this rank's `AutoEPMoELayer`s. Collective (creates groups).

With `tensor_parallel.autotp_size` > 1 the layers are folded onto the tensor-parallel ranks (folded_layer.py):
the expert groups are the folded layout's, spanning tensor lanes.

Called by the engine's MoE part before it looks for MoE layers, so the replaced layers are then handled like
`deepspeed.moe` layers: their expert weights reduce over the expert-data-parallel group, the rest over the
data-parallel group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from shardspeed.core.layout import tensor_group
from shardspeed.moe.autoep.config import AutoEPConfig, parse_autoep_config
from shardspeed.moe.autoep.detect import AutoEP
from shardspeed.moe.autoep.folded_layer import FoldedDispatch, build_folding_groups
from shardspeed.moe.autoep.folding import build_folding_spec
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.autoep.validate import validate_autoep_config, validate_autoep_post_detection

logger = logging.getLogger(__name__)

__all__ = ["apply_autoep", "block_to_config"]


def block_to_config(block: Any) -> AutoEPConfig:
    """The typed `expert_parallel` block (its `enabled` and the other keys as given) as an `AutoEPConfig`."""
    return parse_autoep_config({"enabled": block.enabled, **dict(block.options)})


def apply_autoep(
    module: nn.Module, block: Any, *, mpu=None, zero_stage: int = 0, tp_size: int = 1
) -> list[AutoEPMoELayer]:
    """Replace `module`'s MoE blocks when the block is enabled; return the new layers (none when disabled)."""
    from shardspeed.moe.groups import build_expert_groups, data_parallel_slices

    config = block_to_config(block)
    if config.enabled and zero_stage == 3:
        raise ValueError(
            "expert_parallel with ZeRO stage 3 is not supported: AutoEP's expert weights are not partitioned "
            "by ZeRO-3 here; use ZeRO stage 0, 1 or 2"
        )
    if config.enabled and tp_size > 1:  # expert parallelism folded onto the tensor-parallel ranks
        return _apply_folded(module, config, mpu=mpu, tp_size=tp_size, zero_stage=zero_stage)
    dp_world = len(data_parallel_slices(mpu)[0]) if config.enabled else 1
    validate_autoep_config(
        config, world_size=dp_world, pp_size=1, tp_size=1, sp_size=1, zero_stage=zero_stage
    )
    if not config.enabled:
        return []
    auto_ep = AutoEP(module, config)
    specs = auto_ep.ep_parser()
    if not specs:
        raise ValueError("expert_parallel is enabled but the model has no MoE block AutoEP recognises")
    validate_autoep_post_detection(config, specs)
    groups = build_expert_groups([config.autoep_size], mpu)
    group = groups[f"ep_size_{config.autoep_size}"]
    layers = auto_ep.replace_moe_layers(specs, config.autoep_size, group.ep_rank)
    for layer in layers:
        layer.set_deepspeed_parallelism(groups=groups)
    return layers


def _apply_folded(module, config, *, mpu, tp_size: int, zero_stage: int = 0) -> list:
    """Replace `module`'s MoE blocks by AutoEP layers folded onto the AutoTP grid `mpu` (tensor degree
    `tp_size`); return the layers. Collective (creates the layout's groups)."""
    if mpu is None:
        raise ValueError(
            f"expert_parallel folded onto tensor_parallel.autotp_size={tp_size} needs the tensor-parallel grid "
            "deepspeed.initialize builds for that block"
        )
    world = dist.get_world_size()
    validate_autoep_config(
        config, world_size=world, pp_size=1, tp_size=tp_size, sp_size=1, zero_stage=zero_stage, mpu=mpu
    )
    auto_ep = AutoEP(module, config)
    specs = auto_ep.ep_parser()
    if not specs:
        raise ValueError("expert_parallel is enabled but the model has no MoE block AutoEP recognises")
    validate_autoep_post_detection(config, specs)
    spec = build_folding_spec(world_size=world, pp_size=1, tp_size=tp_size, ep_size=config.autoep_size)
    handles, groups = build_folding_groups(spec, tensor_group(mpu), mpu.get_data_parallel_group())
    layers = auto_ep.replace_moe_layers(specs, config.autoep_size, groups[handles.ep_group_name].ep_rank)
    for layer in layers:
        FoldedDispatch.bind(layer, handles, groups)
    return layers
