"""DeepSpeed's engine extras: `compile`, `offload_states`, `empty_partition_cache`, `collect_python_gc`, and
attribute look-up on the wrapped module.

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
