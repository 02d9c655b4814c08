"""FairScale's `FullyShardedDataParallel`: parameters, gradients and optimizer state sharded (ZeRO stage 3).

    model = FullyShardedDataParallel(model)              # or nested: auto_wrap / enable_wrap + wrap
    optimizer = torch.optim.Adam(model.parameters())     # any optimizer: it steps this rank's shards

Each instance owns the parameters of its module that no nested instance owns, as one flat parameter
(`_fsdp_wrapped_module.flat_param_0`, `flatten_parameters=True`) or each one sharded on its own
(fsdp_shard.py). Before its forward it gathers them (and points the module's attributes at views of the
flat parameter), after it releases them (`reshard_after_forward`; the outermost instance keeps them for its
backward unless `disable_reshard_on_root=False`), gathers them again when the gradient of its output
arrives, and once autograd has accumulated each parameter's full gradient reduce-scatters it, so every rank
ends backward holding the averaged gradient of its shard. It runs on CPU (Gloo) as on CUDA.

`state_dict()` is the unwrapped model's (full fp32 values, the unwrapped model's names), `local_state_dict()`
this rank's shards; `summon_full_params()` shows the full parameters under the unwrapped model's names, and
writes changes back. Arguments that would change what training computes and are not built are refused by
name (docs/compatibility.md, "FairScale").
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from shardspeed.comm.collectives import all_reduce
from shardspeed.fairscale.fsdp_shard import ShardedParam, ShardState, rank_and_size
from shardspeed.fairscale.fsdp_views import FlatHolder, clean_name, owned_registrations

__all__ = ["FullyShardedDataParallel", "TrainingState", "get_fsdp_instances"]


class TrainingState(enum.Enum):
    """FairScale's names for where an FSDP instance is in its step (`instance.training_state`)."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()
    SUMMON_FULL_PARAMS = enum.auto()


def get_fsdp_instances(module: nn.Module, skip_empty: bool = False) -> list:
    """Every FullyShardedDataParallel in `module` (itself included), outermost first; `skip_empty` leaves
    out those that shard no parameter."""
    found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    return [m for m in found if m._shards] if skip_empty else found


# FairScale arguments accepted only at the value that means "as shardspeed does it"
_FIXED = {
    "process_group_reduce_scatter": ("reduce_scatter", "the gradient reduction uses `process_group`"),
    "no_broadcast_optim_state": (False, "optimizer-state consolidation helpers are not built"),
    "state_dict_device": (None, "state_dict() returns tensors on the shards' device"),
    "state_dict_on_rank_0_only": (False, "every rank returns the full state dict"),
    "allow_reset_parameters": (False, "reset_parameters() is not built"),
    "move_grads_to_cpu": (None, "gradients live where the parameter shards live (see move_params_to_cpu)"),
}


class FullyShardedDataParallel(nn.Module):
    """FairScale's `FullyShardedDataParallel(module, process_group=None, reshard_after_forward=True,
    disable_reshard_on_root=True, mixed_precision=False, fp32_reduce_scatter=False, flatten_parameters=True,
    move_params_to_cpu=False, compute_dtype=None, buffer_dtype=None, bucket_cap_mb=25, compute_device=None,
    clear_autocast_cache=False, force_input_to_fp32=False, verbose=False, cpu_offload=False,
    gradient_predivide_factor=None, ...)`.

    `bucket_cap_mb` sizes FairScale's buffer that batches small reduce-scatters; here each instance reduces its
    gradients in one reduce-scatter as soon as its backward ends, which is what 0 (no batching) means and what
    the default does for any instance under 25 MB. Other values would be ignored, so they are refused.
    """

    def __init__(self, module: nn.Module, process_group=None, reshard_after_forward: bool = True,
                 disable_reshard_on_root: bool = True, mixed_precision: bool = False,
                 fp32_reduce_scatter: bool = False, flatten_parameters: bool = True,
                 move_params_to_cpu: bool = False, compute_dtype: torch.dtype | None = None,
                 buffer_dtype: torch.dtype | None = None, bucket_cap_mb: int = 25,
                 compute_device: torch.device | None = None, clear_autocast_cache: bool = False,
                 force_input_to_fp32: bool = False, verbose: bool = False, cpu_offload: bool = False,
                 gradient_predivide_factor: float | None = None, **fixed):  # fmt: skip
        super().__init__()
        for name, value in fixed.items():
            if name not in _FIXED:
                raise TypeError(f"FullyShardedDataParallel() got an unexpected keyword argument {name!r}")
            expected, why = _FIXED[name]
            if value != expected and not (name == "process_group_reduce_scatter" and value is None):
                raise ValueError(f"FullyShardedDataParallel({name}={value!r}) is not offered: {why}")
        if bucket_cap_mb not in (0, 25):
            raise ValueError(
                f"FullyShardedDataParallel(bucket_cap_mb={bucket_cap_mb!r}) is not offered: each wrapped module "
                "reduces its gradients in one reduce-scatter when its backward ends (0 or the default 25 only)"
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.rank, self.world_size = rank_and_size(self.process_group)
        self.reshard_after_forward = reshard_after_forward
        self.disable_reshard_on_root = disable_reshard_on_root
        self.mixed_precision = mixed_precision
        self.flatten_parameters = flatten_parameters
        self.move_params_to_cpu = move_params_to_cpu or cpu_offload
        self.compute_dtype = compute_dtype or (torch.float16 if mixed_precision else torch.float32)
        self.buffer_dtype = buffer_dtype or self.compute_dtype
        self.fp32_reduce_scatter = fp32_reduce_scatter
        self.bucket_cap_mb = bucket_cap_mb
        self.clear_autocast_cache = clear_autocast_cache
        self.force_input_to_fp32 = force_input_to_fp32
        self.verbose = verbose
        self.gradient_predivide_factor = gradient_predivide_factor or _default_predivide(self.world_size)
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self.compute_device = torch.device(compute_device) if compute_device is not None else device
        if self.move_params_to_cpu and self.compute_device.type == "cpu" and torch.cuda.is_available():
            self.compute_device = torch.device("cuda", torch.cuda.current_device())
        self._fsdp_wrapped_module = FlatHolder(module)
        self._is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self._require_sync = True
        self._in_summon = False
        self._local_state = False
        self._shards: list[ShardedParam] = []
        self._build_shards()
        for buffer in module.buffers():  # buffers are not sharded: they live where the compute runs
            dtype = self.buffer_dtype if mixed_precision and buffer.is_floating_point() else buffer.dtype
            buffer.data = buffer.data.to(self.compute_device, dtype)

    # -- construction --------------------------------------------------------------------------------------

    def _build_shards(self) -> None:
        registrations = owned_registrations(self.module_root, FullyShardedDataParallel)
        unique = list(OrderedDict((id(p), p) for _, _, p in registrations).values())
        if any(p.dtype != torch.float32 for p in unique):
            raise ValueError(
                "FullyShardedDataParallel: parameters must be fp32 (mixed_precision keeps fp32 shards and "
                "computes in compute_dtype)"
            )
        if self.flatten_parameters and unique:
            flat = self._fsdp_wrapped_module.flatten(registrations, unique)
            leaves = [flat]
        else:
            leaves = unique
            self._fsdp_wrapped_module.leaves = unique
        host = torch.device("cpu") if self.move_params_to_cpu else self.compute_device
        reduce_dtype = torch.float32 if self.fp32_reduce_scatter else self.compute_dtype
        for leaf in leaves:
            shard = ShardedParam(leaf, self.process_group, compute_dtype=self.compute_dtype,
                                 compute_device=self.compute_device, host_device=host, reduce_dtype=reduce_dtype,
                                 predivide=self.gradient_predivide_factor)  # fmt: skip
            leaf.register_post_accumulate_grad_hook(self._make_post_backward(shard))
            self._shards.append(shard)

    @property
    def module_root(self) -> nn.Module:
        """The user's module (FairScale: `module.module`)."""
        return self._fsdp_wrapped_module._fpw_module

    @property
    def module(self) -> FlatHolder:
        return self._fsdp_wrapped_module

    def _instances(self) -> list[FullyShardedDataParallel]:
        return [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]

    # -- forward and backward ------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._is_root is None:
            self._is_root = True
            for inner in self._instances()[1:]:
                inner._is_root = False
        if self._is_root and self.mixed_precision and not self.force_input_to_fp32:
            args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        elif self._is_root and self.force_input_to_fp32:
            args, kwargs = _cast_floats((args, kwargs), torch.float32)
        self.training_state = TrainingState.FORWARD
        for shard in self._shards:
            shard.gather()
        self._fsdp_wrapped_module.point_at_views()
        outputs = self.module_root(*args, **kwargs)
        self.training_state = TrainingState.IDLE
        keep = self._is_root and self.disable_reshard_on_root
        if self.reshard_after_forward and not keep:
            for shard in self._shards:
                shard.reshard()
        if self.clear_autocast_cache:
            torch.clear_autocast_cache()
        if torch.is_grad_enabled():
            outputs = self._hook_outputs(outputs)
        return outputs

    def _hook_outputs(self, outputs):
        state = {"fired": False}

        def pre_backward(grad):
            if not state["fired"]:
                state["fired"] = True
                if self._is_root:
                    torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                for shard in self._shards:
                    shard.gather()
                    shard.stash_gradient()
            return grad

        for tensor in _tensors(outputs):
            if tensor.requires_grad:
                tensor.register_hook(pre_backward)
        return outputs

    def _make_post_backward(self, shard: ShardedParam):
        def post_backward(param) -> None:
            shard.reduce_gradient(sync=self._require_sync)

        return post_backward

    def _end_of_backward(self) -> None:
        """Whatever no gradient reached (an unused branch) goes back to its shard."""
        for instance in self._instances():
            for shard in instance._shards:
                shard.reshard()
                shard._restore_saved_gradient()

    # -- FairScale's API -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no reduction) until a backward outside the context."""
        instances = self._instances()
        old = [i._require_sync for i in instances]
        for instance in instances:
            instance._require_sync = False
        try:
            yield
        finally:
            for instance, value in zip(instances, old):
                instance._require_sync = value

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0) -> torch.Tensor:
        """Clip every shard gradient of this instance and the nested ones to a global norm (collective)."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        grads = [s.param.grad for i in self._instances() for s in i._shards if s.param.grad is not None]
        local = torch.zeros((), dtype=torch.float32)
        for grad in grads:
            if norm_type == math.inf:
                local = torch.maximum(local, grad.detach().abs().max().float().cpu())
            else:
                local += grad.detach().float().abs().pow(norm_type).sum().cpu()
        if norm_type == math.inf:
            if self.world_size > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group)
            total = local
        else:
            if self.world_size > 1:
                all_reduce(local, group=self.process_group)
            total = local ** (1.0 / norm_type)
        coefficient = max_norm / (total + 1e-6)
        if coefficient < 1:
            for grad in grads:
                grad.mul_(coefficient.to(grad.device))
        return total

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False):
        """The full fp32 parameters under the unwrapped model's names (collective). Changes made inside are
        written back to the shards on exit unless `volatile`."""
        instances = self._instances() if recurse else [self]
        fresh = [i for i in instances if not i._in_summon]
        for instance in fresh:
            instance._in_summon = True
            instance.training_state = TrainingState.SUMMON_FULL_PARAMS
            for shard in instance._shards:
                shard.reshard()
            instance._fsdp_wrapped_module.show_originals([s.full_fp32() for s in instance._shards],
                                                         instance.flatten_parameters)  # fmt: skip
        try:
            yield
        finally:
            for instance in fresh:
                values = instance._fsdp_wrapped_module.hide_originals(instance.flatten_parameters)
                if not volatile:
                    for shard, value in zip(instance._shards, values):
                        shard.write_full(value)
                for shard in instance._shards:
                    shard.param.data = shard.shard
                    shard.state = ShardState.SHARDED
                instance._in_summon = False
                instance.training_state = TrainingState.IDLE

    def named_parameters(self, *args, **kwargs):
        for name, param in super().named_parameters(*args, **kwargs):
            yield (clean_name(name) if self._in_summon else name), param

    def state_dict(self, *args, **kwargs):
        """The unwrapped model's state dict: full fp32 parameters and buffers (collective)."""
        if self._local_state or self._in_summon:
            return super().state_dict(*args, **kwargs)
        with self.summon_full_params(volatile=True):
            state = super().state_dict(*args, **kwargs)
            return OrderedDict((clean_name(k), v.detach().clone().float() if v.is_floating_point() else v.clone())
                               for k, v in state.items())  # fmt: skip

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a state dict of `state_dict()` (the unwrapped model's names) into the shards (collective)."""
        with self.summon_full_params():
            own = {clean_name(k): v for k, v in super().state_dict(keep_vars=True).items()}
            missing = sorted(set(own) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(own))
            if strict and (missing or unexpected):
                raise RuntimeError(f"FullyShardedDataParallel.load_state_dict: missing keys {missing}, "
                                   f"unexpected keys {unexpected}")  # fmt: skip
            with torch.no_grad():
                for name, value in state_dict.items():
                    if name in own:
                        own[name].copy_(value)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def local_state_dict(self, *args, **kwargs):
        """This rank's shards (`..._fsdp_wrapped_module.flat_param_0`) and the buffers."""
        with self._local_mode():
            return super().state_dict(*args, **kwargs)

    def load_local_state_dict(self, state_dict, strict: bool = True):
        """Load what `local_state_dict()` returned on this rank."""
        with self._local_mode():
            return super().load_state_dict(state_dict, strict)

    @contextlib.contextmanager
    def _local_mode(self):
        instances = self._instances()
        for instance in instances:
            instance._local_state = True
        try:
            yield
        finally:
            for instance in instances:
                instance._local_state = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_fsdp_wrapped_module":
                raise
            return getattr(self.module_root, name)

    def __getitem__(self, key):
        return self.module_root[key]

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, flatten_parameters={self.flatten_parameters}, "
                f"mixed_precision={self.mixed_precision}, compute_dtype={self.compute_dtype}")  # fmt: skip


def _default_predivide(world: int) -> float:
    """FairScale's split of the average into a division before the reduction and one after (fp16 range)."""
    factor = 1
    while world % factor == 0 and world / factor > factor:
        factor *= 2
    return float(factor)


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _cast_floats(value, dtype):
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value
