"""FairScale's `ShardedDataParallel`: OSS plus gradient sharding, i.e. ZeRO stage 2.

    model = ShardedDataParallel(model, optimizer)   # optimizer: an OSS

During backward each flat bucket of the OSS is reduce-scattered as soon as its gradients are complete
(zero/sharded_grads.py), so each rank keeps only the averaged gradient shard it steps; `param.grad` is None
after backward (FairScale keeps the gradients of the parameters a rank owns; here no rank owns a whole
parameter). The end of each backward pass is found with an autograd callback queued by the first gradient
hook, as torch's DDP does, so `loss.backward(); optimizer.step()` needs no extra call.

`no_sync()` accumulates gradients across micro-batches as in FairScale; the reduction still runs every
backward (into the shard accumulator), which gives the same sum with less memory than keeping full
gradients until the last micro-batch.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.fairscale.oss import OSS
from shardspeed.zero.sharded_grads import ShardedGradReducer

__all__ = ["ShardedDataParallel"]

logger = logging.getLogger(__name__)


class ShardedDataParallel(nn.Module):
    """FairScale's `ShardedDataParallel(module, sharded_optimizer, process_group=None, broadcast_buffers=True,
    sync_models_at_startup=True, reduce_buffer_size=2**23, auto_refresh_trainable=True, reduce_fp16=False,
    warn_on_trainable_params_changed=True)`.

    `reduce_buffer_size` (bytes) sizes the OSS's flat buckets, which are the units of reduction (0: one
    parameter per bucket); `reduce_fp16` reduces fp32 gradients in fp16.
    """

    def __init__(self, module: nn.Module, sharded_optimizer, process_group=None, broadcast_buffers: bool = True,
                 sync_models_at_startup: bool = True, reduce_buffer_size: int = 2**23,
                 auto_refresh_trainable: bool = True, reduce_fp16: bool = False,
                 warn_on_trainable_params_changed: bool = True):  # fmt: skip
        super().__init__()
        self.module = module
        optimizers = sharded_optimizer if isinstance(sharded_optimizer, list) else [sharded_optimizer]
        for optimizer in optimizers:
            if not isinstance(optimizer, OSS):
                raise TypeError(
                    f"ShardedDataParallel(sharded_optimizer={type(optimizer).__name__}): it must be an OSS "
                    "(fairscale.optim.oss.OSS), whose shards the gradients are reduced to"
                )
        self._sharded_optimizers = optimizers
        self._process_group = process_group if process_group is not None else dist.group.WORLD
        for optimizer in optimizers:
            if dist.get_world_size(optimizer.group) != dist.get_world_size(self._process_group):
                raise ValueError("ShardedDataParallel: the OSS and the model must use the same process group")
        self._enable_broadcast_buffers = broadcast_buffers
        self._auto_refresh_trainable = auto_refresh_trainable
        self._warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self._reduce_fp16 = reduce_fp16
        self._should_accumulate_grads = False
        self._end_queued = False
        self._callback_hooks: list = []
        self._trainable = self._trainable_ids()
        devices = {p.device for p in module.parameters()}
        # torch DDP's attributes, which code written for DDP reads (FairScale keeps them too)
        self.is_multi_device_module = len(devices) > 1
        self.device_type = next(iter(devices)).type if devices else "cpu"
        if sync_models_at_startup:
            self._sync_params_and_buffers()
        for optimizer in optimizers:
            optimizer._bucket_numel = self._bucket_numel(reduce_buffer_size, optimizer)
            optimizer._sharded_ddp = self
            optimizer.refresh_trainable()  # rebuilt with these buckets, and attached through `_attach`

    @staticmethod
    def _bucket_numel(reduce_buffer_size: int, optimizer: OSS) -> int:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        element = params[0].element_size() if params else 4
        return max(1, int(reduce_buffer_size) // element)

    def _trainable_ids(self) -> frozenset:
        return frozenset(id(p) for p in self.module.parameters() if p.requires_grad)

    # -- wiring into the OSS -------------------------------------------------------------------------------

    def _attach(self, optimizer: OSS) -> None:
        """Called by `optimizer.refresh_trainable()`: reduce-scatter its buckets' gradients in backward."""
        stepper = optimizer.stepper
        dtype = stepper.buckets[0].dtype if stepper.buckets else torch.float32
        comm = torch.float16 if self._reduce_fp16 else dtype
        stepper.grads = ShardedGradReducer(stepper.buckets, accum_dtype=dtype, comm_dtype=comm,
                                           group=self._process_group)  # fmt: skip
        stepper.zero_stage = 2
        for handle in self._callback_hooks:
            handle.remove()
        self._callback_hooks = [
            p.register_post_accumulate_grad_hook(self._queue_end_of_backward)
            for p in self.module.parameters()
            if p.requires_grad
        ]

    def _queue_end_of_backward(self, _param) -> None:
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        for optimizer in self._sharded_optimizers:
            optimizer.stepper.backward_end()  # wait for the last reductions: shards complete

    # -- FairScale's API -------------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        if self.training and any(
            p.grad is not None and p.grad.requires_grad for p in self.module.parameters() if p.requires_grad
        ):
            # the gradients are reduce-scattered into flat shards: a gradient with a graph of its own
            # (double backward) would lose it there, so it is refused before the pass, as FairScale does
            raise RuntimeError("ShardedDataParallel only works with gradients that don't require grad")
        if self._auto_refresh_trainable and self._trainable_ids() != self._trainable:
            if self._warn_on_trainable_params_changed:
                logger.warning("ShardedDataParallel: trainable parameters changed; rebuilding the shards")
            self.refresh_trainable()
        if self._enable_broadcast_buffers and not self._should_accumulate_grads:
            self.sync_buffers(blocking=True)
        return self.module(*inputs, **kwargs)

    def refresh_trainable(self) -> None:
        """Rebuild the shards after parameters were frozen or unfrozen (collective)."""
        self._trainable = self._trainable_ids()
        for optimizer in self._sharded_optimizers:
            optimizer.refresh_trainable()

    @torch.no_grad()
    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast every buffer (batch-norm statistics, ...) from the group's first rank."""
        source = dist.get_global_rank(self._process_group, 0)
        works = [
            dist.broadcast(b.data, source, group=self._process_group, async_op=True)
            for b in self.module.buffers()
        ]
        if blocking:
            for work in works:
                work.wait()

    @torch.no_grad()
    def _sync_params_and_buffers(self) -> None:
        source = dist.get_global_rank(self._process_group, 0)
        for tensor in self.module.state_dict().values():
            if torch.is_tensor(tensor):
                dist.broadcast(tensor, source, group=self._process_group)

    def reduce(self) -> None:
        """Wait for the gradient reductions of the last backward (they also complete on their own)."""
        self._end_of_backward()

    def zero_grad(self, set_to_none: bool = False) -> None:
        del set_to_none  # the gradients are the shards, which have no "zero but allocated" state to keep
        for optimizer in self._sharded_optimizers:
            optimizer.stepper.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients over several backward passes (see the module docstring)."""
        old = self._should_accumulate_grads
        self._should_accumulate_grads = True
        try:
            yield
        finally:
            self._should_accumulate_grads = old

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
