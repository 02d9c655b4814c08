"""ZeRO stage 2 gradients: reduce-scattered bucket by bucket during backward, kept only as this rank's shard.

No full-size gradient buffer persists. As autograd produces a parameter's gradient, a hook copies it into
its bucket's staging buffer (in the communication dtype) and frees it — a bucket holding one parameter is
reduced in that gradient tensor itself, with no copy; a complete bucket is reduce-scattered
asynchronously — in bucket index order on every rank — and this rank's averaged slice is added to a
persistent shard accumulator. At most `MAX_IN_FLIGHT` staging buffers wait on the network at once, which
bounds the transient memory to a few buckets (none wait with `overlap_comm=False`). Reduction happens every
micro-step, as in DeepSpeed. `use_reduce_scatter=False` (DeepSpeed's `reduce_scatter: false`) all-reduces
the whole staging buffer and keeps this rank's slice of it. `average=False` (DeepSpeed's
`gradient_allreduce_op: "sum"`) keeps the sum over ranks instead of the mean. A bucket is communicated in
its parameters' `comm_dtype` mark where they carry one (`torch_autocast`), else in `comm_dtype`.
ZeRO++'s qgZ replaces the reduce-scatter with `quantized_reduce` (zeropp/gradients.py), which leaves
the same sum in the same place.

Under NVMe optimizer offload the accumulator is not in memory either: `shard_sink` (the optimizer swapper)
adds each reduced slice to the gradient kept in that sub-group's swap file, so the gradients of a model
larger than memory never exist in memory at once.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_reduce, reduce_scatter_flat
from shardspeed.core.flat_params import FlatParamBucket
from shardspeed.core.grad_buckets import comm_dtype_of

MAX_IN_FLIGHT = 2


class _Slot:
    def __init__(
        self, index: int, bucket: FlatParamBucket, accum_dtype: torch.dtype, comm_dtype: torch.dtype
    ):
        self.index = index
        self.bucket = bucket
        self.accum_dtype = accum_dtype
        self.comm_dtype = comm_dtype
        self.grad_shard: torch.Tensor | None = None  # allocated by the first reduction (never, with a sink)
        self.fresh = True  # grad_shard holds nothing of this accumulation window yet
        self.staging: torch.Tensor | None = None
        self.num_ready = 0
        self.ready = [False] * len(bucket.params)
        self.launched = False


def _can_borrow(slot: _Slot, grad: torch.Tensor) -> bool:
    """A bucket of one unpadded parameter can be reduced in its own gradient tensor, with no staging copy."""
    bucket = slot.bucket
    return (
        len(bucket.params) == 1
        and bucket.padded_numel == bucket.numel
        and grad.dtype == slot.comm_dtype
        and grad.layout == torch.strided
        and grad.is_contiguous()
        and grad.numel() == bucket.numel
    )


class ShardedGradReducer:
    """Stage 2 gradient path over the same buckets as the flat parameters."""

    def __init__(
        self,
        buckets: list[FlatParamBucket],
        *,
        accum_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        group=None,
        prescale_gradients: bool = False,
        gradient_predivide_factor: float = 1.0,
        on_grads_staged=None,
        on_shard_final=None,
        use_reduce_scatter: bool = True,
        overlap_comm: bool = True,
        average: bool = True,
        quantized_reduce=None,
    ):
        self.group = group
        # stage 3: called once a bucket's gradients are all in its staging buffer, so its full parameters
        # can be released even when an earlier bucket holds up the (strictly ordered) launches
        self.on_grads_staged = on_grads_staged
        # optimizer offload: called with (bucket index, gradient shard) as each shard's reduction completes
        # in the backward of an accumulation boundary (`final`), so its copy to the host overlaps the rest
        self.on_shard_final = on_shard_final
        # NVMe optimizer offload: `shard_sink(index, reduced, scale, fresh)` accumulates reduced slices
        # where the optimizer keeps them and returns the running sum; no accumulator is kept here then
        self.shard_sink = None
        self.final = True
        self.world_size = dist.get_world_size(group)
        self.comm_dtype = comm_dtype
        self.use_reduce_scatter = use_reduce_scatter
        self.quantized_reduce = quantized_reduce  # qgZ: `quantized_reduce(own, staging, bucket)` -> work
        self.max_in_flight = MAX_IN_FLIGHT if overlap_comm else 0
        self.average = average
        self.prescale = prescale_gradients and average
        self.predivide = gradient_predivide_factor if average else 1.0
        self.slots = [
            _Slot(i, b, accum_dtype, comm_dtype_of(b.params[0], comm_dtype)) for i, b in enumerate(buckets)
        ]
        self._next_launch = 0
        self._in_flight: deque = deque()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(slot, i))
            for slot in self.slots
            for i, p in enumerate(slot.bucket.params)
        ]

    def _make_hook(self, slot: _Slot, index: int):
        offset, n = slot.bucket.offsets[index], slot.bucket.numels[index]

        def on_grad_accumulated(param: nn.Parameter) -> None:
            if not getattr(param, "ds_grad_is_ready", True):
                return  # more tiles of a tiled computation will add to param.grad (sequence/tiled.py)
            if slot.launched:
                raise RuntimeError(
                    f"parameter {slot.bucket.names[index]!r} received a gradient after its bucket was already "
                    "reduced in this backward pass (reentrant checkpointing or two backward calls per step?)"
                )
            grad = param.grad
            param.grad = None
            if slot.staging is None and _can_borrow(slot, grad):
                slot.staging = grad.view(-1)  # the bucket is this one gradient: reduce it where it is
            else:
                if slot.staging is None:  # no zero fill: each slot is written once, gaps zeroed at launch
                    slot.staging = torch.empty(
                        slot.bucket.padded_numel, dtype=slot.comm_dtype, device=grad.device
                    )
                target = slot.staging[offset : offset + n]
                if slot.ready[index]:  # a second gradient for the same parameter in this backward
                    target.add_(grad.reshape(-1))
                else:
                    target.copy_(grad.reshape(-1))
            if not slot.ready[index]:
                slot.ready[index] = True
                slot.num_ready += 1
                if slot.num_ready == len(slot.bucket.params) and self.on_grads_staged is not None:
                    self.on_grads_staged(slot.bucket)
            self._launch_ready()

        return on_grad_accumulated

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.slots):
            slot = self.slots[self._next_launch]
            if slot.num_ready < len(slot.bucket.params):
                return
            self._launch(slot)

    def _launch(self, slot: _Slot) -> None:
        bucket = slot.bucket
        if slot.staging is None:  # no parameter of this bucket got a gradient on this rank
            slot.staging = torch.zeros(bucket.padded_numel, dtype=slot.comm_dtype, device=bucket.device)
        elif slot.staging.numel() > bucket.numel or slot.num_ready < len(bucket.params):
            slot.staging[bucket.numel :].zero_()  # padding
            for i in range(len(bucket.params)):
                if not slot.ready[i]:  # no gradient on this rank: contributes zeros
                    slot.staging[bucket.offsets[i] : bucket.offsets[i] + bucket.numels[i]].zero_()
        if self.prescale:
            slot.staging.div_(self.world_size)
        elif self.predivide != 1.0:
            slot.staging.mul_(1.0 / self.predivide)
        rank = dist.get_rank(self.group)
        own = slot.staging[rank * slot.bucket.shard_numel : (rank + 1) * slot.bucket.shard_numel]
        if self.quantized_reduce is not None:
            work = self.quantized_reduce(own, slot.staging, slot.bucket)
        elif self.use_reduce_scatter:
            work = reduce_scatter_flat(own, slot.staging, group=self.group, async_op=True)
        else:
            work = all_reduce(slot.staging, group=self.group, async_op=True)
        slot.launched = True
        if slot.num_ready < len(slot.bucket.params) and self.on_grads_staged is not None:
            self.on_grads_staged(slot.bucket)  # some parameters got no gradient: nothing more will come
        self._in_flight.append((slot, own, work))
        self._next_launch += 1
        while len(self._in_flight) > self.max_in_flight:
            self._complete(*self._in_flight.popleft())

    def _complete(self, slot: _Slot, own: torch.Tensor, work) -> None:
        work.wait()
        post = 1.0 if self.prescale or not self.average else self.predivide / self.world_size
        if self.shard_sink is not None:
            shard = self.shard_sink(slot.index, own, post, slot.fresh)
        elif slot.fresh:  # the first reduction since zero(): written, so zero() needs no pass over memory
            if slot.grad_shard is None:
                slot.grad_shard = torch.empty(own.numel(), dtype=slot.accum_dtype, device=own.device)
            shard = torch.mul(own, post, out=slot.grad_shard)
        else:
            shard = slot.grad_shard.add_(own, alpha=post)
        slot.fresh = False
        slot.staging = None
        if self.final and self.on_shard_final is not None:
            self.on_shard_final(slot.index, shard)

    # -- engine-facing -------------------------------------------------------------------------------------

    def finish(self) -> None:
        while self._next_launch < len(self.slots):
            self._launch(self.slots[self._next_launch])
        while self._in_flight:
            self._complete(*self._in_flight.popleft())
        for slot in self.slots:
            slot.num_ready, slot.launched = 0, False
            slot.ready = [False] * len(slot.bucket.params)
        self._next_launch = 0

    def flat_grads(self) -> list[torch.Tensor]:
        if self.shard_sink is not None:
            raise RuntimeError("the gradient shards are in NVMe swap files (ZeroOptimizer.gradient_shard)")
        for slot in self.slots:
            if slot.grad_shard is None:
                slot.grad_shard = torch.zeros(
                    slot.bucket.shard_numel, dtype=slot.accum_dtype, device=slot.bucket.device
                )
            elif slot.fresh:  # nothing reduced since zero(): reads as zeros (only outside backward/step)
                slot.grad_shard.zero_()
        return [slot.grad_shard for slot in self.slots]

    def zero(self) -> None:
        for slot in self.slots:
            slot.fresh = True
            for p in slot.bucket.params:
                p.grad = None

    def move_to(self, device: torch.device, pin_memory: bool = False, non_blocking: bool = False) -> None:
        """Move the reduced gradient shards to `device` (`engine.offload_states`)."""
        from shardspeed.core.flat_params import _moved

        for slot in self.slots:
            if slot.grad_shard is not None:
                slot.grad_shard = _moved(slot.grad_shard, device, pin_memory, non_blocking)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
