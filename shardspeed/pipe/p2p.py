"""Point-to-point exchange between neighbouring stages: tensors or tuples of tensors, any dtype.

Each link between two stages carries activations one way and their gradients the other. What travels is
described once per batch (the first micro-batch): the sender sends a small int64 header — tuple or single
tensor, and per tensor its dtype, `requires_grad` and shape — and both sides cache it; every later
micro-batch sends only the data. Gradients need no header: the receiving side knows the shapes of the
activations it sent.

Tensors travel as their raw bytes (a uint8 view), so every dtype works on every backend (Gloo has no bool or
bfloat16 point-to-point of its own). Sends are non-blocking (`isend`): the link keeps each tensor until
`flush()` sees its send complete, so a stage never stalls on its neighbour's progress. Every message of a
link carries the link's tag (the index of the part boundary it crosses), so with interleaved virtual stages
the several boundaries between the same two ranks are separate FIFO channels (Gloo matches by tag).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Link", "TensorMeta"]

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class Link:
    """The connection from this rank to one neighbour (global rank `peer`)."""

    def __init__(self, peer: int, device: torch.device, tag: int = 0):
        self.peer = peer
        self.device = device
        self.tag = tag
        self.sent_meta: list[TensorMeta] | None = None
        self.recv_meta: tuple[bool, list[TensorMeta]] | None = None
        self.pending: list = []  # (work, tensor) of sends in flight; the tensor must outlive its send

    def _isend(self, tensor: torch.Tensor) -> None:
        self.pending.append((dist.isend(tensor, dst=self.peer, tag=self.tag), tensor))

    def flush(self) -> None:
        """Wait for every send in flight on this link."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def reset(self) -> None:
        """Forget the shapes: the next batch negotiates them again (both sides call this together)."""
        self.sent_meta = None
        self.recv_meta = None

    # -- activations ----------------------------------------------------------------------------------------

    def send_activations(self, outputs) -> None:
        """Send `outputs` (tensor or tuple of tensors) without waiting."""
        is_tuple = isinstance(outputs, tuple | list)
        tensors = list(outputs) if is_tuple else [outputs]
        for i, t in enumerate(tensors):
            if not torch.is_tensor(t):
                raise TypeError(
                    f"a pipeline stage's output {i} is a {type(t).__name__}; stages exchange only tensors "
                    "or tuples of tensors"
                )
        metas = [
            TensorMeta(tuple(t.shape), t.dtype, t.requires_grad and t.is_floating_point()) for t in tensors
        ]
        if self.sent_meta is None:
            self._send_header(is_tuple, metas)
            self.sent_meta = metas
        elif metas != self.sent_meta:
            raise RuntimeError(
                f"a pipeline stage's outputs changed shape between micro-batches: {self.sent_meta} -> {metas}; "
                "all micro-batches of a batch must have the same shapes"
            )
        for t in tensors:
            self._isend(_as_bytes(t))

    def recv_activations(self):
        """Receive what the previous stage sent; tensors that carry gradients come back with requires_grad."""
        if self.recv_meta is None:
            self.recv_meta = self._recv_header()
        is_tuple, metas = self.recv_meta
        tensors = self._recv(metas)
        for t, meta in zip(tensors, metas):
            t.requires_grad_(meta.requires_grad)
        return tuple(tensors) if is_tuple else tensors[0]

    # -- gradients ------------------------------------------------------------------------------------------

    def send_grads(self, inputs) -> None:
        """Send the gradients of the activations received from this peer (zeros where none arrived)."""
        tensors = list(inputs) if isinstance(inputs, tuple | list) else [inputs]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors if t.requires_grad]
        for g in grads:
            self._isend(_as_bytes(g))

    def recv_grads(self) -> list[torch.Tensor]:
        """Gradients for the activations sent to this peer that carry gradients, in order."""
        return self._recv([m for m in self.sent_meta if m.requires_grad])

    # -- helpers --------------------------------------------------------------------------------------------

    def _recv(self, metas: list[TensorMeta]) -> list[torch.Tensor]:
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        for t in tensors:
            dist.recv(t.reshape(-1).view(torch.uint8), src=self.peer, tag=self.tag)
        return tensors

    def _send_header(self, is_tuple: bool, metas: list[TensorMeta]) -> None:
        header = [int(is_tuple), len(metas)]
        for m in metas:
            header += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        payload = torch.tensor(header, dtype=torch.int64, device=self.device)
        length = torch.tensor([len(header)], dtype=torch.int64, device=self.device)
        self._isend(length)
        self._isend(payload)

    def _recv_header(self) -> tuple[bool, list[TensorMeta]]:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(length, src=self.peer, tag=self.tag)
        payload = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        dist.recv(payload, src=self.peer, tag=self.tag)
        values = payload.tolist()
        is_tuple, count, pos, metas = bool(values[0]), values[1], 2, []
        for _ in range(count):
            dtype, requires_grad, ndim = values[pos : pos + 3]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            metas.append(TensorMeta(shape, _DTYPES[dtype], bool(requires_grad)))
            pos += 3 + ndim
        return is_tuple, metas
