"""DeepSpeed's `deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save` and checkpoint file names.

`clone_tensors_for_torch_save` is DeepSpeed's helper for writing a state dict whose tensors are views.

`torch.save` writes a view's whole storage, so a state dict of views into flat buffers (ZeRO's buckets)
would write every buffer once per view. Accelerate calls this on `get_state_dict` before saving.
"""

from __future__ import annotations

import os

import torch

from shardspeed.checkpoint.files import model_states_name

__all__ = ["clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]


def get_model_ckpt_name_for_rank(base_folder, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank `mp_rank_str` ("00", "01", ...) in a tag folder."""
    return os.path.join(base_folder, model_states_name(int(mp_rank_str)))


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):  # noqa: B008 (DeepSpeed's default)
    """A copy of `item` (nested dicts, lists, tuples) with every tensor cloned onto `device`, detached."""
    if torch.is_tensor(item):
        if type(device) is str:
            device = torch.device(device)
        if device == item.device:
            return item.detach().clone()
        return item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
