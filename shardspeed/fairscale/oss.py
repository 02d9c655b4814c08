"""FairScale's `OSS` (optimizer state sharding) on shardspeed's ZeRO stage 1.

    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)

is FairScale's spelling of ZeRO stage 1: every rank keeps the full parameters, and the optimizer state
exists for 1/N of them on each rank. Here the parameters of each group are packed into flat buckets
(core/flat_params.py) and each rank steps its contiguous shard of every bucket through the ZeRO optimizer
wrapper (zero/optimizer.py), which all-gathers the updated shards in place after the step. FairScale
instead gives each rank whole parameters (a greedy partition); the training arithmetic is the same, and
the state dict is FairScale's (a PyTorch optimizer state dict over all parameters, state_dict.py), so the
difference shows only in `OSS.optim`'s own parameters, which are flat shards.

Gradients: used alone, OSS takes them as the caller left them (already averaged, given_grads.py); wrapped
by `ShardedDataParallel` they are reduce-scattered during backward (ZeRO stage 2, sharded_ddp.py).

The inner optimizer must be elementwise (SGD, Adam, AdamW, Adagrad, RMSprop, ...): it steps flat shards, so
a per-tensor rule (LAMB's trust ratio, LBFGS) would apply per shard; other classes are refused by name.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat, all_reduce
from shardspeed.core.precision import NoScaler, PrecisionPlan
from shardspeed.fairscale.given_grads import GivenGradients
from shardspeed.fairscale.state_dict import consolidated_state, load_sharded_state
from shardspeed.zero.optimizer import ZeroOptimizer, build_buckets

__all__ = ["ELEMENTWISE_OPTIMIZERS", "OSS"]

ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
)
logger = logging.getLogger(__name__)
BUCKET_NUMEL = 50_000_000  # elements per flat bucket: a few large gathers, never the whole model at once


class _ShardStepper(ZeroOptimizer):
    """The ZeRO wrapper with FairScale's `broadcast_fp16`: updated shards are exchanged in fp16."""

    broadcast_fp16 = False

    def _publish_shards(self) -> None:
        if not self.broadcast_fp16 or (self.buckets and self.buckets[0].dtype == torch.float16):
            super()._publish_shards()
            return
        for bucket in self.buckets:  # as FairScale: every rank, the owner too, keeps the fp16-rounded value
            half = bucket.flat.to(torch.float16)
            shard = half[bucket.rank * bucket.shard_numel : (bucket.rank + 1) * bucket.shard_numel]
            all_gather_flat(half, shard, group=self.group)
            bucket.flat.copy_(half)


class OSS(torch.optim.Optimizer):
    """FairScale's `fairscale.optim.oss.OSS(params, optim=SGD, group=None, broadcast_fp16=False, **default)`.

    `param_groups` hold the model's parameters and hyperparameters, as a torch optimizer's (LR schedulers
    and gradient scalers work on them); they are copied to the sharded optimizer before each step. Every
    method that communicates (`step`, `clip_grad_norm`, `consolidate_state_dict`, `load_state_dict`,
    `refresh_trainable`) must be called on all ranks.
    """

    def __init__(self, params, optim: type = torch.optim.SGD, group=None, broadcast_buffer_size: int = -1,
                 broadcast_fp16: bool = False, force_broadcast_object: bool = False, **default):  # fmt: skip
        if broadcast_buffer_size != -1:
            # FairScale 0.4 takes it and uses it nowhere (its docstring: "deprecated ... not being used
            # anymore"); code written for older FairScale still passes it. Taken the same way, said aloud.
            logger.warning(
                "OSS(broadcast_buffer_size=%s): deprecated in FairScale 0.4 and unused there and here "
                "(whole flat buckets are gathered)",
                broadcast_buffer_size,
            )
        if force_broadcast_object:
            raise ValueError(
                "OSS(force_broadcast_object=True): shardspeed consolidates the state with tensor collectives "
                "and broadcasts no Python objects, so there is nothing to force (leave it False)"
            )
        if not (isinstance(optim, type) and issubclass(optim, ELEMENTWISE_OPTIMIZERS)):
            raise TypeError(
                f"OSS(optim={getattr(optim, '__name__', optim)!r}): shardspeed steps flat shards of parameters, "
                "so only elementwise optimizers keep their meaning (torch's "
                + ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
                + ", or subclasses); a per-tensor rule would apply per shard"
            )
        super().__init__(params, default)
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.broadcast_fp16 = broadcast_fp16
        self._optim_constructor = optim
        self._optim_defaults = default
        self._consolidated: dict | None = None
        self._sharded_ddp = None  # set by ShardedDataParallel: gradients then come from its reducer
        self._bucket_numel = BUCKET_NUMEL  # ShardedDataParallel's `reduce_buffer_size` sets it
        self.refresh_trainable()

    # -- building ----------------------------------------------------------------------------------------

    def refresh_trainable(self) -> None:
        """Rebuild the shards after parameters were frozen or unfrozen (collective). The optimizer state of
        the parameters still trained is kept, as in FairScale: it is gathered by parameter and re-cut."""
        old = getattr(self, "stepper", None)
        kept = None
        if old is not None:
            kept = consolidated_state(old, self.param_groups, self._hyperparameters)
            old.remove_hooks()
        trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        dtypes = {p.dtype for p in trainable}
        if len(dtypes) > 1 or len({p.device for p in trainable}) > 1:
            raise ValueError(
                f"OSS: the trainable parameters must share one dtype and one device (found dtypes "
                f"{sorted(map(str, dtypes))}); shardspeed packs them into flat buckets"
            )
        inner_groups = [
            {**self._hyperparameters(g), "params": [p for p in g["params"] if p.requires_grad]}
            for g in self.param_groups
        ]
        self.optim = self._optim_constructor(inner_groups, **self._optim_defaults)
        names = {p: str(i) for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        buckets = build_buckets(self.optim, names, self._bucket_numel, self.group, split_by=lambda p: p.dtype)
        dtype = next(iter(dtypes), torch.float32)
        # The parameters' own dtype throughout: FairScale steps them as they are (fp16 under its AMP
        # recipes); fp16 parameters get fp32 masters here, which only makes the step more exact.
        plan = PrecisionPlan(dtype, dtype, dtype)
        self.stepper = _ShardStepper(self.optim, buckets, GivenGradients(buckets), stage=1, plan=plan,
                                     scaler=NoScaler(), gradient_clipping=0.0, group=self.group)  # fmt: skip
        self.stepper.compute_grad_norm = False  # clipping is the caller's (`clip_grad_norm`)
        self.stepper.broadcast_fp16 = self.broadcast_fp16
        if kept is not None:
            load_sharded_state(self.stepper, self.param_groups, kept)
        if self._sharded_ddp is not None:
            self._sharded_ddp._attach(self)

    @staticmethod
    def _hyperparameters(group: dict) -> dict:
        return {k: v for k, v in group.items() if k != "params"}

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "stepper"):  # not while torch's constructor adds the first groups
            self.refresh_trainable()

    # -- training ----------------------------------------------------------------------------------------

    def _sync_hyperparameters(self) -> None:
        for mine, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(self._hyperparameters(mine))

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        if kwargs:
            raise TypeError(
                f"OSS.step: keyword arguments {sorted(kwargs)} are not passed to the sharded step"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self.stepper.backward_end()  # gradients complete (ShardedDDP: its reductions waited for)
        self.stepper.step()
        self._sync_hyperparameters_back()
        return loss

    def _sync_hyperparameters_back(self) -> None:
        for mine, inner in zip(self.param_groups, self.optim.param_groups):
            mine.update(self._hyperparameters(inner))  # an optimizer may change its own (Rprop's etas stay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.stepper.zero_grad()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm, norm_type=2.0, filter_params_fn=None) -> torch.Tensor:
        """Clip the gradients the next step uses to a global norm of `max_norm`; returns the norm before
        clipping (collective: every rank adds its shards' part). `filter_params_fn(params) -> params` picks
        the parameters the norm counts (all of them are clipped), as in FairScale."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        self.stepper.backward_end()
        shards = self.stepper.grads.flat_grads()
        counted = None
        if filter_params_fn is not None:
            counted = {id(p) for p in filter_params_fn([p for b in self.stepper.buckets for p in b.params])}
        local = torch.zeros((), dtype=torch.float32)
        for bucket, shard in zip(self.stepper.buckets, shards):
            for index, _, _, start, length in bucket.fragments():
                if counted is not None and id(bucket.params[index]) not in counted:
                    continue
                piece = shard[start : start + length].float().cpu()
                if norm_type == float("inf"):
                    local = torch.maximum(local, piece.abs().max() if length else local)
                else:
                    local += piece.abs().pow(norm_type).sum()
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = local
        else:
            all_reduce(local, group=self.group)
            total = local ** (1.0 / norm_type)
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1:
            for shard in shards:
                shard.mul_(coefficient.to(shard.device, shard.dtype))
        return total

    # -- state ---------------------------------------------------------------------------------------------

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the whole optimizer state on `recipient_rank` (-1: every rank) for `state_dict()`
        (collective)."""
        self._sync_hyperparameters()
        state = consolidated_state(self.stepper, self.param_groups, self._hyperparameters)
        self._consolidated = state if recipient_rank in (-1, self.rank) else None

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The state `consolidate_state_dict` gathered, as a PyTorch optimizer state dict over all
        parameters (it loads into a torch optimizer of the same class, or into OSS at any world size)."""
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                "`consolidate_state_dict()` on all ranks beforehand if you meant to save the global state"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore from a state dict of `state_dict()` (or of a torch optimizer over the same parameters):
        each rank keeps its shard of every state tensor."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("OSS.load_state_dict: the saved parameter groups differ from this optimizer's")
        for mine, saved in zip(self.param_groups, saved_groups):
            mine.update(self._hyperparameters(saved))
        self._sync_hyperparameters()
        load_sharded_state(self.stepper, self.param_groups, state_dict)
