"""OSS's state dict: the sharded optimizer state as one PyTorch optimizer state dict, and back.

FairScale's `OSS.state_dict()` is what a plain torch optimizer over all the model's parameters would save:
`{"state": {index: {key: value}}, "param_groups": [{..., "params": [index, ...]}]}`, indices counting the
parameters of all groups in order. Here each rank holds a contiguous shard of every flat bucket's state
(Adam's `exp_avg` is one flat tensor per bucket), so consolidating all-gathers each per-element state
tensor of a bucket and cuts it back into per-parameter tensors of the parameters' shapes; loading does the
reverse, and each rank keeps its shard. Scalar state (`step`) is the same on every rank and every
parameter of a bucket. A state dict saved at another world size, or by a torch optimizer, loads the same.
"""

from __future__ import annotations

import torch

from shardspeed.comm.collectives import all_gather_flat
from shardspeed.core.placement import place_optimizer_state

__all__ = ["consolidated_state", "load_sharded_state"]

_SCALAR_KEYS = {"step"}  # torch keeps these as 0-dim tensors even for a 0-dim parameter


def _per_element(key: str, value, shape) -> bool:
    return key not in _SCALAR_KEYS and torch.is_tensor(value) and tuple(value.shape) == tuple(shape)


def _all_parameters(param_groups: list[dict]) -> list:
    return [p for g in param_groups for p in g["params"]]


def consolidated_state(stepper, param_groups: list[dict], hyperparameters) -> dict:
    """The whole state on every rank (collective: one all-gather per per-element state tensor of a bucket)."""
    index_of = {id(p): i for i, p in enumerate(_all_parameters(param_groups))}
    state: dict[int, dict] = {}
    for bucket, master in zip(stepper.buckets, stepper.masters):
        own = stepper.optimizer.state.get(master, {})
        for key in sorted(own):  # the same keys on every rank: all ranks step every bucket together
            value = own[key]
            if _per_element(key, value, master.shape):
                full = torch.empty(bucket.padded_numel, dtype=value.dtype, device=value.device)
                all_gather_flat(full, value.contiguous(), group=stepper.group)
                full = full.cpu()
            for param, offset, numel, shape in zip(
                bucket.params, bucket.offsets, bucket.numels, bucket.shapes
            ):
                entry = state.setdefault(index_of[id(param)], {})
                if _per_element(key, value, master.shape):
                    entry[key] = full[offset : offset + numel].view(shape).clone()
                else:
                    entry[key] = value.clone().cpu() if torch.is_tensor(value) else value
    groups = [{**hyperparameters(g), "params": [index_of[id(p)] for p in g["params"]]} for g in param_groups]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_sharded_state(stepper, param_groups: list[dict], state_dict: dict) -> None:
    """Give each bucket's master this rank's shard of the saved per-parameter state (no collective)."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    saved = {id(p): state_dict["state"].get(i, {}) for p, i in zip(_all_parameters(param_groups), saved_ids)}
    group_of = {id(m): g for g in stepper.optimizer.param_groups for m in g["params"]}
    for bucket, master in zip(stepper.buckets, stepper.masters):
        entries = [saved.get(id(p), {}) for p in bucket.params]
        keys = sorted({k for entry in entries for k in entry})
        shard_state = {}
        for key in keys:
            values = [entry.get(key) for entry in entries]
            sample = next(v for v in values if v is not None)
            if not any(_per_element(key, v, s) for v, s in zip(values, bucket.shapes) if v is not None):
                shard_state[key] = sample
                continue
            full = torch.zeros(bucket.padded_numel, dtype=sample.dtype)
            for value, offset, numel in zip(values, bucket.offsets, bucket.numels):
                if value is not None:
                    full[offset : offset + numel].copy_(value.reshape(-1))
            start = bucket.rank * bucket.shard_numel
            shard_state[key] = full[start : start + bucket.shard_numel]
        stepper.optimizer.state[master] = place_optimizer_state(shard_state, master, group_of[id(master)])
