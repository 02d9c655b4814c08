"""DeepSpeed's `deepspeed.runtime.utils` helpers that user code and Megatron-style models import.

Partitioning arithmetic (`partition_uniform`, `partition_balanced`, `prefix_sum_inc`) with DeepSpeed's
results (shardspeed's pipeline uses the same bounds, shardspeed/pipe/partition.py), `PartitionedTensor`
(a tensor split evenly over a process group, gathered back with `full()`), gradient-norm helpers, seeding and
`see_memory_usage`. They keep DeepSpeed's signatures.
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat
from shardspeed.pipe.partition import uniform_bounds
from shardspeed.utils.logging import logger

__all__ = [
    "PartitionedTensor",
    "call_to_str",
    "clip_grad_norm_",
    "get_global_norm",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "prime_factors",
    "see_memory_usage",
    "set_random_seed",
]


def prefix_sum_inc(weights) -> list:
    """Inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    sums, total = [], 0
    for w in weights:
        total += w
        sums.append(total)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` bounds of near-equal contiguous parts (the first parts take one more item; with fewer
    items than parts, one item per part and the rest empty)."""
    return uniform_bounds(num_items, num_parts)


def partition_balanced(weights, num_parts: int, eps: float = 1e-3) -> list[int]:
    """`num_parts + 1` bounds of non-empty contiguous parts whose weights vary least (the smallest sum of
    squared part weights: DeepSpeed 0.19's rule, which also keeps the heaviest part light).

    `eps` (DeepSpeed's search tolerance) is accepted for its signature; the split here is exact. With no more
    items than parts, one item per part (and the rest empty).
    """
    del eps
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = prefix_sum_inc([0, *weights])
    # cost[k][i]: least sum of squares splitting the first i items into k parts; cut[k][i]: where part k starts
    cost = [[math.inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    cost[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                candidate = cost[k - 1][j] + (prefix[i] - prefix[j]) ** 2
                if candidate < cost[k][i]:
                    cost[k][i], cut[k][i] = candidate, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def prime_factors(n: int) -> list[int]:
    """The prime factors of `n` in ascending order, with multiplicity (DeepSpeed's topology `_prime_factors`)."""
    if n <= 0:
        raise ValueError(f"prime_factors: expected a positive integer, got {n}")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


class PartitionedTensor:
    """`tensor` split into near-equal flat parts over `group`; this rank keeps `local_data`.

    `full()` all-gathers the parts back into a tensor of the original shape; `to_meta()` / `from_meta()`
    carry the shape and split to another process holding only its part (as the pipeline engine does).
    """

    def __init__(self, tensor: torch.Tensor, group, partition_meta=None) -> None:
        self.group = group
        self.num_parts = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.local_data, self.partition = self._partition(tensor.detach().reshape(-1))
        del partition_meta  # DeepSpeed's internal argument for from_meta

    def _partition(self, flat: torch.Tensor):
        bounds = partition_uniform(flat.numel(), self.num_parts)
        start, end = bounds[self.rank], bounds[self.rank + 1]
        return flat[start:end].clone(), bounds

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group, device=None) -> PartitionedTensor:
        """Rebuild from `to_meta()`'s tensor and this rank's part (no communication)."""
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        part = cls.__new__(cls)
        part.group, part.num_parts, part.rank = group, dist.get_world_size(group), dist.get_rank(group)
        part.orig_size = values[1 : 1 + ndim]
        part.partition = values[1 + ndim :]
        part.orig_device = device if device is not None else local_part.device
        part.local_data = local_part
        return part

    def to_meta(self) -> torch.Tensor:
        """Shape and split as one int64 tensor: [ndim, *shape, *bounds]."""
        return torch.tensor([len(self.orig_size), *self.orig_size, *self.partition], dtype=torch.long)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor (collective over the group)."""
        sizes = [self.partition[i + 1] - self.partition[i] for i in range(self.num_parts)]
        largest = max(sizes)
        padded = torch.zeros(largest, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[: self.local_data.numel()] = self.local_data
        gathered = torch.empty(largest * self.num_parts, dtype=padded.dtype, device=padded.device)
        all_gather_flat(gathered, padded, group=self.group)
        parts = [gathered[i * largest : i * largest + n] for i, n in enumerate(sizes)]
        whole = torch.cat(parts).view(self.orig_size)
        return whole.to(device) if device is not None else whole


def call_to_str(base: str, *args, **kwargs) -> str:
    """`base(arg, key=value)` as text, for logs."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def get_global_norm(norm_list) -> float:
    """The L2 norm of several groups' L2 norms."""
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> float:
    """Clip the gradients of `parameters` to `max_norm` (in place); returns their total norm.

    With `mpu`, the norm is reduced over its model-parallel group first (each rank holds part of the model).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if math.isinf(norm_type):
        total = torch.stack([g.detach().abs().max() for g in grads]).max().float()
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        total = torch.stack([g.detach().float().norm(norm_type) ** norm_type for g in grads]).sum()
        if mpu is not None:
            dist.all_reduce(total, group=mpu.get_model_parallel_group())
        total = total ** (1.0 / norm_type)
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient < 1:
        for g in grads:
            g.detach().mul_(coefficient)
    return float(total)


def set_random_seed(seed: int) -> None:
    """Seed Python's, torch's (and NumPy's, when installed) generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional for shardspeed
        return
    numpy.random.seed(seed)


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def see_memory_usage(message: str, force: bool = False, ranks=(0,)) -> None:
    """Log `message` with this process's memory (device allocated/reserved, host RSS) when `force`."""
    if not force:
        return
    if dist.is_initialized() and dist.get_rank() not in ranks:
        return
    gib = 1024**3
    parts = [message]
    if torch.cuda.is_available():
        parts.append(
            f"MA {torch.cuda.memory_allocated() / gib:.2f} GB, Max_MA {torch.cuda.max_memory_allocated() / gib:.2f} GB, "
            f"CA {torch.cuda.memory_reserved() / gib:.2f} GB"
        )
    parts.append(f"RSS {_rss_bytes() / gib:.2f} GB")
    logger.info(" | ".join(parts))


def move_to_device(item, device, criterion_func=None):
    """DeepSpeed's `runtime.utils.move_to_device`: the tensors in `item` (nested lists, tuples and dicts) on
    `device`. A tensor for which `criterion_func` is true moves in place (its storage is replaced, so every
    reference to it sees the move) and is returned itself; the others are copied with `.to(device)`, as in
    DeepSpeed. Leaves that are not tensors are returned as they are (DeepSpeed's `.to` fails on them)."""
    if isinstance(item, list):
        return [move_to_device(value, device, criterion_func) for value in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(value, device, criterion_func) for value in item)
    if isinstance(item, dict):
        return {key: move_to_device(value, device, criterion_func) for key, value in item.items()}
    if not isinstance(item, torch.Tensor):
        return item
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    return item.to(device)
