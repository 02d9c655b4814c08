"""The flops profiler: FLOPs, MACs, parameters and latency per module of a model's forward pass.

FLOPs are counted by torch's `FlopCounterMode` (a dispatch mode that sees every aten op, so matmuls,
convolutions, `scaled_dot_product_attention` and fused kernels are counted from their real shapes whatever
Python code issued them); it attributes each op's FLOPs to every module on the call stack, giving inclusive
per-module counts. MACs are FLOPs / 2 (every counted op is a multiply-accumulate kernel). Elementwise ops
(activations, norms, softmax) are not counted; DeepSpeed estimates those too, they are well under 1% of a
transformer's FLOPs. Latency comes from forward pre/post hooks on every module (the device synchronised at
each, so numbers are real on GPUs and the profiled step runs slower). Hooks exist only between
`start_profile` and `end_profile`.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from shardspeed import accelerator
from shardspeed.core.partitioned import logical_numel
from shardspeed.profiling.flops_profiler.report import format_profile, number_to_string

__all__ = ["FlopsProfiler", "get_model_profile"]


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's table lacks the CPU flash-attention kernels `scaled_dot_product_attention` runs on the CPU; count
# them with the formulas torch uses for the GPU kernels (causal masking not discounted, as torch does).
_EXTRA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def _counter_keys(model: nn.Module) -> dict[nn.Module, str]:
    """The names FlopCounterMode gives modules: the root's class name, then `parent.child` attributes."""
    keys = {model: type(model).__name__}
    stack = [model]
    while stack:
        parent = stack.pop()
        for name, child in parent.named_children():
            if child not in keys:
                keys[child] = f"{keys[parent]}.{name}"
                stack.append(child)
    return keys


class FlopsProfiler:
    """Profile `model`'s forward passes between `start_profile()` and `stop_profile()`."""

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model, self.ds_engine = model, ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: FlopCounterMode | None = None
        self._hooks: list = []
        self._latency: dict[nn.Module, float] = {}
        self._calls: dict[nn.Module, int] = {}
        self._flops: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start_profile(self, ignore_list=None) -> None:
        """Install the latency hooks and start counting (FLOPs of everything that runs until `stop_profile`)."""
        self.reset_profile()
        ignore = tuple(ignore_list or ())
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        started: dict[nn.Module, list[float]] = {}

        def pre(module, _args):
            accelerator.synchronize(device)
            started.setdefault(module, []).append(time.perf_counter())

        def post(module, _args, _out):
            accelerator.synchronize(device)
            self._latency[module] = (
                self._latency.get(module, 0.0) + time.perf_counter() - started[module].pop()
            )
            self._calls[module] = self._calls.get(module, 0) + 1

        for module in self.model.modules():
            if not isinstance(module, ignore):
                self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay readable until `end_profile`."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._flops = {key: sum(ops.values()) for key, ops in self._counter.get_flop_counts().items()}
            self._counter = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def reset_profile(self) -> None:
        self._latency, self._calls, self._flops = {}, {}, {}

    def end_profile(self) -> None:
        """Stop and forget everything (DeepSpeed removes its module attributes here)."""
        self.stop_profile()
        self.reset_profile()
        self.started = False

    # -- numbers --------------------------------------------------------------------------------------------

    def _module_flops(self, module: nn.Module) -> int:
        if self._counter is not None:  # still running: read the live counts
            counts = self._counter.get_flop_counts()
            key = _counter_keys(self.model)[module]
            return int(sum(counts.get(key, {}).values()))
        return int(self._flops.get(_counter_keys(self.model)[module], 0))

    def module_profile(self, module: nn.Module) -> dict[str, float]:
        """params, flops, macs and latency (s) of one module, its children included."""
        flops = self._module_flops(module)
        return {
            "params": sum(logical_numel(p) for p in module.parameters()),
            "flops": flops,
            "macs": flops // 2,
            "latency": self._latency.get(module, 0.0),
        }

    def get_total_flops(self, as_string: bool = False):
        flops = self._module_flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self._module_flops(self.model) // 2
        return number_to_string(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False):
        params = sum(logical_numel(p) for p in self.model.parameters())
        return number_to_string(params, "") if as_string else params

    def get_total_duration(self, as_string: bool = False):
        seconds = self._latency.get(self.model, 0.0)
        return f"{1000 * seconds:.2f} ms" if as_string else seconds

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:  # fmt: skip
        """Print (or write to `output_file`) the summary, the top modules per depth and the module tree."""
        text = format_profile(self, profile_step, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text)
        return text


def get_model_profile(model: nn.Module, input_shape=None, args=None, kwargs=None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file: str | None = None, ignore_modules=None,
                      mode: str = "forward"):  # fmt: skip
    """Profile one forward pass of `model` on `args`/`kwargs` (or a tensor of `input_shape`) after `warm_up`
    unprofiled passes. Returns `(flops, macs, params)`, as strings unless `as_string=False`."""
    if mode != "forward":
        raise ValueError(f"get_model_profile(mode={mode!r}): only 'forward' is supported")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("get_model_profile: give input_shape or args/kwargs, not both")
        first = next(model.parameters())
        args = [torch.randn(*input_shape, dtype=first.dtype, device=first.device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, args or kwargs to run the model")
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        profiler = FlopsProfiler(model)
        profiler.start_profile(ignore_list=ignore_modules)
        model(*args, **kwargs)
        profiler.stop_profile()
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(module_depth=module_depth, top_modules=top_modules, detailed=detailed,
                                     output_file=output_file)  # fmt: skip
    profiler.end_profile()
    if as_string:
        return number_to_string(flops), number_to_string(macs, "MACs"), number_to_string(params, "")
    return flops, macs, params
