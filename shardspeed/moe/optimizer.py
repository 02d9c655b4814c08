"""`ExpertParallelOptimizer`: one optimizer wrapper per gradient-reduction domain, stepped as one.

A model with MoE layers has parameters reduced over different groups: dense parameters over the whole
data-parallel group, the experts of each ep size over their expert-data-parallel group. The engine builds
one ordinary stage wrapper (stage 0 `DataParallelOptimizer` or a `ZeroOptimizer`) per domain, over that
domain's parameters and group — so ZeRO partitions expert parameters, gradients and optimizer state within
the expert-data-parallel group — all sharing the one torch optimizer and the one loss scaler. This class
drives them through the engine's optimizer protocol.

Scaling. A rank's loss is the mean over its own tokens, and an expert receives the tokens of every rank
of its expert-parallel group, so after averaging over the expert-data-parallel group (`edp` ranks) an
expert gradient is `ep` times the gradient of the mean loss over the data-parallel world (`dp = ep·edp`).
Each expert domain's gradients are multiplied by `edp / dp` (folded into the step's multiplier), which
makes training at any ep size match ep 1, as DeepSpeed 0.19 does (it divides expert sums by `dp`). The
gradient accessors apply the same factor (`OptimizerWrapper.gradient_scale`).

Norm and overflow. The global norm combines every domain: the dense norm, plus for each expert domain the
sum over its expert-parallel group of the (scaled) norms, so each expert shard is counted once. One
multiplier (unscale and clip) follows from it, so an fp16 overflow anywhere skips the step everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_reduce
from shardspeed.core.optimizer_wrapper import OptimizerWrapper

__all__ = ["ExpertParallelOptimizer", "ReductionDomain"]


@dataclass
class ReductionDomain:
    """One stage wrapper (its `gradient_scale`: how its reduced gradients relate to the mean over the
    data-parallel world) and the group its norm is combined over."""

    name: str  # "dense" or an expert group name ("ep_size_2")
    wrapper: OptimizerWrapper
    norm_group: object = None  # the expert-parallel group whose ranks hold the domain's other experts


class ExpertParallelOptimizer(OptimizerWrapper):
    def __init__(
        self, optimizer: torch.optim.Optimizer, domains: list[ReductionDomain], *, scaler, clip: float
    ):
        self.optimizer = optimizer
        self.domains = domains
        self.scaler = scaler
        self.clip = clip
        self.zero_stage = domains[0].wrapper.zero_stage
        self.overflow = False
        self.grad_norm: float | None = None
        coordinators = [d.wrapper.coordinator for d in domains if getattr(d.wrapper, "coordinator", None)]
        self.coordinator = _Coordinators(coordinators) if coordinators else None

    def domain(self, name: str) -> ReductionDomain:
        return next(d for d in self.domains if d.name == name)

    # -- the optimizer protocol the engine drives ---------------------------------------------------------

    def backward_begin(self, is_boundary: bool) -> None:
        for d in self.domains:
            d.wrapper.backward_begin(is_boundary)

    def backward_end(self) -> None:
        for d in self.domains:
            d.wrapper.backward_end()

    def _global_norm(self) -> float:
        total = 0.0
        for d in self.domains:
            norm = d.wrapper._global_norm()
            if d.wrapper.global_norm_hook is not None:  # the dense domain of a tensor-parallel model
                norm = d.wrapper.global_norm_hook(norm)
            squared = (norm * d.wrapper.gradient_scale) ** 2
            if d.norm_group is not None and dist.get_world_size(d.norm_group) > 1:
                value = torch.tensor([squared], dtype=torch.float64, device=_device_of(d.wrapper))
                all_reduce(value, group=d.norm_group)
                squared = value.item()
            total += squared
        return math.sqrt(total)

    def _apply(self, multiplier: float) -> None:
        # The torch optimizer is shared and steps every tensor that has a `.grad`. ZeRO wrappers attach the
        # masters' gradients only inside their own step; stage 0 leaves `.grad` on the module's parameters,
        # so each domain's are hidden while another domain steps (zero_grad() puts them back).
        hidden = self.zero_stage == 0
        if hidden:
            for d in self.domains:
                d.saved_grads = {p: p.grad for p in d.wrapper.names}
                for p in d.wrapper.names:
                    p.grad = None
        for d in self.domains:
            if hidden:
                for p, g in d.saved_grads.items():
                    p.grad = g
            d.wrapper._apply(multiplier * d.wrapper.gradient_scale)
            if hidden:
                for p in d.wrapper.names:
                    p.grad = None
                del d.saved_grads

    def zero_grad(self, set_to_none: bool = True) -> None:
        for d in self.domains:
            d.wrapper.zero_grad(set_to_none)

    def remove_hooks(self) -> None:
        for d in self.domains:
            d.wrapper.remove_hooks()

    def refresh_masters_from_module(self) -> None:
        for d in self.domains:
            d.wrapper.refresh_masters_from_module()

    # -- state ----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "zero_stage": self.zero_stage,
            "domains": {d.name: d.wrapper.state_dict() for d in self.domains},
        }

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        saved = state["domains"]
        missing = [d.name for d in self.domains if d.name not in saved]
        if missing:
            raise ValueError(
                f"the checkpoint's optimizer state has no domain {missing} (saved: {sorted(saved)})"
            )
        for d in self.domains:
            if self.zero_stage == 0:
                d.wrapper.load_state_dict(saved[d.name])
            else:
                d.wrapper.load_state_dict(saved[d.name], load_optimizer_states=load_optimizer_states)

    def load_universal(self, reader, load_optimizer_states: bool = True) -> set[str]:
        restored: set[str] = set()
        for d in self.domains:
            restored |= d.wrapper.load_universal(reader, load_optimizer_states)
        return restored


def _device_of(wrapper) -> torch.device:
    params = list(getattr(wrapper, "names", {})) or [p for b in wrapper.buckets for p in b.params]
    return params[0].device if params else torch.device("cpu")


class _Coordinators:
    """Stage 3: the domains' coordinators seen as one (`unwrap_model_for_generation`, memory accounting)."""

    def __init__(self, coordinators: list):
        self.coordinators = coordinators
        self.units = [u for c in coordinators for u in c.units]

    @property
    def paused(self) -> bool:
        return self.coordinators[0].paused

    @paused.setter
    def paused(self, value: bool) -> None:
        for c in self.coordinators:
            c.paused = value
