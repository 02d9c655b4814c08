"""`UlyssesSPDataLoaderAdapter`: ALST's data loader wrapper, which shards each sample's sequence over the group.

Every rank of a sequence group draws its own batch from the wrapped loader, as in plain data parallelism.
The adapter then exchanges them, so that the group processes the P batches one after the other, each split
along the sequence: on step k of a round of P, rank r gets slice r of the batch rank k drew. A round of P
steps therefore consumes as many samples as one data-parallel step would; `len()` is P x the loader's.

Each batch is a dict of [batch, sequence, ...] tensors (others are passed to every rank as they are) and
must hold `input_ids`, `position_ids` (kept per token, so positions stay global after slicing) and `labels`.
The labels are shifted before slicing, because the next token of a slice's last position lives on the next
rank: `labels` is replaced by `shift_labels` (label t+1 at position t, -100 after the last). The slices are
returned on the CPU (P of them are queued at once; at millions of tokens that is not device memory to spend).

Batches may have different sequence lengths on different ranks (each must be divisible by P): they are
padded to the longest for the exchange (Gloo gathers only equal shapes) and cut back after it.
"""

from __future__ import annotations

import pickle
from collections import deque

import torch
import torch.distributed as dist
from torch.nn import functional as F

__all__ = ["UlyssesSPDataLoaderAdapter"]

_IGNORE_INDEX = -100  # the label cross-entropy skips (Transformers' and PyTorch's default)


class UlyssesSPDataLoaderAdapter:
    """Wraps `dl` for this rank (`sp_rank` of `sp_world_size` in `sp_group`); `device` is where the batches
    are exchanged (the collective's device: CUDA for NCCL, the CPU for Gloo)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device) -> None:
        self.dl = dl
        self.sp_rank, self.sp_group, self.sp_world_size = sp_rank, sp_group, sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch, exchange it with the group and queue this rank's slice of each of the P batches.
        At the end of the wrapped loader the iterator restarts (next epoch) and StopIteration is raised."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        _check_batch(batch)
        gathered = [{} for _ in range(self.sp_world_size)]
        lengths = self._gather_lengths(batch["input_ids"].shape[1])
        for key, value in batch.items():
            values = (
                self._gather_tensor(value, lengths) if torch.is_tensor(value) else self._gather_object(value)
            )
            for rank_batch, v in zip(gathered, values):
                rank_batch[key] = v
        for rank_batch in gathered:
            self.micro_batches.append(self._slice(rank_batch))

    def _gather_lengths(self, length: int) -> list[int]:
        mine = torch.tensor([length], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.sp_world_size)]
        dist.all_gather(everyone, mine, group=self.sp_group)
        return [int(t.item()) for t in everyone]

    def _gather_tensor(self, tensor: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
        tensor = tensor.to(self.device)
        longest = max(lengths)
        # pad dimension 1 (F.pad lists dimensions from the last one backwards)
        padding = [0, 0] * (tensor.dim() - 2) + [0, longest - tensor.shape[1]]
        padded = F.pad(tensor, padding).contiguous()
        pieces = [torch.empty_like(padded) for _ in range(self.sp_world_size)]
        with torch.no_grad():
            dist.all_gather(pieces, padded, group=self.sp_group)
        return [piece[:, :n] for piece, n in zip(pieces, lengths)]

    def _gather_object(self, value) -> list:
        """Every rank's non-tensor `value`, pickled as DeepSpeed's `all_gather_object` does, but sent as a
        byte tensor: torch's `*_object` collectives need NumPy, which a clean install does not have."""
        data = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(self.device)
        lengths = self._gather_lengths(data.numel())
        padded = F.pad(data, (0, max(lengths) - data.numel()))
        pieces = [torch.empty_like(padded) for _ in range(self.sp_world_size)]
        dist.all_gather(pieces, padded, group=self.sp_group)
        # the peers of this job's own sequence group: the same trust as torch's all_gather_object
        return [pickle.loads(bytes(p[:n].cpu().tolist())) for p, n in zip(pieces, lengths)]

    def _slice(self, batch: dict) -> dict:
        length = batch["input_ids"].shape[1]
        if length % self.sp_world_size != 0:
            raise ValueError(f"batch's seqlen={length} isn't divisible by sp-size={self.sp_world_size}")
        chunk = length // self.sp_world_size
        labels = batch.pop("labels")
        # label of position t is the token at t+1: shift before slicing, -100 where no next token exists
        batch["shift_labels"] = F.pad(labels, (0, 1), value=_IGNORE_INDEX)[:, 1:].contiguous()
        start = chunk * self.sp_rank
        return {k: v[:, start : start + chunk].cpu() if torch.is_tensor(v) else v for k, v in batch.items()}


def _check_batch(batch) -> None:
    missing = [k for k in ("input_ids", "position_ids", "labels") if k not in batch]
    if missing:
        raise ValueError(
            f"Ulysses SP requires {missing} in every data loader batch. position_ids keep each token's global "
            "position after sequence sharding (non-packed sequences: torch.arange(seq_len) per sample; packed: "
            "restarting at document boundaries); labels become the pre-shifted shift_labels."
        )
    length = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
            raise ValueError(
                f"{key}'s shape {tuple(value.shape)} must match input_ids's shape {tuple(batch['input_ids'].shape)} "
                "in its first two dimensions [batch, sequence]"
            )
