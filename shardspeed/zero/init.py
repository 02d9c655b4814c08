"""`zero.Init`: construct a model already partitioned across the data-parallel ranks.

Inside the context every module's parameters are split as soon as the module's own (most-derived)
`__init__` returns: each rank keeps a 1/N chunk of each parameter (`_zero_init_shard`) and the parameter's
`.data` becomes empty, so a model larger than one rank's memory can be built layer by layer. Values are
broadcast from rank 0 first, so every rank holds the same model a normal construction with the same seed
would give. `nn.Module.apply` is patched to gather a module's parameters around the applied function (the
usual `model.apply(init_weights)` pattern works).

The engine turns these chunks into its ZeRO-3 units (or full parameters for stages 0-2) one parameter at
a time. Code that writes into a child's parameters after the child was built, other than through `apply`,
must wrap that code in `zero.GatheredParameters(params, modifier_rank=0)` — as with DeepSpeed.

A partitioned parameter carries DeepSpeed's attributes, which code detecting ZeRO-3 parameters reads:
`ds_id` (a process-wide counter), `ds_status` (`ZeroParamStatus`: NOT_AVAILABLE while only the chunk
exists, AVAILABLE while gathered), `ds_shape`, `ds_numel`, `ds_tensor` (this rank's chunk), `ds_persist`,
`ds_process_group` and `ds_active_sub_modules`. Under a ZeRO-3 engine the same attributes follow its units
(param_units.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.core.partitioned import (
    ZeroParamStatus,
    is_partitioned,
    mark_zero_param,
    materialize,
)

_active = 0  # nesting depth of Init contexts
_remote = None  # the outermost active context's RemoteTier (re-partitioning after `apply` uses it too)
_originals: dict[type, object] = {}


def _partition(param: nn.Parameter, group, dtype: torch.dtype | None, remote=None, zeropp=None) -> None:
    if zeropp:  # ZeRO++ switches asked of zero.Init: the engine turns them on (zero/zeropp/__init__.py)
        param._zero_init_zeropp = zeropp
    if is_partitioned(param):
        return
    data = param.data.to(dtype) if dtype is not None and param.is_floating_point() else param.data
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(data, src=src, group=group)  # every rank starts from rank 0's values
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-data.numel() // world)
    shard = torch.zeros(chunk, dtype=data.dtype, device=data.device)
    mine = data.reshape(-1)[rank * chunk : (rank + 1) * chunk]
    shard[: mine.numel()].copy_(mine)
    if remote is not None:
        shard = remote.place(shard)
    param._zero_init_shard, param._zero_init_shape, param._zero_init_group = shard, tuple(data.shape), group
    mark_zero_param(param, data.shape, group, ZeroParamStatus.NOT_AVAILABLE, tensor=shard)
    param.data = torch.empty(0, dtype=data.dtype, device=data.device)


def _partition_module(module: nn.Module, group, dtype, recurse: bool, remote=None, zeropp=None) -> None:
    for p in module.parameters(recurse=recurse):
        _partition(p, group, dtype, remote, zeropp)


class RemoteTier:
    """`remote_device`: where chunks go once partitioned. "cpu": host memory (page-locked with `pin_memory`
    on CUDA). "nvme": a file under the config's `offload_param.nvme_path`, memory-mapped — the chunk's
    pages are read from the file when touched and the kernel may drop them again, so a model larger than
    memory can be built. The file is unlinked right after mapping: its space is freed with the mapping, and
    nothing is left behind whatever happens to the process."""

    def __init__(self, device: str, pin_memory: bool, config):
        if device not in ("cpu", "nvme"):
            raise ValueError(f"zero.Init: remote_device must be None, 'cpu' or 'nvme', got {device!r}")
        self.device, self.pin = device, pin_memory and torch.cuda.is_available()
        self.folder = None
        if device == "nvme":
            import os
            import tempfile

            path = _nvme_path_from_config(config)
            self.folder = tempfile.mkdtemp(prefix=f"shardspeed-swap-{os.getpid()}-init-", dir=path)
            os.rmdir(self.folder)  # only a unique name prefix is needed: files are unlinked once mapped
        self._count = 0

    def place(self, shard: torch.Tensor) -> torch.Tensor:
        if self.device == "cpu":
            host = shard.to("cpu")
            return host.pin_memory() if self.pin else host
        import os

        from shardspeed.zero.swap.aio import write_file

        path = f"{self.folder}-{self._count}"
        self._count += 1
        write_file(shard.to("cpu").contiguous(), path)
        try:
            return torch.from_file(path, shared=True, size=shard.numel(), dtype=shard.dtype)
        finally:
            os.unlink(path)


def _nvme_path_from_config(config) -> str:
    from shardspeed.config.loader import read_config_source
    from shardspeed.zero.swap.folder import check_nvme_path

    raw = read_config_source(config.raw if hasattr(config, "raw") else config) if config is not None else {}
    block = (raw.get("zero_optimization") or {}).get("offload_param") or {}
    if not block.get("nvme_path"):
        raise ValueError(
            "zero.Init(remote_device='nvme') needs config_dict_or_path with "
            "zero_optimization.offload_param.nvme_path"
        )
    return str(check_nvme_path(block["nvme_path"], 0, "zero_optimization.offload_param.nvme_path"))


class Init:
    """Context manager (or `Init(module=model)`) partitioning parameters at construction, as DeepSpeed's."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None, enabled=True,
                 dtype=None, mpu=None, zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None,
                 param_swapper=None):  # fmt: skip
        from shardspeed.comm.init import init_distributed

        self.enabled = enabled
        if not enabled:
            return
        init_distributed()
        if sequence_data_parallel_group is not None:  # DeepSpeed's deprecated name for the same argument
            if data_parallel_group is not None:
                raise ValueError(
                    "zero.Init: give data_parallel_group or the deprecated sequence_data_parallel_group, not both"
                )
            data_parallel_group = sequence_data_parallel_group
        self.group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None
        )  # fmt: skip
        # A group the caller chose (directly or through the mpu) may have one rank on purpose; the world
        # group having one rank under a multi-process launcher means it was made before the launcher's
        # (every rank would then build the whole model: an out-of-memory that looks like "model too big").
        contradiction = contradicting_single_rank_group_error(dist.get_world_size(self.group), self.group)
        if contradiction is not None:
            raise RuntimeError(contradiction)
        self.dtype = dtype or _dtype_from_config(config_dict_or_path or config)
        self.remote = None if remote_device in (None, "none") else (
            RemoteTier(remote_device, pin_memory, config_dict_or_path or config)
        )  # fmt: skip
        # DeepSpeed's zero.Init switches for ZeRO++: recorded on the parameters, honoured by the engine
        self.zeropp = {
            key: True
            for key, on in (("zero_quantized_weights", zero_quantized_weights),
                            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights))
            if on
        }  # fmt: skip
        if module is not None:
            _partition_module(
                module, self.group, self.dtype, recurse=True, remote=self.remote, zeropp=self.zeropp
            )

    def __enter__(self):
        global _active
        if self.enabled:
            if _active == 0:
                _install(self.group, self.dtype, self.remote, self.zeropp)
            _active += 1
        return self

    def __exit__(self, *exc):
        global _active
        if self.enabled:
            _active -= 1
            if _active == 0:
                _uninstall()
        return False


def contradicting_single_rank_group_error(dp_world_size: int, explicit_process_group, env=None) -> str | None:
    """What is wrong when zero.Init would partition over one rank while the launcher started several, else
    None (DeepSpeed's `_contradicting_single_rank_pg_error`).

    The launcher (`deepspeed`, `torchrun`, accelerate, ...) sets `WORLD_SIZE`. If a one-rank process group was
    created before zero.Init (a library calling `init_process_group` on its own, before
    `init_distributed()`), the default group has one rank and nothing would be partitioned. Only the default
    group is judged: an `explicit_process_group` of one rank is the caller's choice. A `WORLD_SIZE` that is
    not a number says nothing about the launcher, so it is no error either.
    """
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (
        f"zero.Init would partition parameters over a process group of 1 rank, but the launcher started "
        f"WORLD_SIZE={launched} processes: a one-rank process group was initialized before zero.Init (for "
        f"example by a library loading the model before deepspeed.init_distributed()), so every rank would build "
        f"the whole model. Call deepspeed.init_distributed() before building the model under zero.Init, or pass "
        f"data_parallel_group explicitly if one rank is intended"
    )


def _dtype_from_config(config) -> torch.dtype | None:
    """fp16/bf16 from the config's precision blocks. Only those are read: integrations (HF's model loading)
    hand over their config before every "auto" in it is filled, and the engine validates it all later."""
    if config is None:
        return None
    from shardspeed.config.loader import read_config_source

    if hasattr(config, "raw"):  # a loaded ShardspeedConfig
        config = config.raw
    raw = read_config_source(config)

    def enabled(*names: str) -> bool:
        def one(name: str):
            if f"{name}.enabled" in raw:  # a dotted top-level key wins over the nested one (config/dotted.py)
                return raw[f"{name}.enabled"]
            return raw[name].get("enabled") if isinstance(raw.get(name), dict) else None

        return any(one(n) is True for n in names)

    return torch.float16 if enabled("fp16") else torch.bfloat16 if enabled("bf16", "bfloat16") else None


def _init_owner(cls: type) -> type:
    return next(c for c in cls.__mro__ if "__init__" in c.__dict__)


def _wrap(cls: type, group, dtype, remote, zeropp=None) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _originals:
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if _active and _init_owner(type(self)) is cls:  # the most-derived __init__ has finished
            _partition_module(self, group, dtype, recurse=False, remote=remote, zeropp=zeropp)

    _originals[cls] = original
    cls.__init__ = __init__


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


def _install(group, dtype, remote, zeropp=None) -> None:
    global _remote
    _remote = remote
    for cls in [nn.Module, *_subclasses(nn.Module)]:
        _wrap(cls, group, dtype, remote, zeropp)

    def init_subclass(cls, **kwargs):
        _wrap(cls, group, dtype, remote, zeropp)

    _originals["__init_subclass__"] = nn.Module.__dict__.get("__init_subclass__")
    nn.Module.__init_subclass__ = classmethod(init_subclass)
    _originals["apply"] = nn.Module.apply
    nn.Module.apply = _gathering_apply


def _uninstall() -> None:
    global _remote
    _remote = None
    original_apply = _originals.pop("apply")
    nn.Module.apply = original_apply
    original_subclass = _originals.pop("__init_subclass__")
    if original_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = original_subclass
    for cls, original in list(_originals.items()):
        cls.__init__ = original
    _originals.clear()


def _gathering_apply(self: nn.Module, fn):
    """`nn.Module.apply` whose `fn` sees full parameters; changes are re-partitioned afterwards."""
    for child in self.children():
        child.apply(fn)
    partitioned = [p for p in self.parameters(recurse=False) if is_partitioned(p)]
    groups = [p._zero_init_group for p in partitioned]
    for p in partitioned:
        materialize(p)
    fn(self)
    for p, group in zip(partitioned, groups):
        _partition(p, group, None, _remote)
    return self
