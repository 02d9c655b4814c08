"""Where each piece of training state lives: the one place that decides it, and a check that it holds.

| piece | lives on |
|---|---|
| module parameters and buffers, gradient buckets | the engine's device |
| the tensors the torch optimizer steps (fp32 masters, or the parameters/shards themselves) | the offload host (CPU) with `offload_optimizer`, else the engine's device |
| per-element optimizer state (Adam's moments, ...) | its optimizer tensor's device and dtype |
| the `step` counter | CPU, or the optimizer tensor's device when the group is fused or capturable (torch's rule) |

Checkpoint files are always read onto the CPU (`map_location="cpu"`): whatever device saved them, nothing
lands on a device by accident. Every path that installs loaded optimizer state goes through
`place_optimizer_state`, so the state follows its tensor wherever that lives. A ZeRO resume once put Adam's
moments on the CPU next to CUDA masters (the fast-path load cloned what the file held); `placement_problems`
is what tests call after every load to catch that class of bug on any machine.
"""

from __future__ import annotations

import torch

__all__ = ["place_optimizer_state", "place_state_value", "placement_problems"]


def place_state_value(key: str, value, tensor: torch.Tensor, group: dict):
    """A loaded optimizer-state value put where torch's optimizers expect it next to `tensor`."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(device=tensor.device, dtype=torch.float32)
        return value.to(device="cpu")
    if value.is_floating_point():
        return value.to(device=tensor.device, dtype=tensor.dtype)
    return value.to(device=tensor.device)


def place_optimizer_state(state: dict, tensor: torch.Tensor, group: dict, copy: bool = True) -> dict:
    """A fresh state dict for `tensor` with every value placed. With `copy` (checkpoint loads) no loaded
    tensor is kept itself: a checkpoint may be memory-mapped or shared by several readers. NVMe swap-ins pass
    `copy=False`: what they read is theirs alone."""
    placed = {}
    for key, value in state.items():
        moved = place_state_value(key, value, tensor, group)
        placed[key] = moved.clone() if copy and torch.is_tensor(moved) and moved is value else moved
    return placed


def placement_problems(module, wrapper, device: torch.device) -> list[str]:
    """Every tensor of `module` and of its stage wrapper `wrapper` (None: no optimizer) that is not where
    the table above says for a run on `device` (the engine's `module`, `optimizer` and `device`); empty
    when all is in place."""
    problems = []
    for name, value in [*module.named_parameters(), *module.named_buffers()]:
        if value.device != device:
            problems.append(f"module tensor {name} is on {value.device}, expected {device}")
    torch_optimizer = getattr(wrapper, "optimizer", None)
    if torch_optimizer is None:
        return problems
    offload = getattr(wrapper, "offload", None)
    home = offload.host if offload is not None else device
    for group_index, group in enumerate(torch_optimizer.param_groups):
        for index, tensor in enumerate(group["params"]):
            where = f"optimizer group {group_index} tensor {index}"
            if tensor.device != home:
                problems.append(f"{where} is on {tensor.device}, expected {home}")
            for key, value in torch_optimizer.state.get(tensor, {}).items():
                if not torch.is_tensor(value):
                    continue
                # the rule that places loaded state is the rule the live state must already satisfy
                placed = place_state_value(key, value, tensor, group)
                if (value.device, value.dtype) != (placed.device, placed.dtype):
                    problems.append(
                        f"{where} state {key!r} is {value.dtype} on {value.device}, expected "
                        f"{placed.dtype} on {placed.device}"
                    )
    return problems
