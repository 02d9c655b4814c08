"""`ExpertParallelism`: the engine's MoE part — groups for the model's MoE layers, start-up broadcasts,
and the optimizer wrappers of each gradient-reduction domain.

Built by the engine when the module holds `MoE` layers or the `expert_parallel` block (AutoEP) replaced its
Hugging Face MoE blocks by `AutoEPMoELayer`s (none otherwise). At construction, collectively:
the expert-parallel and expert-data-parallel groups of every ep size in the model are created from the
data axis (groups.py) and handed to the layers. Dense tensors start from data-parallel rank 0's values, as
without MoE; an expert's tensors from the first rank of its expert-data-parallel group (the ranks holding
that expert), as DeepSpeed does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.moe.autoep.apply import apply_autoep
from shardspeed.moe.autoep.experts import GroupedExperts
from shardspeed.moe.autoep.layer import AutoEPMoELayer
from shardspeed.moe.experts import Experts
from shardspeed.moe.groups import ExpertGroups, build_expert_groups
from shardspeed.moe.layer import MoE
from shardspeed.moe.optimizer import ExpertParallelOptimizer, ReductionDomain
from shardspeed.moe.utils import is_moe_param

__all__ = ["ExpertParallelism"]


class ExpertParallelism:
    def __init__(self, module: nn.Module, layers: list[MoE], groups: ExpertGroups, dp_group):
        self.module = module
        self.layers = layers
        self.groups = groups
        self.dp_group = dp_group
        expert_modules = [m for m in module.modules() if isinstance(m, (Experts, GroupedExperts))]
        self._expert_ids = {id(t) for m in expert_modules for t in [*m.parameters(), *m.buffers()]}

    @classmethod
    def discover(
        cls,
        module: nn.Module,
        mpu=None,
        dp_group=None,
        data_before_expert: bool = False,
        autoep=None,
        zero_stage: int = 0,
        tp_size: int = 1,
    ):
        """The part for `module`, or None without MoE layers (collective: creates the groups). `autoep`: the
        `expert_parallel` block; when enabled, the model's MoE blocks are first replaced by AutoEP layers."""
        if autoep is not None:
            apply_autoep(module, autoep, mpu=mpu, zero_stage=zero_stage, tp_size=tp_size)
        layers = [m for m in module.modules() if isinstance(m, (MoE, AutoEPMoELayer))]
        if not layers:
            return None
        if data_before_expert:
            from shardspeed.config import ConfigError

            raise ConfigError(
                "use_data_before_expert_parallelism: true is not supported; expert-parallel groups are "
                "consecutive data-parallel ranks (the default, false)"
            )
        folded = [layer for layer in layers if getattr(layer, "folding", None) is not None]
        if folded:  # AutoEP folded onto AutoTP: the layers hold the layout's groups already
            if len(folded) != len(layers):
                raise ValueError(
                    "AutoEP layers folded onto tensor parallelism cannot be combined with deepspeed.moe layers"
                )
            groups = folded[0].folding.groups
            if groups is None:
                raise ValueError(
                    "AutoEP layers bound to folding handles by hand: enable expert_parallel with "
                    "tensor_parallel.autotp_size > 1 so the engine builds the layout's groups"
                )
            return cls(module, layers, groups, dp_group)
        groups = build_expert_groups([layer.ep_size for layer in layers], mpu)
        for layer in layers:
            layer.set_deepspeed_parallelism(groups=groups)
        return cls(module, layers, groups, dp_group)

    def group_names(self) -> list[str]:
        return sorted({layer.expert_group_name for layer in self.layers})

    # -- start-up ------------------------------------------------------------------------------------------

    def replicated_tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers every data-parallel rank holds identically (everything but experts)."""
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return [t for t in tensors if id(t) not in self._expert_ids]

    def broadcast_experts(self, broadcast) -> None:
        """`broadcast(tensors, group)` each layer's expert tensors within their expert-data-parallel group."""
        for layer in self.layers:
            experts = layer.experts if isinstance(layer, AutoEPMoELayer) else layer.deepspeed_moe.experts
            group = self.groups[layer.expert_group_name].edp_group
            broadcast([*experts.parameters(), *experts.buffers()], group)

    # -- optimizer -----------------------------------------------------------------------------------------

    def wrap_optimizer(
        self, optimizer, named, wrap_params, *, scaler, clip: float
    ) -> ExpertParallelOptimizer:
        """One wrapper per domain: `wrap_params(optimizer, named_subset, group, owned_ids)` builds the stage's
        wrapper over a subset of the parameters (`owned_ids`: every module parameter it owns, frozen too)."""
        everything = list(self.module.named_parameters())
        dense = [(n, p) for n, p in named if not is_moe_param(p)]
        dense_owned = {id(p) for _, p in everything if not is_moe_param(p)}
        domains = [ReductionDomain("dense", wrap_params(optimizer, dense, self.dp_group, dense_owned))]
        for name in self.group_names():
            group = self.groups[name]
            mine = [(n, p) for n, p in named if is_moe_param(p) and p.group_name == name]
            owned = {id(p) for _, p in everything if is_moe_param(p) and p.group_name == name}
            wrapper = wrap_params(optimizer, mine, group.edp_group, owned)
            # folded onto tensor lanes, each lane's expert gradient arrives tp_lanes times over (folded_layer.py)
            wrapper.gradient_scale = group.edp_size / (group.dp_world_size * group.tp_lanes)
            domains.append(ReductionDomain(name, wrapper, group.ep_group))
        return ExpertParallelOptimizer(optimizer, domains, scaler=scaler, clip=clip)

    def expert_rank(self, name: str) -> int:
        return dist.get_rank(self.groups[name].ep_group)
