"""One parameter FSDP shards: its lifecycle between this rank's shard and the full value.

A `ShardedParam` is a leaf `nn.Parameter` the optimizer steps: the flat parameter of a wrapped module
(`flatten_parameters=True`: all its parameters packed into one padded flat tensor, core/flat_params.py's
layout) or one original parameter. Between uses `param.data` is this rank's shard (fp32, on the host under
`move_params_to_cpu`); around forward and backward it is the full value in the compute dtype on the compute
device, gathered into one persistent buffer whose storage is freed when it is resharded.

[Note: FSDP full buffer] The gathered value is written through `full` (a tensor of its own) and
`param.data` is a view of it, so the all-gather does not bump the version counter of the parameter:
activations saved for backward by the modules (views of the parameter) stay valid when the buffer is freed
after forward and gathered again, into the same storage, before backward.

States (`ShardState`): SHARDED (`param.data` is the shard) and FULL (`param.data` views the full buffer).
Gradients: autograd accumulates a full gradient into `param.grad`; `reduce_gradient` (called by the
wrapper's post-accumulate hook) reduce-scatters it, so `param.grad` becomes the averaged shard gradient,
added to the shard gradient an earlier backward left there (accumulation across backward calls).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_gather_flat, reduce_scatter_flat

__all__ = ["ShardState", "ShardedParam", "rank_and_size"]


def rank_and_size(group) -> tuple[int, int]:
    """This rank and the group's size, asked of the group itself where it can answer (a ProcessGroup, or a
    stand-in such as FairScale's tests' DummyProcessGroup: a group of one needs no process group at all)."""
    if hasattr(group, "rank") and hasattr(group, "size"):
        return group.rank(), group.size()
    return dist.get_rank(group), dist.get_world_size(group)


class ShardState(enum.Enum):
    SHARDED = "sharded"
    FULL = "full"


class ShardedParam:
    """The sharding of one leaf parameter over `group` (see the module docstring)."""

    def __init__(self, param: nn.Parameter, group, *, compute_dtype: torch.dtype, compute_device: torch.device,
                 host_device: torch.device, reduce_dtype: torch.dtype, predivide: float):  # fmt: skip
        self.param = param
        self.group = group
        self.rank, self.world = rank_and_size(group)
        self.shape = param.shape
        self.numel = param.numel()
        self.shard_numel = -(-self.numel // self.world)
        self.padded_numel = self.shard_numel * self.world
        self.compute_dtype, self.compute_device = compute_dtype, compute_device
        self.reduce_dtype, self.predivide = reduce_dtype, predivide
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=param.device)
        flat[: self.numel].copy_(param.detach().reshape(-1))
        start = self.rank * self.shard_numel
        self.shard = flat[start : start + self.shard_numel].clone().to(host_device)
        param.data = self.shard
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=compute_device)
        self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED
        self.saved_grad: torch.Tensor | None = None  # the shard gradient of earlier backward passes
        self.unsynced_grad: torch.Tensor | None = None  # full gradients accumulated under no_sync()

    # -- parameters ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather(self) -> None:
        """Make `param.data` the full value (collective: one all-gather). No-op when already full."""
        if self.state is ShardState.FULL:
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        own = self.full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        own.copy_(self.shard)
        if self.world > 1:
            all_gather_flat(self.full, own, group=self.group)
        self.param.data = self.full[: self.numel].view(self.shape)
        self.state = ShardState.FULL

    def reshard(self) -> None:
        """Back to the shard; the full buffer's memory is released."""
        if self.state is ShardState.SHARDED:
            return
        self.param.data = self.shard
        self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    @torch.no_grad()
    def full_fp32(self) -> torch.Tensor:
        """The whole parameter in fp32, a fresh tensor on the shard's device (collective)."""
        full = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        own = full[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        own.copy_(self.shard)
        if self.world > 1:
            all_gather_flat(full, own, group=self.group)
        return full[: self.numel].view(self.shape)

    @torch.no_grad()
    def write_full(self, value: torch.Tensor) -> None:
        """Take this rank's shard of a full value (every rank passes the same value)."""
        flat = value.detach().reshape(-1).to(self.shard.device, self.shard.dtype)
        start = self.rank * self.shard_numel
        end = min(start + self.shard_numel, self.numel)
        self.shard.zero_()
        if end > start:
            self.shard[: end - start].copy_(flat[start:end])

    # -- gradients -----------------------------------------------------------------------------------------

    def stash_gradient(self) -> None:
        """Before a backward: an existing shard gradient moves aside (autograd will write a full one)."""
        if self.param.grad is not None and self.param.grad.numel() == self.shard_numel:
            self.saved_grad = (
                self.param.grad if self.saved_grad is None else self.saved_grad + self.param.grad
            )
            self.param.grad = None

    @torch.no_grad()
    def reduce_gradient(self, sync: bool) -> None:
        """The full gradient autograd just accumulated becomes the averaged shard gradient (collective), or,
        with `sync` False (no_sync), is kept aside until a synchronised backward."""
        grad = self.param.grad
        self.param.grad = None
        if grad is not None:
            grad = grad.reshape(-1)
            if self.unsynced_grad is not None:
                grad = grad + self.unsynced_grad
                self.unsynced_grad = None
        if not sync:
            self.unsynced_grad = grad
            self.reshard()
            self._restore_saved_gradient()
            return
        buffer = torch.zeros(self.padded_numel, dtype=self.reduce_dtype, device=self.compute_device)
        if grad is not None:
            buffer[: self.numel].copy_(grad)
        if self.predivide != 1.0:
            buffer.div_(self.predivide)
        own = buffer[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        if self.world > 1:
            reduce_scatter_flat(own, buffer, group=self.group)
        post = self.world / self.predivide
        shard_grad = own.to(self.shard.device, torch.float32)  # the gradient lives where the shard does
        if post != 1.0:
            shard_grad = shard_grad.div_(post) if shard_grad is not own else shard_grad / post
        self.reshard()
        if self.saved_grad is not None:
            shard_grad = shard_grad.to(self.saved_grad.device).add_(self.saved_grad)
            self.saved_grad = None
        self.param.grad = shard_grad.to(self.shard.device)

    def _restore_saved_gradient(self) -> None:
        if self.saved_grad is not None:
            self.param.grad = self.saved_grad
            self.saved_grad = None
