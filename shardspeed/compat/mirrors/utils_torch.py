"""DeepSpeed's `deepspeed.utils.torch`: torch version checks and small torch helpers.

Named as DeepSpeed's module; inside the package, `import torch` still means PyTorch (absolute imports).
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "instrument_w_nvtx",
    "is_functorch_transforming",
    "jit_script_compat",
    "register_grad_hook",
    "required_torch_version",
]


def _version_tuple(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the installed torch is within [min_version, max_version] (numbers like 2.1, or "2.1.0").

    Versions compare as DeepSpeed compares them: 2.1 means 2.1.0, so torch 2.1.2 is above max_version 2.1.
    """
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    installed = _version_tuple(torch.__version__)

    def padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        width = max(len(a), len(b))
        return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))

    if min_version is not None:
        have, wanted = padded(installed, _version_tuple(str(min_version)))
        if have < wanted:
            return False
    if max_version is not None:
        have, wanted = padded(installed, _version_tuple(str(max_version)))
        if have > wanted:
            return False
    return True


def register_grad_hook(param: torch.Tensor, hook):
    """Run `hook(param)` once `param`'s gradient has been accumulated; returns the removable handle."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn):
    """torch.jit.script where it works, else the function unchanged (as DeepSpeed's helper)."""
    try:
        return torch.jit.script(fn)
    except Exception:  # scripting is an optimisation only; any failure keeps eager mode
        return fn


def is_functorch_transforming() -> bool:
    """Whether a torch.func transform (vmap, grad, ...) is running around this call."""
    try:
        from torch._C._functorch import peek_interpreter_stack
    except ImportError:
        return False
    return peek_interpreter_stack() is not None


def instrument_w_nvtx(func):
    """Decorator: an NVTX range named after `func` around each call on CUDA (seen in Nsight); on CPU `func`."""
    if not torch.cuda.is_available():
        return func

    def wrapped(*args, **kwargs):
        torch.cuda.nvtx.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    return functools.wraps(func)(wrapped)
