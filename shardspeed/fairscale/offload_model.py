"""FairScale's `OffloadModel`: a sequential model kept on the host, run slice by slice on the device.

    model = OffloadModel(model=nn.Sequential(...), device=torch.device("cuda"),
                         offload_device=torch.device("cpu"), num_slices=3, checkpoint_activation=True,
                         num_microbatches=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)    # steps the host parameters

The layers are split into `num_slices` consecutive slices of about equal parameter count. Parameters (and
their gradients) live on `offload_device`; a slice's parameters are moved to `device` just before it runs,
forward or backward, and back right after, so at most one slice's parameters are on the device at a time
(activations kept for backward aside). With `checkpoint_activation` only each slice's input is kept, on the
host, and the slice is recomputed in backward (torch.utils.checkpoint, non-reentrant); `num_microbatches`
splits the batch along its first dimension and runs the slices once per part. Parameters stay fp32 and a
surrounding `torch.autocast` applies as usual. FairScale requires CUDA here; shardspeed also runs it with
`device` the CPU (then nothing moves), and allows microbatches without checkpointing.

[Note: moving a parameter] A slice's parameters move by assigning `param.data`, which keeps the parameter
object (what the optimizer and autograd's saved tensors refer to) and its version counter. Before a slice's
backward the hook on its output brings them back to the device and sets any host gradient aside (autograd
cannot add a device gradient to it); each parameter's post-accumulate hook then moves it and its gradient
home, adding the set-aside gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["OffloadModel"]


def split_by_parameters(layers: list[nn.Module], num_slices: int) -> list[list[nn.Module]]:
    """Consecutive groups of `layers` with about equal parameter counts (at most `num_slices`, none empty)."""
    num_slices = max(1, min(num_slices, len(layers)))
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    target = sum(sizes) / num_slices
    slices, current, size = [], [], 0
    for index, (layer, numel) in enumerate(zip(layers, sizes)):
        current.append(layer)
        size += numel
        left_layers, left_slices = len(layers) - index - 1, num_slices - len(slices) - 1
        if left_slices > 0 and (size >= target or left_layers == left_slices):
            slices.append(current)
            current, size = [], 0
    if current:
        slices.append(current)
    return slices


class OffloadModel(nn.Module):
    """FairScale's `fairscale.experimental.nn.offload.OffloadModel` (see the module docstring)."""

    def __init__(self, model, device, offload_device="cpu", num_slices: int = 3,
                 checkpoint_activation: bool = False, num_microbatches: int = 1):  # fmt: skip
        super().__init__()
        if model is None:
            raise TypeError("`model` argument to `OffloadModel` cannot be None.")
        if device is None:
            raise TypeError("`device` argument to `OffloadModel` cannot be None.")
        if isinstance(model, list):
            slices = [m if isinstance(m, nn.Sequential) else nn.Sequential(m) for m in model]
        elif isinstance(model, nn.Sequential):
            slices = [nn.Sequential(*group) for group in split_by_parameters(list(model), num_slices)]
        else:
            raise TypeError("`model` argument to `OffloadModel` must be of type `nn.Sequential`.")
        if num_microbatches < 1:
            raise ValueError(f"OffloadModel(num_microbatches={num_microbatches}): must be at least 1")
        self.device, self.offload_device = torch.device(device), torch.device(offload_device)
        self.model_slices = nn.ModuleList(slices)
        self._checkpoint_activation = checkpoint_activation
        self._num_microbatches = num_microbatches
        self._in_backward = False
        for piece in self.model_slices:
            piece.to(self.offload_device)
            for param in piece.parameters():
                param.register_post_accumulate_grad_hook(self._send_home)

    # -- moving parameters ---------------------------------------------------------------------------------

    def _bring(self, piece: nn.Module) -> None:
        for param in piece.parameters():
            param.data = param.data.to(self.device, non_blocking=True)

    def _send_away(self, piece: nn.Module) -> None:
        for param in piece.parameters():
            param.data = param.data.to(self.offload_device)

    def _send_home(self, param: nn.Parameter) -> None:
        grad = param.grad.to(self.offload_device)
        aside = getattr(param, "_offload_grad_aside", None)
        if aside is not None:
            grad = grad + aside
            del param._offload_grad_aside
        param.data = param.data.to(self.offload_device)
        param.grad = grad

    def _before_backward(self, piece: nn.Module):
        def hook(grad):
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._bring(piece)
            for param in piece.parameters():
                if param.grad is not None and param.grad.device != self.device:
                    param._offload_grad_aside = param.grad  # host gradient of an earlier backward
                    param.grad = None
            return grad

        return hook

    def _after_backward(self) -> None:
        """Slices no gradient reached go home too."""
        self._in_backward = False
        for piece in self.model_slices:
            self._send_away(piece)

    # -- forward -------------------------------------------------------------------------------------------

    def _run_slice(self, index: int, inputs):
        piece = self.model_slices[index]
        inputs = tuple(t.to(self.device) if torch.is_tensor(t) else t for t in inputs)
        self._bring(piece)
        output = piece(*inputs)
        if not self._in_backward:  # a recomputation in backward keeps the parameters for the gradients
            self._send_away(piece)
        if (
            torch.is_grad_enabled()
            and torch.is_tensor(output)
            and output.requires_grad
            and not self._in_backward
        ):
            output.register_hook(self._before_backward(piece))
        return output

    def _run_all(self, inputs):
        for index in range(len(self.model_slices)):
            if self._checkpoint_activation and torch.is_grad_enabled():
                host = tuple(t.to(self.offload_device) if torch.is_tensor(t) else t for t in inputs)
                output = checkpoint(lambda *x, i=index: self._run_slice(i, x), *host, use_reentrant=False)
            else:
                output = self._run_slice(index, inputs)
            inputs = (output,)
        return inputs[0]

    def forward(self, *inputs, **kwargs):
        if kwargs:
            raise TypeError(f"OffloadModel.forward takes positional inputs only (got {sorted(kwargs)})")
        if self._num_microbatches == 1:
            return self._run_all(inputs)
        parts = [torch.chunk(t, self._num_microbatches) if torch.is_tensor(t) else None for t in inputs]
        count = min(len(p) for p in parts if p is not None)
        outputs = []
        for m in range(count):
            micro = tuple(p[m] if p is not None else t for p, t in zip(parts, inputs))
            outputs.append(self._run_all(micro))
        return torch.cat(outputs)
