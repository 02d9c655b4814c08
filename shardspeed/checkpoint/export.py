"""`engine.save_16bit_model`: the module's weights in the training dtype, in one file on rank 0.

Under ZeRO-3 the weights exist only as shards, so (as DeepSpeed) the export needs
`zero_optimization.stage3_gather_16bit_weights_on_model_save: true`; it then gathers one unit at a time,
so no rank ever holds more than the output plus one unit. Under tensor parallelism each sharded weight is
gathered whole from its tensor group. A `.safetensors` file name writes safetensors.

The functions take a `WeightsSource` (what the engine's parts say about where the weights are), not the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardspeed.checkpoint import files
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.model_states import shared_params
from shardspeed.utils.logging import log_dist


@dataclass(frozen=True)
class WeightsSource:
    """Where the module's weights are, for an export."""

    module: Any
    stage3_units: list | None = None  # ZeRO-3: the units holding the parameters as shards (None below 3)
    tp_group: Any = None  # tensor parallelism: the group whose shards make each whole weight
    experts_split: bool = False  # expert parallelism (ep_size > 1): each rank holds other experts
    gather_on_save: bool = False  # zero_optimization.stage3_gather_16bit_weights_on_model_save


def _gathered_state_dict(units: list) -> dict[str, torch.Tensor]:
    """Every parameter's full value (all ranks take part; rank 0 keeps CPU copies)."""
    state = {}
    keep = dist.get_rank() == 0
    for unit in units:
        unit.hold()
        if keep:
            for name, p in zip(unit.names, unit.params):
                state[name] = p.detach().to("cpu", copy=True)
        unit.let_go()
    return state


def consolidated_16bit_state_dict(
    source: WeightsSource, exclude_frozen_parameters: bool = False
) -> dict | None:
    """The module's full state dict in the training dtype on rank 0 (None on other ranks; collective).

    Under ZeRO-3 the parameters are gathered one unit at a time into CPU copies on rank 0; tied parameters
    appear under every name, as in `module.state_dict()`.
    """
    module = source.module
    if source.experts_split:
        raise NotImplementedError(
            "a consolidated 16-bit state dict of a model with expert parallelism (ep_size > 1) is not "
            "supported yet: each rank holds other experts; save_checkpoint writes every expert by global index"
        )
    params = _gathered_state_dict(source.stage3_units) if source.stage3_units is not None else None
    module_state = module.state_dict()
    if (
        source.tp_group is not None
    ):  # whole weights from every tensor rank's shard (collective per tensor group)
        from shardspeed.module_inject.tp_state import tp_full_state_dict

        module_state = tp_full_state_dict(module, source.tp_group, module_state)
    if dist.get_rank() != 0:
        return None
    state = {}
    for key, value in module_state.items():
        state[key] = value.detach().cpu() if params is None or value.numel() else value
    if params is not None:
        shared = shared_params(module)
        state.update(params)
        state.update({alias: params[source] for alias, source in shared.items()})
    if exclude_frozen_parameters:
        for name, p in module.named_parameters():
            if not p.requires_grad:
                state.pop(name, None)
    _refuse_partial_weights(module, state)
    return state


def _refuse_partial_weights(module, state: dict) -> None:
    """Never hand out a weight smaller than the parameter it stands for: a ZeRO-3 parameter's `.data` is
    empty while released, and an export that picked that up would write a file that loads as garbage."""
    wrong = [
        f"{name} {tuple(state[name].shape)} (full shape {tuple(p.ds_shape)})"
        for name, p in module.named_parameters(remove_duplicate=False)
        if name in state and hasattr(p, "ds_shape") and tuple(state[name].shape) != tuple(p.ds_shape)
    ]
    if wrong:
        raise CheckpointError(
            f"refusing to export {len(wrong)} ZeRO-3 parameter(s) that are not gathered in full: "
            + ", ".join(wrong[:5])
        )


def save_16bit_model(source: WeightsSource, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:  # fmt: skip
    if source.stage3_units is not None and not source.gather_on_save:
        log_dist(
            "save_16bit_model did nothing: under ZeRO-3 set zero_optimization."
            "stage3_gather_16bit_weights_on_model_save to true to gather the weights for export",
            level=30,
        )
        return False
    state = consolidated_16bit_state_dict(source, exclude_frozen_parameters)
    if dist.get_rank() == 0:
        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if save_filename.endswith(".safetensors"):
            from shardspeed.checkpoint.consolidate import save_safetensors

            save_safetensors(state, path)
        else:
            files.save_file(state, path)
    dist.barrier()
    return True
