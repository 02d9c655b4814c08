"""`engine.compile()`: torch.compile of the wrapped module, with DeepSpeed's signature.

`compile(backend=..., compile_kwargs={}, schedule=None, compiled_autograd_enabled=False)` compiles the
module in place (`nn.Module.compile`: its forward, hooks included, goes through torch.compile with
`compile_kwargs` and `backend`); `engine.is_compiled` says whether it was. The engine's own work (gradient
reduction in backward hooks, ZeRO-3 gathers) stays outside the compiled graphs. `schedule` and the
`compile` config block belong to DeepCompile, which shardspeed does not implement: a schedule is refused.
`compiled_autograd_enabled=True` runs backward under torch's compiled autograd.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shardspeed.utils.logging import log_dist

__all__ = ["ModuleCompiler", "default_backend"]


def default_backend() -> str:
    """torch.compile's default backend (DeepSpeed asks its accelerator, which answers "inductor")."""
    return "inductor"


class ModuleCompiler:
    """The engine's compile part: whether and how the module was compiled."""

    def __init__(self):
        self.is_compiled = False
        self.compile_kwargs: dict = {}
        self.compiled_autograd = False

    def compile(self, module: nn.Module, backend, compile_kwargs: dict | None, schedule,
                compiled_autograd_enabled: bool) -> None:  # fmt: skip
        if schedule is not None:
            raise ValueError(
                "engine.compile(schedule=...): schedules are DeepCompile's (not implemented); call compile() "
                "without one for torch.compile of the module"
            )
        if self.is_compiled:
            return  # as DeepSpeed: compiling twice keeps the first compilation
        compile_kwargs = dict(compile_kwargs or {})
        if "backend" in compile_kwargs:
            log_dist("engine.compile: 'backend' in compile_kwargs is overridden by the backend argument", ranks=[0],
                     level=30)  # fmt: skip
        compile_kwargs["backend"] = backend
        module.compile(**compile_kwargs)
        self.is_compiled, self.compile_kwargs = True, compile_kwargs
        self.compiled_autograd = compiled_autograd_enabled

    def backward_context(self):
        """Around `loss.backward()`: torch's compiled autograd when it was asked for."""
        if not self.compiled_autograd:
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        backend = self.compile_kwargs["backend"]
        return compiled_autograd._enable(torch.compile(backend=backend))
