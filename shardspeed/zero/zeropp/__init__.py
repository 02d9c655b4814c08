"""ZeRO++: less ZeRO-3 traffic across nodes (DeepSpeed's four `zero_optimization` switches).

- `zero_quantized_weights` (qwZ): parameter gathers for forward and backward move int8 blocks plus fp32
  scales instead of 16-bit values (weights.py, quantize.py);
- `zero_hpz_partition_size` (hpZ): after a unit's first gather of a step each rank keeps a secondary
  shard, so the step's later gathers stay within groups of that many ranks — a node (weights.py);
- `zero_quantized_gradients` (qgZ): the gradient reduce-scatter becomes two int4 all-to-alls, inside each
  node, then across nodes (gradients.py);
- `zero_quantized_nontrainable_weights`: frozen parameters are stored as int8 (weights.py).

`build_zeropp` is the engine's part: it checks the combination, creates the node groups once
(comm/topology.py `NodeGroups`, nodes from comm/nodes.py) and hands stage 3 the gather paths and the
reduction. With every switch off it returns None and stage 3 runs exactly as without ZeRO++.
`zero.Init(zero_quantized_weights=True / zero_quantized_nontrainable_weights=True)` turns the switch on
for the engine that partitions those parameters, as the config key does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardspeed.comm.nodes import NodeLayout
from shardspeed.comm.topology import NodeGroups
from shardspeed.config import ConfigError
from shardspeed.utils.logging import log_dist
from shardspeed.zero.zeropp.gradients import QuantizedGradientReduce
from shardspeed.zero.zeropp.weights import QuantizedHome, WeightGather

__all__ = ["QuantizedGradientReduce", "QuantizedHome", "WeightGather", "ZeroPlusPlus", "build_zeropp"]

_KEY = "zero_optimization."


@dataclass
class ZeroPlusPlus:
    """What stage 3 uses: the gather paths of its units, and the gradient reduction (None: plain)."""

    weights: WeightGather
    gradients: QuantizedGradientReduce | None
    node_groups: NodeGroups | None

    def describe(self) -> str:
        parts = []
        if self.weights.quantize_weights:
            parts.append("qwZ (int8 weight gathers)")
        if self.weights.hpz_size > 1:
            parts.append(f"hpZ (secondary shards over {self.weights.hpz_size} ranks)")
        if self.gradients is not None:
            parts.append(
                f"qgZ (int4 gradients, {self.gradients.num_nodes} nodes x {self.gradients.local_size})"
            )
        if self.weights.quantize_frozen:
            parts.append("frozen weights stored as int8")
        return "ZeRO++: " + ", ".join(parts)


def requested_by_init(module) -> dict[str, bool]:
    """The ZeRO++ switches `zero.Init(...)` turned on for `module`'s parameters."""
    flags: dict[str, bool] = {}
    for p in module.parameters():
        for key, on in getattr(p, "_zero_init_zeropp", {}).items():
            flags[key] = flags.get(key, False) or on
    return flags


def build_zeropp(zero_cfg, *, stage: int, group, module, moe: bool = False) -> ZeroPlusPlus | None:
    """The ZeRO++ part for this engine, or None when every switch is off (collective when hpZ or qgZ is on:
    the node groups are created here, on every rank)."""
    init = requested_by_init(module)
    quantize_weights = zero_cfg.zero_quantized_weights or init.get("zero_quantized_weights", False)
    quantize_frozen = zero_cfg.zero_quantized_nontrainable_weights or init.get(
        "zero_quantized_nontrainable_weights", False
    )
    hpz, quantize_grads = int(zero_cfg.zero_hpz_partition_size), bool(zero_cfg.zero_quantized_gradients)
    on = [name for name, value in (("zero_quantized_weights", quantize_weights),
                                   ("zero_quantized_nontrainable_weights", quantize_frozen),
                                   ("zero_hpz_partition_size", hpz > 1),
                                   ("zero_quantized_gradients", quantize_grads)) if value]  # fmt: skip
    if not on:
        return None
    _check_combination(zero_cfg, on, stage=stage, moe=moe, world=dist.get_world_size(group))
    node_groups = None
    if hpz > 1 or quantize_grads:
        key = _KEY + ("zero_hpz_partition_size" if hpz > 1 else "zero_quantized_gradients")
        try:
            layout = NodeLayout.from_env(dist.get_world_size())
            node_groups = NodeGroups(group, layout, hpz_size=hpz, hierarchical=quantize_grads)
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None
        if hpz > 1 and node_groups.hpz_spans_nodes:
            log_dist(f"{key}={hpz} puts ranks of several nodes ({layout.source}={layout.ranks_per_node}) in one "
                     "secondary partition group, so hpZ's gathers cross nodes", ranks=[0], level=30)  # fmt: skip
    weights = WeightGather(
        quantize_weights=quantize_weights,
        quantize_frozen=quantize_frozen,
        hpz_group=node_groups.hpz if hpz > 1 else None,
        hpz_size=hpz,
    )
    gradients = QuantizedGradientReduce(node_groups) if quantize_grads else None
    part = ZeroPlusPlus(weights, gradients, node_groups)
    log_dist(part.describe(), ranks=[0])
    return part


def _check_combination(zero_cfg, on: list[str], *, stage: int, moe: bool, world: int) -> None:
    """Refuse, by key, what ZeRO++ cannot do (rather than run without it)."""
    first = _KEY + on[0]
    if stage != 3:
        raise ConfigError(
            f"{first}: ZeRO++ acts on ZeRO stage 3's parameter gathers and gradient reduction; got "
            f"{_KEY}stage {stage} (set it to 3, or remove the ZeRO++ keys)"
        )
    hpz = int(zero_cfg.zero_hpz_partition_size)
    if hpz > world:
        raise ConfigError(
            f"{_KEY}zero_hpz_partition_size: {hpz} is more than the {world} data-parallel ranks"
        )
    hierarchical = [k for k in ("zero_hpz_partition_size", "zero_quantized_gradients") if k in on]
    if moe and hierarchical:
        raise ConfigError(
            f"{_KEY}{hierarchical[0]}: not supported with Mixture-of-Experts layers (their expert groups are "
            "not cut along nodes); zero_quantized_weights works with them"
        )
    offload = zero_cfg.offload_param is not None and zero_cfg.offload_param.device != "none"
    for key in ("zero_hpz_partition_size", "zero_quantized_nontrainable_weights"):
        if offload and key in on:
            raise ConfigError(
                f"{_KEY}{key}: not supported together with {_KEY}offload_param (device "
                f"{zero_cfg.offload_param.device!r}): both decide where parameter shards live"
            )
    if "zero_quantized_gradients" in on and not zero_cfg.reduce_scatter:
        raise ConfigError(
            f"{_KEY}zero_quantized_gradients: replaces the gradient reduce-scatter, so it cannot be combined "
            f"with {_KEY}reduce_scatter false"
        )
    gathers = [k for k in ("zero_quantized_weights", "zero_hpz_partition_size") if k in on]
    fetch_modes = [
        k
        for k in ("stage3_allgather_sequential", "stage3_use_all_reduce_for_fetch_params")
        if getattr(zero_cfg, k)
    ]
    if gathers and fetch_modes:
        raise ConfigError(
            f"{_KEY}{gathers[0]}: decides how stage 3 gathers parameters, so it cannot be combined with "
            f"{_KEY}{fetch_modes[0]} true (remove one of the two)"
        )
