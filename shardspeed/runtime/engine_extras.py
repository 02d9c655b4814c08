"""DeepSpeed's engine extras: `compile`, `offload_states`, `empty_partition_cache`, `collect_python_gc`,
`load_module_state_dict`, and attribute look-up on the wrapped module.

Mixed into `ShardspeedEngine`; each method hands its work to a part the engine holds (`self.compiler`,
`self.states`, the stage 3 coordinator, the process-wide Python GC switch).

`__getattr__` runs only for names the engine does not have (Python's rule). It then tries nn.Module's
registries (parameters, buffers, submodules), then the wrapped module, as DeepSpeed does. One case is kept
apart so that it cannot hide a bug: when one of the engine's own properties raises AttributeError inside
(Python then falls back to `__getattr__`), that property is run again so its real error surfaces, instead
of the module being asked for a name it happens to share.
"""

from __future__ import annotations

import gc

from shardspeed import accelerator
from shardspeed.runtime.compiler import default_backend
from shardspeed.runtime.python_gc import python_gc
from shardspeed.zero.api import GatheredParameters
from shardspeed.zero.offload_kinds import OffloadDeviceEnum

__all__ = ["EngineExtras"]


class EngineExtras:
    def compile(
        self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled=False
    ) -> None:
        """torch.compile the wrapped module in place (runtime/compiler.py); `backend` defaults to inductor."""
        self.compiler.compile(self.module, backend or default_backend(), compile_kwargs, schedule,
                              compiled_autograd_enabled)  # fmt: skip

    @property
    def is_compiled(self) -> bool:
        return self.compiler.is_compiled

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:  # fmt: skip
        """Move optimizer state, fp32 masters, parameters and gradient buffers (or the `include`d kinds,
        `OffloadStateTypeEnum`) to the host until `reload_states()` (zero/offload_states.py)."""
        self.states.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring everything `offload_states()` moved back to the device."""
        self.states.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        """ZeRO-3: release every gathered parameter unit nothing holds (persistent ones too, as DeepSpeed),
        then the allocator's cache."""
        coordinator = getattr(self.optimizer, "coordinator", None)
        if coordinator is not None:
            coordinator.release_all()
        gc.collect()
        accelerator.get_accelerator().empty_cache()

    def collect_python_gc(self) -> int:
        """One Python garbage collection now (with `disable_python_gc`, the only ones that run)."""
        return python_gc.collect()

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                               z3_params_to_fetch=None, allowed_missing_keys=None) -> None:  # fmt: skip
        """Load `checkpoint["module"]` (a model-states dict's weights) into the wrapped module, as DeepSpeed's
        engine does: `custom_load_fn(src=, dst=)` instead of `load_state_dict` when given; ZeRO-3 parameters
        gathered while loaded (`z3_params_to_fetch`, or all with `fetch_z3_params`) and re-partitioned from
        rank 0's values. `allowed_missing_keys` (AutoEP's expert weights, loaded from their own files) may be
        missing from a strict load, and nothing else: any other missing or unexpected key raises RuntimeError;
        `strict=False` keeps torch's non-strict load. `load_checkpoint` does not call this method (each part of
        the engine loads its own state, checkpoint/parts.py), so overriding it changes nothing there."""
        if checkpoint.get("frozen_param_fragments") is not None:
            raise NotImplementedError(
                "load_module_state_dict: frozen_param_fragments (DeepSpeed's ZeRO-3 frozen partitions) are not "
                "loaded here; load the checkpoint with load_checkpoint"
            )
        if z3_params_to_fetch is not None:
            fetch = list(z3_params_to_fetch)
        else:
            fetch = list(self.module.parameters()) if fetch_z3_params else []
        with GatheredParameters(fetch, modifier_rank=0):
            state = checkpoint["module"]
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
                return
            result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
        if strict and allowed_missing_keys is not None:
            missing = sorted(set(result.missing_keys) - set(allowed_missing_keys))
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    "Checkpoint module state did not match the model outside AutoEP expert parameters: "
                    f"missing={missing}, unexpected={sorted(result.unexpected_keys)}"
                )

    def __getattr__(self, name: str):
        """As DeepSpeed: what the engine does not have is looked up on the wrapped module."""
        try:
            return super().__getattr__(name)  # nn.Module's own registries (parameters, buffers, submodules)
        except AttributeError:
            pass
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):  # the engine's own property raised AttributeError: surface that error
            return prop.fget(self)
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object (and its module) has no attribute '{name}'")
