"""What a benchmark job measures besides time: bytes communicated, model-state bytes, resident memory.

- `CommCounter` counts every collective at the dispatcher (`c10d::*` ops), where Python wrappers, DDP's C++
  reducer, FSDP2 and DeepSpeed all pass, so every system is counted the same way. It puts all ops through
  Python, so the harness uses it for one untimed step only.
- `model_state_bytes` walks the objects a system holds (module, optimizer wrappers, their buffers) and sums
  the distinct tensor storages it finds: parameters, gradients, fp32 masters, optimizer state, gradient
  buckets. Views of one flat buffer count once. It reports both the bytes held (allocated) and the bytes
  resident (pages the OS has actually backed, from `mincore`): a buffer allocated with `torch.empty` and
  never filled, like DeepSpeed stage 3's default 5e8-element reduce bucket, is held but not resident on CPU
  (on a GPU the caching allocator would reserve it all).
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "CommCounter",
    "StateBytes",
    "model_state_bytes",
    "peak_rss_bytes",
    "rss_after_trim_bytes",
    "zero_formula_bytes",
]

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = ("barrier", "monitored_barrier", "wait_tensor", "recv_", "send")


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class CommCounter(TorchDispatchMode):
    """Counts collectives and their payload: the largest tensor argument of each call, in bytes.

    All-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the full input; broadcast: the
    tensor. `zero_volume_bytes` weighs an all-reduce twice (a reduce-scatter plus an all-gather), the
    convention of the ZeRO paper's 2Ψ / 3Ψ communication volumes.
    """

    def __init__(self):
        super().__init__()
        self.bytes_by_op: Counter = Counter()
        self.calls_by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            name = func.__name__.split(".")[0]
            if not name.startswith(_NOT_COLLECTIVES):
                payload = max([_tensor_bytes(a) for a in args] + [_tensor_bytes(v) for v in kwargs.values()])
                self.bytes_by_op[name] += payload
                self.calls_by_op[name] += 1
        return func(*args, **kwargs)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    @property
    def zero_volume_bytes(self) -> int:
        return sum(b * (2 if "allreduce" in op else 1) for op, b in self.bytes_by_op.items())


# Objects defined in these packages are walked through their attributes; anything else is opaque.
_WALKED_PACKAGES = ("shardspeed", "deepspeed", "torch.optim", "torch.distributed", "torch.nn.parallel")
_MODULE_SKIP = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_backward_hooks"}


class _StorageWalker:
    def __init__(self):
        self.storages: dict[tuple[int, int], tuple[int, int, bool]] = {}
        self.visited: set[int] = set()

    def visit(self, obj) -> None:
        if id(obj) in self.visited or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        self.visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, nn.Module):
            self._module(obj)
        elif isinstance(obj, dict):
            for key, value in list(obj.items()):
                self.visit(key)
                self.visit(value)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in list(obj):
                self.visit(item)
        elif type(obj).__module__.startswith(_WALKED_PACKAGES) and hasattr(obj, "__dict__"):
            for value in list(vars(obj).values()):
                self.visit(value)

    def _tensor(self, t: torch.Tensor) -> None:
        if hasattr(t, "__tensor_flatten__") and type(t) is not nn.Parameter:  # DTensor and other wrappers
            names, _ = t.__tensor_flatten__()
            for name in names:
                self.visit(getattr(t, name))
        elif t.device.type != "meta":
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device.index or 0)
            self.storages[key] = (storage.data_ptr(), storage.nbytes(), t.device.type == "cpu")
        if t.is_leaf and t.requires_grad:
            self.visit(t.grad)
        for value in list(getattr(t, "__dict__", {}).values()):  # e.g. DeepSpeed's `ds_tensor` partitions
            self.visit(value)

    def _module(self, module: nn.Module) -> None:
        for p in module.parameters():
            self.visit(p)
        for child in module.children():
            self.visit(child)
        for key, value in list(vars(module).items()):
            if key not in _MODULE_SKIP:
                self.visit(value)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident(ptr: int, nbytes: int) -> int:
    """Bytes of [ptr, ptr + nbytes) in resident pages (whole pages at the ends count whole)."""
    if nbytes < 16 * _PAGE:  # small tensors live inside malloc arenas; take them as resident
        return nbytes
    start = ptr - ptr % _PAGE
    pages = (ptr + nbytes - start + _PAGE - 1) // _PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        return nbytes
    resident_pages = int((torch.frombuffer(bytearray(vec), dtype=torch.uint8) & 1).sum())
    return min(nbytes, resident_pages * _PAGE)


@dataclass(frozen=True)
class StateBytes:
    held: int  # bytes of the distinct storages
    resident: int  # of which backed by memory now (CPU); equal to `held` for device tensors


def model_state_bytes(roots: list, hidden: int = 0) -> StateBytes:
    """The distinct tensor storages reachable from `roots`, plus `hidden` bytes (see the module docstring)."""
    walker = _StorageWalker()
    for root in roots:
        walker.visit(root)
    held = resident = hidden
    for ptr, nbytes, on_cpu in walker.storages.values():
        held += nbytes
        resident += _resident(ptr, nbytes) if on_cpu else nbytes
    return StateBytes(held, resident)


def peak_rss_bytes() -> int:
    """This process's peak resident set (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_after_trim_bytes() -> int:
    """Resident set now, after giving freed heap pages back to the OS (glibc `malloc_trim`)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def zero_formula_bytes(stage: int, numel: int, world_size: int) -> int:
    """fp32 training with Adam: params 4Ψ + grads 4Ψ + Adam moments 8Ψ, partitioned as ZeRO `stage` says."""
    n = world_size
    per_param = {0: 16, 1: 4 + 4 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]
    return int(per_param * numel)


class CpuWindow:
    """CPU time the whole machine and this process spent over a window, to tell how much others took.

    Each rank reports both; the harness subtracts all its ranks' own time from the machine's busy time to
    get the cores other users' processes kept busy while the job was being timed (/proc/stat, 10 ms ticks).
    """

    _TICK = os.sysconf("SC_CLK_TCK")

    @classmethod
    def _machine_busy_s(cls) -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return (sum(fields) - fields[3] - fields[4]) / cls._TICK  # all but idle and iowait

    @staticmethod
    def _own_cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def __enter__(self) -> CpuWindow:
        self._start = (time.perf_counter(), self._machine_busy_s(), self._own_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        end = (time.perf_counter(), self._machine_busy_s(), self._own_cpu_s())
        self.wall_s, self.machine_busy_s, self.own_cpu_s = (e - s for e, s in zip(end, self._start))
