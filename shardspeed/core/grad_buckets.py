"""Gradient buckets for data parallelism: flat buffers, filled by gradient hooks, all-reduced while backward runs.

Every trainable parameter owns a slice (a view) of one flat bucket buffer. Where the buffer's dtype is the
parameter's dtype, `param.grad` *is* that view, so autograd accumulates micro-batches in place and nothing is
copied. Where gradients accumulate in a wider dtype (bf16 parameters, fp32 accumulation), a hook adds each
fresh gradient into the view and drops it.

At the accumulation boundary the last hook of a bucket launches its all-reduce asynchronously, so
communication of late layers overlaps the backward pass of early ones. Buckets are launched strictly in
index order on every rank: Gloo and NCCL need the same sequence of collectives on all ranks, and a parameter
that gets no gradient on one rank must not reorder it. `finish()` flushes what is left and waits.

ZeRO stage 1 uses the same buckets with `sharded=True`: each bucket is padded to a multiple of the world size,
and an in-place reduce-scatter leaves each rank the average of its own contiguous slice (`shard`); with
`use_reduce_scatter=False` (DeepSpeed's `reduce_scatter: false`) the whole bucket is all-reduced instead and
the rank keeps its slice — twice the traffic, for networks where all-reduce is the faster collective.

`overlap_comm=False` waits for each bucket's collective as soon as it is launched, so reduction no longer
runs behind the rest of backward. `average=False` (DeepSpeed's `gradient_allreduce_op: "sum"`) leaves the
sums over ranks instead of their mean.

A bucket is communicated in one dtype: `comm_dtype`, or the `comm_dtype` attribute its parameters carry
(DeepSpeed's per-parameter mark; `torch_autocast` sets it on its lower-precision-safe modules), so
`bucket_layout(..., split_by=...)` never puts parameters of two communication dtypes in one bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_reduce, completed_work, reduce_scatter_flat
from shardspeed.core.partitioned import logical_numel


class GradBucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    The buffer is padded to a multiple of `shards` so it splits into equal per-rank slices (ZeRO).
    """

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, device: torch.device, shards: int = 1):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        padded = -(-self.numel // shards) * shards
        self.buffer = torch.zeros(padded, dtype=dtype, device=device)
        self.shard_numel = padded // shards
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.work = None  # the in-flight collective
        self.comm_buffer: torch.Tensor | None = None

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s contiguous slice of a tensor laid out like this bucket's buffer."""
        return tensor[rank * self.shard_numel : (rank + 1) * self.shard_numel]

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.work = None
        self.comm_buffer = None


# DeepSpeed's default reduce_bucket_size (5e8 elements) puts a whole model in one bucket, whose reduction can
# only start when backward ends. Capping buckets at DDP's sizes (25 MiB, and 1 MiB for the first, which
# fills earliest) lets communication overlap compute; a smaller configured size still wins.
BUCKET_CAP_NUMEL = 25 * 2**20 // 4
FIRST_BUCKET_CAP_NUMEL = 2**20 // 4


def comm_dtype_of(param: nn.Parameter, default: torch.dtype) -> torch.dtype:
    """The dtype `param`'s gradient is communicated in: its `comm_dtype` mark, else `default`."""
    return getattr(param, "comm_dtype", default)


def _split(params: list[nn.Parameter], split_by) -> list[list[nn.Parameter]]:
    """`params` in runs of equal `split_by(p)`, each run keeping the parameters' order."""
    if split_by is None:
        return [params]
    runs: dict = {}
    for p in params:
        runs.setdefault(split_by(p), []).append(p)
    return list(runs.values())


def bucket_layout(
    param_groups: list[list[nn.Parameter]], bucket_numel: int, split_by=None
) -> list[tuple[int, list[nn.Parameter]]]:
    """Split parameters into `(group index, parameters)` buckets of bounded size (a larger parameter gets
    its own bucket).

    Gradients arrive roughly in reverse registration order, so the first bucket holds the last layers.
    Buckets never span optimizer parameter groups, so a bucket's shard can be stepped with its group's
    hyper-parameters, nor two values of `split_by(param)` (e.g. communication dtypes).
    """
    buckets: list[tuple[int, list[nn.Parameter]]] = []
    for group_index in reversed(range(len(param_groups))):
        for run in _split(param_groups[group_index], split_by):
            _pack(buckets, group_index, run, bucket_numel)
    return buckets


def _pack(buckets: list, group_index: int, params: list[nn.Parameter], bucket_numel: int) -> None:
    """Append to `buckets` the buckets of consecutive `params` (last first). The cap depends on whether
    any bucket exists yet, over every run: `buckets` is the whole layout so far, not this run's part (a cap
    judged per run gave every bucket the first one's small cap: 23 buckets instead of 2, so 23 collectives
    per step instead of 2, on the benchmarks' small GPT)."""
    current, size = [], 0
    for p in reversed(params):
        numel = logical_numel(p)
        cap = min(bucket_numel, BUCKET_CAP_NUMEL if buckets else FIRST_BUCKET_CAP_NUMEL)
        if current and size + numel > cap:
            buckets.append((group_index, current))
            current, size = [], 0
        current.append(p)
        size += numel
    if current:
        buckets.append((group_index, current))


class BucketedAllReducer:
    """Averages (or sums) gradients of `params` over `group` with bucketed, backward-overlapped all-reduces."""

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        *,
        accum_dtype: torch.dtype,
        comm_dtype: torch.dtype,
        group=None,
        prescale_gradients: bool = False,
        gradient_predivide_factor: float = 1.0,
        sharded: bool = False,
        use_reduce_scatter: bool = True,
        overlap_comm: bool = True,
        average: bool = True,
    ):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm_dtype = comm_dtype
        self.average = average
        self.prescale = prescale_gradients and average
        self.predivide = gradient_predivide_factor if average else 1.0
        self.sharded = sharded
        self.use_reduce_scatter = sharded and use_reduce_scatter
        self.overlap_comm = overlap_comm
        params = [p for bucket in buckets for p in bucket]
        self.grads_are_views = all(p.dtype == accum_dtype for p in params)
        device = params[0].device if params else torch.device("cpu")
        shards = self.world_size if sharded else 1
        self.buckets = [GradBucket(b, accum_dtype, device, shards) for b in buckets]
        for bucket in self.buckets:  # one dtype per bucket (bucket_layout splits by it)
            bucket.comm_dtype = comm_dtype_of(bucket.params[0], comm_dtype) if bucket.params else comm_dtype
        self.sync_enabled = True  # False on micro-steps inside the accumulation window
        self._next_launch = 0
        self._hooks = []
        for bucket_index, bucket in enumerate(self.buckets):
            for slot, p in enumerate(bucket.params):
                if self.grads_are_views:
                    p.grad = bucket.views[slot]
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(bucket_index, slot)))

    # -- backward-time hooks -------------------------------------------------------------------------------

    def _make_hook(self, bucket_index: int, slot: int):
        bucket = self.buckets[bucket_index]

        def on_grad_accumulated(param: nn.Parameter) -> None:
            if not getattr(param, "ds_grad_is_ready", True):
                return  # DeepSpeed's flag: more tiles of a tiled computation will add to param.grad first
            grad, view = param.grad, bucket.views[slot]  # looked up now: offload_states may move the buffer
            if grad is not view:
                # Either gradients accumulate in a wider dtype, or the user reset `.grad` (e.g. with
                # model.zero_grad()), in which case autograd handed us a fresh tensor holding this micro-step.
                if self.grads_are_views:
                    view.copy_(grad)
                    param.grad = view
                else:
                    view.add_(grad)
                    param.grad = None
            if self.sync_enabled:
                self._mark_ready(bucket_index, slot)

        return on_grad_accumulated

    def _mark_ready(self, bucket_index: int, slot: int) -> None:
        bucket = self.buckets[bucket_index]
        if bucket.ready[slot]:
            if bucket.work is not None:
                raise RuntimeError(
                    f"parameter of shape {tuple(bucket.params[slot].shape)} received a second gradient after "
                    "its bucket was already all-reduced in this backward pass (a reentrant checkpoint or two "
                    "backward calls per step?). Use non-reentrant activation checkpointing, or call "
                    "engine.backward once per micro-batch."
                )
            return
        bucket.ready[slot] = True
        bucket.num_ready += 1
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        if self.world_size == 1:  # nothing to exchange: no communication-dtype copy, no collective
            bucket.work = completed_work()
            return
        tensor = bucket.buffer
        if self.prescale:
            tensor.div_(self.world_size)
        elif self.predivide != 1.0:
            tensor.mul_(1.0 / self.predivide)
        if tensor.dtype != bucket.comm_dtype:
            bucket.comm_buffer = tensor.to(bucket.comm_dtype)
            tensor = bucket.comm_buffer
        if self.use_reduce_scatter:  # in place: this rank's slice receives the sum of everyone's slice
            own = bucket.shard(tensor, self.rank)
            bucket.work = reduce_scatter_flat(own, tensor, group=self.group, async_op=True)
        else:
            bucket.work = all_reduce(tensor, group=self.group, async_op=True)
        if not self.overlap_comm:
            bucket.work.wait()

    # -- engine-facing -------------------------------------------------------------------------------------

    def finish(self) -> None:
        """Launch buckets whose parameters got no gradient, wait for all, and turn sums into means."""
        if not self.sync_enabled:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        # the mean of one rank's sums is those sums (`_launch` skipped the pre-division too)
        post = (
            1.0
            if self.prescale or not self.average or self.world_size == 1
            else self.predivide / self.world_size
        )
        for bucket in self.buckets:
            bucket.work.wait()
            reduced = self.reduced_grad(bucket)
            if bucket.comm_buffer is not None:
                source = bucket.comm_buffer
                reduced.copy_(bucket.shard(source, self.rank) if self.sharded else source)
            if post != 1.0:
                reduced.mul_(post)
            bucket.reset()
        self._next_launch = 0

    def reduced_grad(self, bucket: GradBucket) -> torch.Tensor:
        """The part of a bucket that holds averaged gradients: all of it, or this rank's shard (ZeRO-1)."""
        return bucket.shard(bucket.buffer, self.rank) if self.sharded else bucket.buffer

    def flat_grads(self) -> list[torch.Tensor]:
        return [self.reduced_grad(b) for b in self.buckets]

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.reset()
            if self.grads_are_views:
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
        self._next_launch = 0

    def move_to(self, device: torch.device, pin_memory: bool = False, non_blocking: bool = False) -> None:
        """Move the gradient buffers to `device` (`engine.offload_states`). While they are away from the
        parameters' device the parameters have no `.grad` (torch requires the two on one device)."""
        from shardspeed.core.flat_params import _moved

        for bucket in self.buckets:
            bucket.buffer = _moved(bucket.buffer, device, pin_memory, non_blocking)
            offsets = [0]
            for p in bucket.params:
                offsets.append(offsets[-1] + p.numel())
            bucket.views = [
                bucket.buffer[a:b].view_as(p) for p, a, b in zip(bucket.params, offsets, offsets[1:])
            ]
            if self.grads_are_views:
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view if view.device == p.device else None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
