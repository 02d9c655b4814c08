"""FairScale's `Pipe` (GPipe in one process): a sequential model split over devices, run in micro-batches.

    model = Pipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8,
                 checkpoint="except_last")

The layers are split into consecutive partitions of `balance[i]` layers, partition i on `devices[i]`; the
batch is split into `chunks` micro-batches along its first dimension, each runs through the partitions in
order (moved from device to device between them, on GPipe's clock schedule), and the outputs are
concatenated on the last device.
Activations are checkpointed per partition and micro-batch (shardspeed's activation checkpointing) for
every micro-batch (`"always"`), all but the last (`"except_last"`) or none (`"never"`). The results and
gradients are those of the sequential model. What differs from FairScale: the micro-batches run one after
the other on the Python thread (FairScale overlaps partitions on CUDA streams and worker threads), so this
Pipe saves memory but does not overlap devices; shardspeed's multi-process pipeline is
`shardspeed.pipe.PipelineModule`. Without CUDA, `devices` defaults to the CPU for every partition.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from shardspeed.checkpointing import non_reentrant_checkpoint
from shardspeed.fairscale.deferred_batch_norm import DeferredBatchNorm, convert_deferred_batch_norm, untracked

__all__ = ["Pipe"]

CHECKPOINT_MODES = ("always", "except_last", "never")


class Pipe(nn.Module):
    """FairScale's `fairscale.nn.Pipe(module, balance, devices=None, chunks=1, checkpoint="except_last",
    deferred_batch_norm=False)`."""

    def __init__(self, module: nn.Sequential, balance=None, *, devices=None, chunks: int = 1,
                 checkpoint: str = "except_last", deferred_batch_norm: bool = False):  # fmt: skip
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise TypeError("Pipe: module must be nn.Sequential to be partitioned")
        # FairScale's errors point to fairscale.nn.pipe.balance (its profiling balancers, not offered here):
        # the messages keep that name so that code matching them still finds it.
        if balance is None:
            raise ValueError(
                "Pipe: balance is required (the number of layers of each partition); fairscale.nn.pipe.balance's "
                "automatic balancing is not offered here"
            )
        balance = [int(b) for b in balance]
        if any(b <= 0 for b in balance) or sum(balance) != len(module):
            raise ValueError(
                f"Pipe: balance {balance} must be positive and sum to the {len(module)} layers "
                "(see fairscale.nn.pipe.balance)"
            )
        if len({id(child) for child in module.children()}) != len(module):
            # one layer in two partitions would be moved, and checkpointed, twice
            raise ValueError("Pipe: module with duplicate children is not supported")
        if int(chunks) <= 0:
            raise ValueError("number of chunks must be positive integer")
        checkpoint = str(checkpoint)  # FairScale takes any object whose str() is a mode
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module)  # running statistics per batch, not per micro-batch
        if devices is None:
            count = torch.cuda.device_count()
            devices = [
                torch.device("cuda", i % count) if count else torch.device("cpu") for i in range(len(balance))
            ]
        devices = [torch.device(d) for d in devices]
        if len(devices) < len(balance):
            raise IndexError(f"Pipe: {len(balance)} partitions need as many devices (got {len(devices)})")
        # the layers keep their names in the partitions (`partitions.0.<name>`), as in FairScale
        layers, start, partitions = list(module.named_children()), 0, []
        for size, device in zip(balance, devices):
            partitions.append(nn.Sequential(OrderedDict(layers[start : start + size])).to(device))
            start += size
        self.partitions = nn.ModuleList(partitions)
        self.balance, self.devices = balance, devices[: len(balance)]
        self.chunks, self.checkpoint = int(chunks), checkpoint

    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        return [layer for p in self.partitions for layer in p][index]

    def __iter__(self):
        for partition in self.partitions:
            yield from partition

    def forward(self, batch):
        """`batch`: a tensor, or a tuple of tensors split alike along their first dimension (FairScale's)."""
        is_tuple = isinstance(batch, tuple)
        if not (torch.is_tensor(batch) or (is_tuple and all(torch.is_tensor(t) for t in batch))):
            raise TypeError(f"Pipe.forward takes a tensor or a tuple of tensors, got {type(batch).__name__}")
        if not self.partitions:
            return batch  # an empty Sequential is the identity, as in FairScale
        outputs = self._run_clocks(_split(batch, self.chunks))
        if self.training:  # the whole batch has run: one running-statistics update (deferred batch norm)
            for layer in self.modules():
                if isinstance(layer, DeferredBatchNorm):
                    layer.commit()
        if isinstance(outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outputs))
        return torch.cat(outputs)

    def _run_clocks(self, micro_batches: list) -> list:
        """GPipe's schedule, as FairScale's: at clock k, micro-batch i runs on partition k - i, for every i at
        once (here one after the other, first partition first). A micro-batch that raises stops the pipe at
        the end of its clock, so later micro-batches do not run through the partitions before it."""
        outputs, count = list(micro_batches), len(micro_batches)
        stop = {"always": count, "except_last": count - 1, "never": 0}[self.checkpoint]
        for clock in range(count + len(self.partitions) - 1):
            failure = None
            for j, (partition, device) in enumerate(zip(self.partitions, self.devices)):
                index = clock - j
                if not 0 <= index < count:
                    continue
                try:
                    micro = _to(outputs[index], device)
                    if index < stop and torch.is_grad_enabled():
                        outputs[index] = non_reentrant_checkpoint(_recomputed_untracked(partition), micro)
                    else:
                        outputs[index] = partition(micro)
                except Exception as error:  # re-raised after the clock, as FairScale does
                    failure = failure or error
            if failure is not None:
                raise failure
        return outputs


def _recomputed_untracked(partition: nn.Module):
    """The partition, for checkpointing: its first call is the forward pass, later ones the recomputation,
    which must not count the micro-batch again in deferred batch norms."""
    calls = 0

    def run(micro):
        nonlocal calls
        calls += 1
        if calls == 1:
            return partition(micro)
        with untracked(partition):
            return partition(micro)

    return run


def _split(batch, chunks: int) -> list:
    if torch.is_tensor(batch):
        return list(batch.chunk(chunks))
    pieces = [t.chunk(chunks) for t in batch]
    if len({len(p) for p in pieces}) != 1:
        sizes = [t.shape[0] for t in batch]
        raise ValueError(
            f"Pipe.forward: the tensors of the batch tuple split into different chunk counts (sizes {sizes})"
        )
    return [tuple(parts) for parts in zip(*pieces)]


def _to(micro, device: torch.device):
    return tuple(t.to(device) for t in micro) if isinstance(micro, tuple) else micro.to(device)
