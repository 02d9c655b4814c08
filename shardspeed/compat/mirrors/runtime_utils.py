"""DeepSpeed's `deepspeed.runtime.utils` helpers that user code and Megatron-style models import.

Partitioning arithmetic (`partition_uniform`, `partition_balanced`, `prefix_sum_inc`) with DeepSpeed's
results (shardspeed's pipeline uses the same bounds, shardspeed/pipe/partition.py), `PartitionedTensor`
(a tensor split evenly over a process group, gathered back with `full()`), gradient-norm helpers, seeding and
`see_memory_usage`. They keep DeepSpeed's signatures.

The gradient helpers agree across ranks as DeepSpeed's do: `clip_grad_norm_` averages the norm over the
data-parallel group (expert parameters, `allreduce = False`, give each rank its own norm, so every rank clips
by the same mean), and `CheckOverflow` takes the maximum of the overflow flag over the largest expert-parallel
group when expert parameters are present, so one rank's inf skips the step everywhere.
"""

from __future__ import annotations

import math
import os
import random

import torch
import torch.distributed as dist

from shardspeed.comm.collectives import all_gather_flat, comm_device
from shardspeed.compat.mirrors.utils_groups import _get_data_parallel_group, _get_max_expert_parallel_group
from shardspeed.moe.utils import is_moe_param
from shardspeed.pipe.partition import uniform_bounds
from shardspeed.utils.logging import logger

__all__ = [
    "CheckOverflow",
    "PartitionedTensor",
    "call_to_str",
    "clip_grad_norm_",
    "count_used_parameters_in_backward",
    "get_global_norm",
    "get_weight_norm",
    "has_inf_or_nan",
    "is_invalid_grad_norm",
    "is_model_parallel_parameter",
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


def is_model_parallel_parameter(p) -> bool:
    """Whether `p` is split over the tensor/model-parallel ranks (Megatron marks it `model_parallel` or
    `tensor_model_parallel`; an AutoTP shard carries its `tp_partition`); the other parameters are replicated
    there and counted once in norms."""
    if getattr(p, "tp_partition", None) is not None:
        return True
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _tensor_model_parallel_rank(mpu) -> int:
    if mpu is None:
        return 0
    getter = getattr(mpu, "get_tensor_model_parallel_rank", None) or mpu.get_model_parallel_rank
    return getter()


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether `x` holds an inf or a nan, as a bool tensor on `x`'s device (no host sync per tensor)."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return ~(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def is_invalid_grad_norm(norm) -> bool:
    """A norm that signals overflow: not finite, or negative (get_weight_norm's -1)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list) -> float:
    """The L2 norm of several groups' L2 norms; inf when any of them is invalid (see is_invalid_grad_norm)."""
    if any(is_invalid_grad_norm(n) for n in norm_list):
        return float("inf")
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Clip the gradients of `parameters` to `max_norm` (in place); returns their total norm (a tensor).

    With `mpu`, the norm is reduced over its model-parallel group first, each replicated parameter counted on
    model-parallel rank 0 only. With a process group, the norm is then averaged over the data-parallel group
    (DeepSpeed's rule: expert parameters make the norms differ between ranks, and every rank must clip by the
    same coefficient).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    device = comm_device() if dist.is_initialized() else parameters[0].grad.device
    if math.isinf(norm_type):
        total = torch.stack([p.grad.detach().abs().max().float() for p in parameters]).max().to(device)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    else:
        counted = [
            p
            for p in parameters
            if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)
        ]
        norms = [p.grad.detach().float().norm(norm_type) for p in counted]
        total = (
            torch.stack(norms).pow(norm_type).sum().to(device) if norms else torch.zeros((), device=device)
        )
        if mpu is not None:
            dist.all_reduce(total, group=mpu.get_model_parallel_group())
        total = total.pow(1.0 / norm_type)
    if dist.is_initialized():
        group = _get_data_parallel_group()
        total = total / dist.get_world_size(group)
        dist.all_reduce(total, group=group)
    total = total.to(parameters[0].grad.device)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(coefficient.to(p.grad.dtype))
    return total


def get_weight_norm(parameters, norm_type: float = 2, mpu=None) -> float:
    """The total norm of the tensors `parameters` themselves (weights, or flat gradient buffers), summed over
    `mpu`'s model-parallel group; -1 when it is inf or nan (DeepSpeed's overflow signal)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        total = torch.stack([p.data.abs().max().float() for p in parameters]).max().reshape(1)
        op = dist.ReduceOp.MAX
    else:
        mp_rank = _tensor_model_parallel_rank(mpu)
        counted = [
            p
            for p in parameters
            if not getattr(p, "ds_pipe_replicated", False)  # a pipeline-tied copy is counted once
            and (mp_rank == 0 or is_model_parallel_parameter(p))
        ]
        total = sum((p.data.float().norm(norm_type) ** norm_type for p in counted), torch.zeros(())).reshape(
            1
        )
        op = dist.ReduceOp.SUM
    if mpu is not None:
        total = total.to(comm_device(mpu.get_model_parallel_group()))
        dist.all_reduce(total, op=op, group=mpu.get_model_parallel_group())
    value = float(total[0]) if math.isinf(norm_type) else float(total[0]) ** (1.0 / norm_type)
    return value if math.isfinite(value) else -1


class CheckOverflow:
    """Whether any gradient of `param_groups` holds an inf or a nan, agreed over the ranks that must skip the
    step together: the largest expert-parallel group when expert parameters are present, the model-parallel
    group of `mpu`, the world with `zero_reduce_scatter` (and, for an engine that does not all-reduce
    gradients, its data-parallel group or the world)."""

    def __init__(
        self, param_groups=None, mpu=None, zero_reduce_scatter: bool = False, deepspeed=None
    ) -> None:
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    def check_using_norm(self, norm_group, reduce_overflow: bool = True) -> bool:
        """Overflow from norms already computed (an invalid norm is an overflow), agreed over the groups."""
        flag = torch.tensor([float(any(is_invalid_grad_norm(n) for n in norm_group))], device=self._device())
        if self.has_moe_params:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_get_max_expert_parallel_group())
        if self.mpu is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            dist.barrier()
        return bool(flag[0])

    def check(self, param_groups=None) -> bool:
        """Overflow in the gradients of `param_groups` (default: those given at construction)."""
        if param_groups is None:
            return self.has_overflow(self.params, self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        """This rank's gradients only (no communication)."""
        return any(
            p.grad is not None and bool(self._has_inf_or_nan(p.grad.data, i)) for i, p in enumerate(params)
        )

    def has_overflow(self, params, has_moe_params=None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        flag = torch.tensor([float(self.has_overflow_serial(params))], device=self._device())
        if has_moe_params:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_get_max_expert_parallel_group())
        if self.zero_reduce_scatter:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        elif self.mpu is not None:
            if self._engine_does_not_reduce_gradients():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_data_parallel_group())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif self._engine_does_not_reduce_gradients():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0])

    def _engine_does_not_reduce_gradients(self) -> bool:
        """The engine leaves gradients unreduced, so ranks can disagree: then the data ranks must agree too."""
        engine = self.deepspeed
        if engine is None:
            return False
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            return engine.pipeline_enable_backward_allreduce is False
        return getattr(engine, "enable_backward_allreduce", True) is False

    @staticmethod
    def _device() -> torch.device:
        return comm_device() if dist.is_initialized() else torch.device("cpu")

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor, i: int = 0) -> torch.Tensor:
        del i  # DeepSpeed's index of the tensor, for its debug print
        return has_inf_or_nan(x)


def count_used_parameters_in_backward(parameters) -> int:
    """How many of `parameters` the running backward pass will produce a gradient for. Call it from a backward
    hook: it asks the autograd engine which gradient-accumulator nodes of the current graph task will run
    (parameters that do not require grad, or share a node, count once or not at all). RuntimeError outside a
    backward pass."""
    graph = torch.autograd.graph
    if not (
        hasattr(graph, "_get_grad_fn_or_grad_acc")
        and hasattr(torch._C, "_current_graph_task_id")
        and hasattr(torch._C, "_will_engine_execute_node")
    ):
        raise RuntimeError(
            "count_used_parameters_in_backward needs autograd internals this torch build lacks"
        )
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    nodes = set()  # a node shared by two parameters (views of one leaf) counts once
    for param in parameters:
        if not isinstance(param, torch.Tensor) or not param.requires_grad:
            continue
        # backward hooks run with grad mode off, and looking up a leaf's accumulator node needs it on
        with torch.enable_grad():
            node = graph._get_grad_fn_or_grad_acc(param)
        if node is not None:
            nodes.add(node)
    return sum(bool(torch._C._will_engine_execute_node(node)) for node in nodes)


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
