"""ZeRO stages 1 and 2: optimizer state (and, in stage 2, gradients) partitioned across data-parallel ranks.

Both stages keep full parameters on every rank, packed into `FlatParamBucket`s. Each rank steps only its
shard: the inner torch optimizer sees one tensor per bucket (the fp32 master of the shard, or in fp32
training the shard of the parameters themselves), so its state exists for 1/N of the model. After the step
each bucket is all-gathered in place, and every rank's module again holds the full, updated parameters
(at most `allgather_bucket_size` elements in flight at once).

The stages differ only in where gradients live (reference §5.1):
- stage 1: full gradient buckets as in stage 0, reduce-scattered at the accumulation boundary
  (`BucketedAllReducer(sharded=True)`);
- stage 2: only the shard is kept, reduce-scattered bucket by bucket during every backward
  (`ShardedGradReducer`).

The inner optimizer must be elementwise (Adam, AdamW, SGD, Adagrad, Lion, ...): it steps flat shards, not
parameter tensors, so a per-tensor rule such as LAMB's trust ratio would apply per shard instead.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_gather_flat, all_reduce
from shardspeed.config.zero import ZeroConfig
from shardspeed.core import partitioned
from shardspeed.core.flat_params import FlatParamBucket
from shardspeed.core.grad_buckets import BucketedAllReducer, bucket_layout, comm_dtype_of
from shardspeed.core.optimizer_wrapper import OptimizerWrapper
from shardspeed.core.placement import place_optimizer_state
from shardspeed.core.precision import LossScaler, PrecisionPlan, unscaled_in_kernel
from shardspeed.zero.offload import GradientNorms, HostGradients, OptimizerOffload
from shardspeed.zero.parameter_offload import ParameterOffload
from shardspeed.zero.sharded_grads import ShardedGradReducer
from shardspeed.zero.stage3 import Stage3Coordinator, build_units
from shardspeed.zero.swap import build_optimizer_swapper


def build_buckets(optimizer, names: dict, bucket_numel: int, group, split_by=None) -> list[FlatParamBucket]:
    """Flat buckets of the trainable parameters of each optimizer group (buckets never span groups, nor two
    values of `split_by(param)`)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    groups = [[p for p in g["params"] if p.requires_grad and p in names] for g in optimizer.param_groups]
    return [
        FlatParamBucket(params, [names[p] for p in params], group_index, world, rank)
        for group_index, params in bucket_layout(groups, bucket_numel, split_by)
    ]


class ZeroOptimizer(OptimizerWrapper):
    """The ZeRO optimizer wrapper the engine drives (same protocol as `DataParallelOptimizer`).

    `buckets` are the flat buckets (stage 1/2) or parameter units (stage 3) whose shards this rank steps;
    `grads` holds the reduced gradient shards; `coordinator` (stage 3) gathers parameters around modules.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buckets: list[FlatParamBucket],
        grads,
        *,
        stage: int,
        plan: PrecisionPlan,
        scaler: LossScaler,
        gradient_clipping: float,
        group=None,
        coordinator=None,
        allgather_numel: int = 500_000_000,
        offload: OptimizerOffload | None = None,
    ):
        self.zero_stage = stage
        self.allgather_numel = allgather_numel
        self.offload = offload
        self.optimizer = optimizer
        self.buckets, self.grads, self.coordinator = buckets, grads, coordinator
        self.plan, self.scaler, self.clip, self.group = plan, scaler, gradient_clipping, group
        self.overflow = False
        self.grad_norm: float | None = None
        self._parameter_offload: ParameterOffload | None = None
        self.state_offloader = None  # the engine's StateOffloader (zero/offload_states.py), set by the engine
        # The optimizer steps one tensor per bucket: a fp32 copy of the shard, or the shard itself in fp32
        # training when the optimizer runs where the shard lives.
        # Under NVMe offload each master goes to its file as soon as it is made (and, with parameter offload,
        # each shard back home), so building them never holds the whole model.
        nvme = offload is not None and offload.device == "nvme"
        self.nvme = None
        if nvme:
            numels = [b.shard_numel for b in buckets]
            shared_io = getattr(getattr(coordinator, "tier", None), "io", None)  # parameter offload's pool
            self.nvme = build_optimizer_swapper(optimizer, numels, offload, dist.get_rank(group), shared_io)
        self.masters = []
        for bucket in buckets:
            master = self._master_for(bucket.read_shard() if stage == 3 else bucket.shard)
            if stage == 3:
                bucket.evict()
            if self.nvme is not None:
                self.nvme.adopt(master)
            self.masters.append(master)
        if self.nvme is not None:
            self.nvme.drain()
        for index, bucket in enumerate(buckets):
            for p in bucket.params:
                p._shardspeed_zero = (self, index)  # found by the zero.safe_get_* accessors
            if stage == 3:
                bucket.on_modified = self._refresh_master(index)
        managed = {id(p) for b in buckets for p in b.params}
        # The model's parameters per group, in the caller's order (the groups hold masters from here on).
        self.model_param_groups = [
            [p for p in g["params"] if id(p) in managed] for g in optimizer.param_groups
        ]
        for group_index, group_dict in enumerate(optimizer.param_groups):
            others = [p for p in group_dict["params"] if id(p) not in managed]
            mine = [m for m, b in zip(self.masters, buckets) if b.group_index == group_index]
            group_dict["params"] = mine + others
        self._boundary = True
        # One optimizer call per bucket only where it buys something: NVMe (one bucket's state resident) or
        # masters off the device (each bucket's copy back overlaps the next bucket's step).
        self._step_per_bucket = nvme or any(m.device != b.device for m, b in zip(self.masters, buckets))
        self._route_offloaded_gradients()

    def _route_offloaded_gradients(self) -> None:
        """Under optimizer offload, where reduced gradient shards go: host copies (`HostGradients`), or at
        stages 2/3 with NVMe the swap files, with only their norms kept here."""
        self.host_grads = None
        self._grads_on_nvme = False
        if self.offload is None or not self.buckets:
            return
        device = self.buckets[0].device
        if self.nvme is not None and hasattr(self.grads, "shard_sink"):
            self._grads_on_nvme = True
            self.grads.shard_sink = self.nvme.accumulate_gradient
            self.host_grads = GradientNorms(len(self.buckets), device)
        else:
            self.host_grads = HostGradients([b.shard_numel for b in self.buckets], self.offload.host, device)
        if hasattr(self.grads, "on_shard_final"):  # stages 2/3: per bucket, during backward
            self.grads.on_shard_final = self.host_grads.receive

    def _master_for(self, shard: torch.Tensor) -> torch.Tensor:
        # Under NVMe the master is always a copy: it is swapped out between steps, the shard is not.
        nvme = self.offload is not None and self.offload.device == "nvme"
        if self.offload is not None and (nvme or self.plan.mixed or shard.device != self.offload.host):
            return self.offload.place_master(shard)
        return shard.float().clone() if self.plan.mixed else shard

    def _resident_state(self, indices=None):
        """A context in which the masters `indices` (default all) and their optimizer state are in memory
        (NVMe offload swaps them out)."""
        return self.nvme.resident(indices) if self.nvme is not None else contextlib.nullcontext()

    def gradient_shard(self, index: int) -> torch.Tensor:
        """This rank's reduced gradient shard of bucket `index` (a copy read from its file under NVMe)."""
        if self._grads_on_nvme:
            return self.nvme.gradient(index, consume=False)
        return self.grads.flat_grads()[index]

    def shard_state(self, index: int) -> dict:
        """The optimizer state of bucket `index`'s shard (a copy read from disk under NVMe offload)."""
        with self._resident_state([index]):
            return {
                k: v.clone() if torch.is_tensor(v) else v
                for k, v in self.optimizer.state.get(self.masters[index], {}).items()
            }

    # -- the optimizer protocol the engine drives ---------------------------------------------------------

    def backward_begin(self, is_boundary: bool) -> None:
        self._boundary = is_boundary
        if self.zero_stage == 1:  # stages 2 and 3 reduce every micro-step (their gradients are shards)
            self.grads.sync_enabled = is_boundary
        else:
            self.grads.final = is_boundary  # their last reduction of the step hands shards to host_grads

    def backward_end(self) -> None:
        self.grads.finish()
        if self.coordinator is not None:
            self.coordinator.end_of_backward()
        if self.host_grads is not None and self.zero_stage == 1 and self._boundary:
            for index, shard in enumerate(self.grads.flat_grads()):
                self.host_grads.receive(index, shard)

    def _global_norm(self) -> float:
        """L2 norm over every rank's gradient shard: one all-reduce of a single number."""
        if self.host_grads is not None:
            local = self.host_grads.squared_norm()  # taken as each shard arrived
        else:
            flats = self.grads.flat_grads()
            local = torch.zeros((), dtype=torch.float32, device=flats[0].device if flats else "cpu")
            for f in flats:
                local += torch.linalg.vector_norm(f, dtype=torch.float32) ** 2
        if dist.get_world_size(self.group) > 1:
            all_reduce(local, group=self.group)
        return math.sqrt(local.item())

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's per-group gradient norms over every rank's shard (float32, as held: loss-scaled under fp16):
        one per flat gradient buffer, one for all offloaded shards; their vector norm is `_global_norm()`."""
        if self.host_grads is not None:
            squares = [self.host_grads.squared_norm().to(torch.float32)]
        else:
            squares = [torch.linalg.vector_norm(f, dtype=torch.float32) ** 2 for f in self.grads.flat_grads()]
        squares = torch.stack(squares or [torch.zeros(())])
        if dist.get_world_size(self.group) > 1:
            all_reduce(squares, group=self.group)
        return list(squares.sqrt().unbind())

    def _has_nonfinite(self) -> bool:
        """Any inf/nan in any rank's gradient shards: one MAX all-reduce of a flag, no norm."""
        flats = self.grads.flat_grads()
        flag = torch.zeros((), dtype=torch.float32, device=flats[0].device if flats else "cpu")
        for f in flats:
            flag = torch.maximum(flag, (~torch.isfinite(f)).any().float())
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def _apply(self, multiplier: float) -> None:
        if self._grads_on_nvme:
            self.host_grads.clear()
            grads = None  # each sub-group's gradient is read with its master and state
        elif self.host_grads is not None:
            grads = self.host_grads.take()  # host shards: fp32, or a CPU-only 16-bit run's own dtype
        else:
            grads = self.grads.flat_grads()
        if not self._step_per_bucket:
            grads = [g.to(m.dtype) for m, g in zip(self.masters, grads)]  # a copy only across dtype
            with unscaled_in_kernel(self.optimizer, multiplier, grads):
                for master, grad in zip(self.masters, grads):
                    master.grad = grad
                self.optimizer.step()
            for index in range(len(self.masters)):
                self._bucket_stepped(index)
        else:
            # Bucket by bucket (the torch optimizer skips tensors without .grad): a stepped bucket's shard
            # goes back to the device while the next one steps; under NVMe only the sub-groups in flight
            # are in memory, and a 16-bit gradient is up-cast one sub-group at a time.
            def step_one(index: int) -> None:
                grad = self.nvme.gradient(index) if grads is None else grads[index]
                grad = grad.to(self.masters[index].dtype)
                with unscaled_in_kernel(self.optimizer, multiplier, [grad]):
                    self.masters[index].grad = grad
                    self.optimizer.step()
                self._bucket_stepped(index)

            if self.nvme is not None:
                self.nvme.step_each(step_one)
            else:
                for index in range(len(self.masters)):
                    step_one(index)
        self._publish_shards()

    def _bucket_stepped(self, index: int) -> None:
        master, bucket = self.masters[index], self.buckets[index]
        master.grad = None
        bucket.replace_shard(master)
        if self.coordinator is not None:
            bucket.evict()  # parameter offload: the updated shard goes home now, not all at the end

    def _publish_shards(self) -> None:
        """Make updated shards visible: stage 1/2 all-gather every bucket now; stage 3 gathers on use."""
        if self.coordinator is not None:
            self.coordinator.after_step()
            return
        in_flight, numel = [], 0
        for bucket in self.buckets:
            if in_flight and numel + bucket.padded_numel > self.allgather_numel:
                for work in in_flight:
                    work.wait()
                in_flight, numel = [], 0
            in_flight.append(all_gather_flat(bucket.flat, bucket.shard, group=self.group, async_op=True))
            numel += bucket.padded_numel
        for work in in_flight:
            work.wait()

    @property
    def fp32_groups_gradients_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's `BF16_Optimizer.fp32_groups_gradients_flat`: per parameter group, the averaged fp32
        gradients of its parameters flattened in order, as the step will use them. Whole, not this rank's
        shard: a collective over the data-parallel group (every rank must read it)."""
        from shardspeed.zero.api import safe_get_full_grad

        def flat_grad(p) -> torch.Tensor:  # a parameter without a gradient counts as zeros, as in DeepSpeed
            grad = safe_get_full_grad(p)
            return (
                grad.reshape(-1) if grad is not None else torch.zeros(getattr(p, "ds_shape", p.shape).numel())
            )

        return [torch.cat([flat_grad(p) for p in params]) if params else torch.empty(0)
                for params in self.model_param_groups]  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none
        self.grads.zero()
        if self._grads_on_nvme:
            self.nvme.forget_gradients()

    # -- DeepSpeed's attributes RLHF frameworks use (TRL, OpenRLHF) --------------------------------------------

    @property
    def parameter_offload(self) -> ParameterOffload:
        """ZeRO-3's module hooks under DeepSpeed's names (zero/parameter_offload.py); absent below stage 3,
        as in DeepSpeed (`hasattr(engine.optimizer, "parameter_offload")` is how TRL tells them apart)."""
        if self.coordinator is None:
            raise AttributeError(
                f"'parameter_offload' exists at ZeRO stage 3 only (this is stage {self.zero_stage})"
            )
        if self._parameter_offload is None:
            self._parameter_offload = ParameterOffload(self.coordinator)
        return self._parameter_offload

    @property
    def evaluation_only(self) -> bool:
        """A ZeRO-3 wrapper the engine built without an optimizer: it gathers around forwards, never steps."""
        return self.coordinator is not None and not self.coordinator.backward_follows

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """DeepSpeed's ZeRO optimizers' `offload_states` (OpenRLHF calls it here rather than on the engine):
        the engine's own, so that `engine.reload_states()` brings back what this moved."""
        self._engine_states().offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self._engine_states().reload(non_blocking)

    def _engine_states(self):
        if self.state_offloader is None:
            raise ValueError(
                "offload_states needs an optimizer"
                if self.evaluation_only
                else "no engine owns this optimizer"
            )
        return self.state_offloader

    def remove_hooks(self) -> None:
        self.grads.remove_hooks()
        if self.coordinator is not None:
            self.coordinator.remove_hooks()

    def close_offload(self) -> None:
        """Delete this rank's NVMe swap files (optimizer state and parameter shards); unpin offloaded masters."""
        for offload_part in (self.nvme, getattr(self.coordinator, "tier", None), self.offload):
            if offload_part is not None:
                offload_part.close()

    def _refresh_master(self, index: int):
        def refresh() -> None:
            if self.masters[index] is not self.buckets[index].shard:
                with self._resident_state([index]):
                    self.masters[index].copy_(self.buckets[index].shard)

        return refresh

    def refresh_masters_from_module(self) -> None:
        for index, (master, bucket) in enumerate(zip(self.masters, self.buckets)):
            if master is not bucket.shard:
                with self._resident_state([index]):  # NVMe: one sub-group in memory at a time
                    master.copy_(bucket.shard)

    # -- state: this rank's shards plus the layout needed to find every parameter in them -----------------

    def state_dict(self) -> dict:
        """This rank's shards and their state. Under NVMe offload nothing is brought into memory: swapped
        sub-groups appear as read-only mappings of their files, which torch.save then streams to disk."""
        if self.nvme is not None:
            mapped = [self.nvme.mapped(index) for index in range(len(self.masters))]
            masters, states = [m for m, _ in mapped], [s for _, s in mapped]
        else:
            # clone: in fp32 a master is a view into the whole bucket, and torch.save writes whole storages
            masters = [m.clone() if m._base is not None else m for m in self.masters]
            states = [dict(self.optimizer.state.get(m, {})) for m in self.masters]
        inner = self.optimizer.state_dict()
        return {
            "zero_stage": self.zero_stage,
            "world_size": dist.get_world_size(self.group),
            "rank": dist.get_rank(self.group),
            "buckets": [b.layout() for b in self.buckets],
            "fp32_shards": masters,
            "optimizer_states": states,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]],
            "loss_scaler": self.scaler.state_dict(),
            # Stage 3 parameters outside the optimizer (frozen) exist only as shards too: save them here.
            "frozen_buckets": [u.layout() for u in self._frozen_units()],
            "frozen_shards": [u.read_shard() for u in self._frozen_units()],  # read: not written back
        }

    def _frozen_units(self) -> list:
        if self.coordinator is None:
            return []
        return [u for u in self.coordinator.units if u.group_index is None]

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True, reading=None) -> None:
        """This rank's shards (only fp32 weights without `load_optimizer_states`), one sub-group at a time (NVMe
        offload; a memory-mapped file is read as copied), inside `reading` (pipeline_loading_checkpoint)."""
        if [b.layout() for b in self.buckets] != state["buckets"]:
            raise ValueError("the saved ZeRO partition layout differs from this engine's")
        frozen = self._frozen_units()
        if [u.layout() for u in frozen] != state.get("frozen_buckets", []):
            raise ValueError("the saved frozen-parameter partition layout differs from this engine's")
        groups = [self.optimizer.param_groups[bucket.group_index] for bucket in self.buckets]
        with reading if reading is not None else contextlib.nullcontext():
            for index, master in enumerate(self.masters):
                with self._resident_state([index]):
                    master.copy_(state["fp32_shards"][index])
                    if load_optimizer_states:
                        saved = state["optimizer_states"][index]
                        self.optimizer.state[master] = place_optimizer_state(saved, master, groups[index])
                    self._bucket_stepped(index)  # the shard takes the master's value (stage 3: written home)
            for unit, saved in zip(frozen, state.get("frozen_shards", [])):
                unit.shard.copy_(saved)
        if load_optimizer_states:
            for group, saved in zip(self.optimizer.param_groups, state["param_groups"]):
                group.update(saved)
            self.scaler.load_state_dict(state["loss_scaler"])
        self._publish_shards()

    # -- resharding: this rank's shards assembled by name from a checkpoint of any stage and world size -----

    @torch.no_grad()
    def load_universal(self, reader, load_optimizer_states: bool = True) -> set[str]:
        """Restore from a checkpoint of any ZeRO stage and world size, read by name (`CheckpointReader`).

        Stage 1/2: every rank reads its buckets' full parameters (they are replicated) and slices its fp32
        master shard out of them — no collective. Stage 3: every rank reads only its shards' fragments, then
        persistent units re-gather (collective). Padding is zero, as in a fresh bucket. Returns the names
        restored (the engine restores the other parameters).
        """
        with_state = load_optimizer_states and reader.has_optimizer_state
        restored = self._load_universal(reader, with_state)
        if self.coordinator is not None:
            self.coordinator.after_step()  # persistent units re-gather their new values
        return restored

    def _load_universal(self, reader, with_state: bool) -> set[str]:
        from shardspeed.checkpoint.universal import load_group_hyperparameters, restore_loss_scaler

        restored: set[str] = set()
        for index, bucket in enumerate(self.buckets):
            with self._resident_state([index]):  # NVMe: one sub-group in memory at a time
                if self.zero_stage == 3:
                    self._assemble_shard(index, reader)
                else:
                    self._assemble_full(index, reader)
                if with_state:
                    self._assemble_state(index, reader)
            restored.update(bucket.names)
        for unit in self._frozen_units():
            unit.shard.zero_()
            for _, name, in_param, in_shard, length in unit.fragments():
                if reader.has_value(name):
                    unit.shard[in_shard : in_shard + length].copy_(
                        reader.fp32_slice(name, in_param, in_param + length)
                    )
                    restored.add(name)
        if with_state:
            group_of = {name: b.group_index for b in self.buckets for name in b.names}
            load_group_hyperparameters(reader, self.optimizer.param_groups, group_of)
            restore_loss_scaler(reader, self.scaler)
        return restored

    def _assemble_full(self, index: int, reader) -> None:
        """Stage 1/2: the bucket's full parameters from the reader, and this rank's fp32 master shard."""
        bucket, master = self.buckets[index], self.masters[index]
        inside = {i: (in_param, in_shard, length) for i, _, in_param, in_shard, length in bucket.fragments()}
        bucket.flat[bucket.numel :].zero_()
        if master is not bucket.shard:
            master.zero_()
        for i, (name, offset, numel) in enumerate(zip(bucket.names, bucket.offsets, bucket.numels)):
            value = reader.fp32(name).reshape(-1)
            bucket.flat[offset : offset + numel].copy_(value)
            if i in inside and master is not bucket.shard:
                in_param, in_shard, length = inside[i]
                master[in_shard : in_shard + length].copy_(value[in_param : in_param + length])

    def _assemble_shard(self, index: int, reader) -> None:
        """Stage 3: only the fragments of this rank's shard, into the fp32 master and the 16-bit shard."""
        bucket, master = self.buckets[index], self.masters[index]
        master.zero_()
        for _, name, in_param, in_shard, length in bucket.fragments():
            master[in_shard : in_shard + length].copy_(reader.fp32_slice(name, in_param, in_param + length))
        self._bucket_stepped(index)  # the shard takes the master's value (written home now under offload)

    def _assemble_state(self, index: int, reader) -> None:
        """This rank's slice of every per-element optimizer state of a bucket; scalar state (Adam's step)
        from the bucket's first parameter that has one, so a shard of only padding gets it too."""
        bucket, master = self.buckets[index], self.masters[index]
        group = self.optimizer.param_groups[bucket.group_index]
        state: dict = {}
        for name in bucket.names:
            state = place_optimizer_state(reader.optimizer_state_slice(name, 0, 0)[1], master, group)
            if state:
                break
        for _, name, in_param, in_shard, length in bucket.fragments():
            elements, _ = reader.optimizer_state_slice(name, in_param, in_param + length)
            for key, value in elements.items():
                if key not in state:
                    state[key] = torch.zeros_like(master)
                state[key][in_shard : in_shard + length].copy_(value)
        if state:
            self.optimizer.state[master] = state
        else:
            self.optimizer.state.pop(master, None)


def _sub_group_numel(zero: ZeroConfig, group) -> int:
    """`sub_group_size` bounds the elements one optimizer step sees per rank: each bucket or unit is at most
    `sub_group_size` elements per rank."""
    return int(zero.sub_group_size) * dist.get_world_size(group)


def zero_stage_1_2(optimizer, named_params, zero: ZeroConfig, *, plan: PrecisionPlan, scaler: LossScaler,
                   gradient_clipping: float, group=None, offload=None, wrapper_cls=ZeroOptimizer,
                   wrapper_options: dict | None = None, **reduce_options) -> ZeroOptimizer:  # fmt: skip
    """The stage 1 or 2 wrapper (`zero.stage`) with the bucket sizes and reduction switches of the
    `zero_optimization` block. `reduce_options`: prescale_gradients, gradient_predivide_factor, average.
    `wrapper_cls` / `wrapper_options`: a ZeroOptimizer subclass and its own arguments (ZenFlow's)."""
    by_comm_dtype = lambda p: comm_dtype_of(p, plan.comm_dtype)  # noqa: E731
    bucket_numel = min(int(zero.reduce_bucket_size), _sub_group_numel(zero, group))
    buckets = build_buckets(optimizer, {p: n for n, p in named_params}, bucket_numel, group, by_comm_dtype)
    reduce_kwargs = dict(
        accum_dtype=plan.grad_accum_dtype, comm_dtype=plan.comm_dtype, group=group,
        overlap_comm=bool(zero.overlap_comm), use_reduce_scatter=bool(zero.reduce_scatter), **reduce_options,
    )  # fmt: skip
    if zero.stage == 1:
        grads = BucketedAllReducer([b.params for b in buckets], sharded=True, **reduce_kwargs)
    else:
        grads = ShardedGradReducer(buckets, **reduce_kwargs)
    wrapper = wrapper_cls(
        optimizer, buckets, grads, stage=zero.stage, plan=plan, scaler=scaler,
        gradient_clipping=gradient_clipping, group=group, allgather_numel=int(zero.allgather_bucket_size),
        offload=offload, **(wrapper_options or {}),
    )  # fmt: skip
    wrapper.compute_grad_norm = zero.compute_grad_norm
    return wrapper


def _stage3_unit_numel(zero: ZeroConfig, module: nn.Module, group) -> int:
    """Largest unit gathered whole: the prefetch/bucket/sub-group sizes, and at most a quarter of the
    model, so that even a small model spans several units and gathers overlap the compute of earlier ones."""
    total = sum(partitioned.logical_numel(p) for p in {id(p): p for p in module.parameters()}.values())
    limits = (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, _sub_group_numel(zero, group))
    return int(min(*limits, max(1, total // 4)))


def zero_stage_3(module: nn.Module, optimizer, named_params, zero: ZeroConfig, *, plan: PrecisionPlan,
                 scaler: LossScaler, gradient_clipping: float, group=None, offload=None, param_tier=None,
                 owned: set[int] | None = None, zeropp=None, **reduce_options) -> ZeroOptimizer:  # fmt: skip
    """The stage 3 wrapper, its units sized and its gathers, prefetch and persistence set by the
    `zero_optimization` block. `reduce_options`: prescale_gradients, gradient_predivide_factor, average.
    `owned`: ids of the module parameters this wrapper partitions (None: all; MoE: one reduction domain).
    `param_tier`: `offload_param`'s home for released shards, or None. `zeropp`: ZeRO++'s gather paths and
    gradient reduction (zero/zeropp/), or None."""
    names = {p: n for n, p in module.named_parameters()}
    units = build_units(
        module,
        optimizer,
        names,
        owned=owned,
        split_by=lambda p: comm_dtype_of(p, plan.comm_dtype),
        allgather_sequential=zero.stage3_allgather_sequential,
        fetch_with_all_reduce=zero.stage3_use_all_reduce_for_fetch_params,
        unit_numel=_stage3_unit_numel(zero, module, group),
        persistence_threshold=int(zero.stage3_param_persistence_threshold),
        model_persistence_threshold=int(zero.stage3_model_persistence_threshold),
        group=group,
        tier=param_tier,
        weights=zeropp.weights if zeropp is not None else None,
    )
    coordinator = Stage3Coordinator(
        module,
        units,
        prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        max_reuse_distance=int(zero.stage3_max_reuse_distance),
        tier=param_tier,
        log_order_changes=zero.log_trace_cache_warnings,
    )
    trainable = [u for u in units if u.group_index is not None]
    grads = ShardedGradReducer(
        list(reversed(trainable)),  # gradients arrive in reverse forward order
        accum_dtype=plan.grad_accum_dtype,
        comm_dtype=plan.comm_dtype,
        group=group,
        on_grads_staged=coordinator.on_unit_grads_staged,
        quantized_reduce=zeropp.gradients if zeropp is not None else None,
        overlap_comm=bool(zero.overlap_comm),
        use_reduce_scatter=bool(zero.reduce_scatter),
        **reduce_options,
    )
    wrapper = ZeroOptimizer(
        optimizer, list(reversed(trainable)), grads, stage=3, plan=plan, scaler=scaler,
        gradient_clipping=gradient_clipping, group=group, coordinator=coordinator, offload=offload,
    )  # fmt: skip
    for unit in units:
        unit.evict()  # building the masters read every offloaded shard once
    return wrapper
