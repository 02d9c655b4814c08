"""Memory accounting: what model states occupy on this rank, and what the ZeRO formulas predict.

`measure(module, wrapper)` counts the bytes of the tensors a module and its stage wrapper (the engine's
`module` and `optimizer`) hold, by category: the module's parameters (full or, in stage 3, shards plus
persistent units), gradients (buckets or shards), fp32 master weights (when they are separate tensors),
optimizer state, and communication buffers in flight. Storages shared by several views are counted once.
ZeRO++'s hpZ secondary shards are `secondary_params`: a trainable unit holds one from its first release
after an optimizer step until the next step, so they show between a forward and the step (the formula:
1/`zero_hpz_partition_size` of the 16-bit model, less persistent units), not after it; frozen units keep
theirs.

`estimate(num_params, world_size, stage, dtype)` is the ZeRO paper's per-rank model-state memory for Adam
(design.md's table), the counterpart of DeepSpeed's `estimate_zero*_model_states_mem_needs`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass
class ModelStateBytes:
    params: int = 0
    grads: int = 0
    master_weights: int = 0
    optimizer_state: int = 0
    buffers: int = 0
    secondary_params: int = 0

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.master_weights + self.optimizer_state + self.buffers
            + self.secondary_params
        )  # fmt: skip

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def measure(module, wrapper) -> ModelStateBytes:
    """Bytes of model states this rank holds right now for `module` and its stage wrapper `wrapper` (None:
    no optimizer); call between steps for the steady state."""
    seen: set = set()
    result = ModelStateBytes()
    result.params = _bytes([p.data for p in module.parameters()], seen)
    if wrapper is None:
        return result
    # MoE: one stage wrapper per reduction domain (dense, each expert group), sharing the torch optimizer
    parts = [d.wrapper for d in wrapper.domains] if hasattr(wrapper, "domains") else [wrapper]
    for part in parts:
        _add_wrapper_states(result, part, seen)
    result.grads += _bytes([p.grad for p in module.parameters()], seen)
    state = wrapper.optimizer.state.values()
    result.optimizer_state = _bytes([v for s in state for v in s.values() if torch.is_tensor(v)], seen)
    return result


def _add_wrapper_states(result: ModelStateBytes, wrapper, seen: set) -> None:
    if wrapper.zero_stage == 3:  # released parameters are empty: their memory is the shards
        units = wrapper.coordinator.units
        shards = [u.shard_in_memory() for u in units]  # offloaded ones are not here
        stored = [getattr(u.home, "records", None) for u in units]  # frozen weights stored as int8
        result.params += _bytes([s for s in shards + stored if s is not None], seen)
        result.secondary_params += _bytes([u.secondary for u in units], seen)
    if wrapper.zero_stage == 0:
        result.grads += _bytes([b.buffer for b in wrapper.reducer.buckets], seen)
        masters = wrapper.master_flats
    else:
        if not wrapper._grads_on_nvme:  # NVMe optimizer offload: the gradients are in the swap files
            result.grads += _bytes(wrapper.grads.flat_grads(), seen)
        if wrapper.zero_stage == 1:
            result.grads += _bytes([b.buffer for b in wrapper.grads.buckets], seen)
        masters = wrapper.masters
    result.master_weights += _bytes(masters, seen)
    staging = getattr(wrapper, "grads", None)
    if staging is not None and hasattr(staging, "slots"):
        result.buffers += _bytes([s.staging for s in staging.slots], seen)


def estimate(num_params: int, world_size: int, stage: int, dtype: str = "fp32",
             optimizer_state_bytes: int = 8, hpz_partition_size: int = 1) -> ModelStateBytes:  # fmt: skip
    """Per-rank model-state bytes for `num_params` parameters trained with Adam (8 bytes of state each).

    fp32: parameters 4, gradients 4, optimizer 8 bytes per parameter. fp16/bf16: parameters 2, gradients 2,
    fp32 masters 4, optimizer 8. Stage 1 divides optimizer state and masters by N, stage 2 also gradients,
    stage 3 also parameters. ZeRO++'s hpZ (stage 3, `hpz_partition_size` h > 1) adds a secondary shard of
    1/h of the parameters, held from a step's first forward until the step.
    """
    n, psi = world_size, num_params
    width = BYTES[dtype]
    mixed = dtype != "fp32"
    return ModelStateBytes(
        params=width * psi // (n if stage >= 3 else 1),
        grads=width * psi // (n if stage >= 2 else 1),
        master_weights=(4 * psi // (n if stage >= 1 else 1)) if mixed else 0,
        optimizer_state=optimizer_state_bytes * psi // (n if stage >= 1 else 1),
        secondary_params=width * psi // hpz_partition_size if stage == 3 and hpz_partition_size > 1 else 0,
    )


def format_estimate(num_params: int, world_size: int, dtype: str = "fp32") -> str:
    """A table of the per-rank estimate for stages 0-3, as `estimate_zero*_model_states_mem_needs` prints."""
    lines = [f"{num_params / 1e6:.1f}M parameters, {world_size} ranks, {dtype}, Adam", "stage | per rank"]
    for stage in range(4):
        lines.append(f"{stage:>5} | {estimate(num_params, world_size, stage, dtype).total / 2**30:.2f} GiB")
    return "\n".join(lines)
