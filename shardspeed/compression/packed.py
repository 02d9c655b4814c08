"""Packed weights: a cleaned quantized layer whose memory is its integer codes, bit-packed, plus group scales.

Layout of one ``PackedWeight`` (the weight seen as a matrix: ``rows = shape[0]``, ``cols`` = the rest):

* ``qweight``: 8-bit symmetric codes as ``int8``; otherwise unsigned codes packed into ``uint8`` bytes,
  ``8 // storage_bits`` per byte along each row (the lowest bits first), rows padded to whole bytes.
  ``storage_bits`` is the code width rounded up to 1, 2, 4 or 8 (3 -> 4, 5-7 -> 8);
* ``scales`` (and ``offsets`` for asymmetric codes): fp32, ``[rows, blocks]`` — each row is ``blocks``
  equal runs of columns sharing one scale (the quantization groups, after any pruning);
* the value of code ``c`` is ``c * scale + offset``: signed codes for symmetric and ternary weights,
  ``c - 2^(b-1)`` stored; binary ``{-1, 1}`` stored as one bit. A binary weight with pruned zeros is
  stored as ternary (two bits).

Values are computed in fp32 and cast to the layer's dtype, exactly as the compressed layer did, so the
packed layer computes what the cleaned one does. ``PackedLinear`` dequantizes its weight on the fly for
each call (nothing stays unpacked between calls); ``PackedEmbedding`` unpacks only the rows it looks up.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .cleaning import CodeTensors
from .compressible import Compressible

__all__ = ["PackedConv2d", "PackedEmbedding", "PackedLinear", "PackedWeight", "pack_compressed"]

logger = logging.getLogger(__name__)


def storage_bits(bits: int) -> int:
    return next(width for width in (1, 2, 4, 8) if width >= bits)


def _blocks(*stats: torch.Tensor) -> int | None:
    """The fewest equal column runs per row over which every ``stats`` matrix is constant, or None."""
    rows, cols = stats[0].shape
    for blocks in range(1, cols + 1):
        if cols % blocks:
            continue
        runs = [stat.reshape(rows, blocks, cols // blocks) for stat in stats]
        if all(bool((run == run[..., :1]).all()) for run in runs):
            return blocks
    return None


class PackedWeight(nn.Module):
    """Bit-packed integer codes with their scales; ``dequantize(dtype)`` gives the weight back."""

    KEEP_DTYPE_BUFFERS = ("scales", "offsets")  # fp32 whatever dtype the model is cast to (exact values)

    def __init__(self, shape, bits: int, blocks: int, *, signed: bool, binary: bool, asymmetric: bool,
                 device=None):  # fmt: skip
        super().__init__()
        self.shape = torch.Size(shape)
        self.bits, self.blocks = bits, blocks
        self.storage_bits = 1 if binary else storage_bits(bits)
        self.signed, self.binary, self.asymmetric = signed, binary, asymmetric
        rows, cols = self.shape[0], self.shape.numel() // self.shape[0]
        if self.storage_bits == 8 and signed:
            qweight = torch.empty(rows, cols, dtype=torch.int8, device=device)
        else:
            per_byte = 8 // self.storage_bits
            qweight = torch.empty(rows, -(-cols // per_byte), dtype=torch.uint8, device=device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", torch.empty(rows, blocks, dtype=torch.float32, device=device))
        self.register_buffer(
            "offsets", torch.empty(rows, blocks, dtype=torch.float32, device=device) if asymmetric else None
        )

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` moves the scales but keeps them fp32 (they define the values exactly)."""
        kept = {
            name: self._buffers[name]
            for name in self.KEEP_DTYPE_BUFFERS
            if self._buffers.get(name) is not None
        }
        for name in kept:
            self._buffers[name] = None
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            self._buffers[name] = tensor.to(fn(tensor[:0]).device)
        return self

    @classmethod
    def from_codes(cls, codes: CodeTensors) -> PackedWeight | None:
        """Pack cleaned codes; None when they do not fit (an asymmetric zero outside the code range, or
        group scales that no longer form equal column runs after pruning)."""
        rows = codes.codes.shape[0]
        matrix = codes.codes.reshape(rows, -1)
        stats = [t.reshape(rows, -1) for t in (codes.scale, codes.offset) if t is not None]
        blocks = _blocks(*stats)
        if blocks is None:
            return None
        bits = codes.bits
        binary = bits == 1 and not bool((matrix == 0).any())
        if bits == 1 and not binary:
            bits = 2  # pruned zeros next to +-1: ternary codes
        signed = codes.offset is None
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed and bits > 2 else (0, 2**bits - 1)
        if bits <= 2:
            low, high = -1, 1
        if int(matrix.min()) < low or int(matrix.max()) > high:
            return None
        packed = cls(codes.codes.shape, bits, blocks, signed=signed, binary=binary, asymmetric=not signed,
                     device=matrix.device)  # fmt: skip
        packed.qweight.copy_(packed._pack(matrix))
        packed.scales.copy_(codes.scale.reshape(rows, blocks, -1)[..., 0])
        if codes.offset is not None:
            packed.offsets.copy_(codes.offset.reshape(rows, blocks, -1)[..., 0])
        return packed

    # ---- codes <-> bytes ------------------------------------------------------------------------------------
    def _zero_code(self) -> int:
        """What is added to a code before storing it unsigned."""
        if self.binary or not self.signed:
            return 0
        return 1 if self.bits <= 2 else 2 ** (self.bits - 1)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.qweight.dtype == torch.int8:
            return codes.to(torch.int8)
        unsigned = (codes + 1) // 2 if self.binary else codes + self._zero_code()
        width, per_byte = self.storage_bits, 8 // self.storage_bits
        rows, cols = unsigned.shape
        padded = torch.zeros(rows, self.qweight.shape[1] * per_byte, dtype=torch.int32, device=codes.device)
        padded[:, :cols] = unsigned.to(torch.int32)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * width
        return (padded.view(rows, -1, per_byte) << shifts).sum(dim=-1).to(torch.uint8)

    def _stored(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The stored codes one per element: int8 as is, unsigned ones unpacked to uint8 ([rows, cols])."""
        qweight = self.qweight if rows is None else self.qweight[rows]
        if qweight.dtype == torch.int8 or self.storage_bits == 8:
            return qweight
        width, mask = self.storage_bits, (1 << self.storage_bits) - 1
        parts = [(qweight >> (i * width)) & mask for i in range(8 // width)]  # lowest bits first
        cols = self.shape.numel() // self.shape[0]
        return torch.stack(parts, dim=-1).reshape(*qweight.shape[:-1], -1)[..., :cols]

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The signed integer codes as a [rows, cols] int tensor (of the given rows only, if given)."""
        stored = self._stored(rows)
        if stored.dtype == torch.int8:
            return stored
        unsigned = stored.to(torch.int16)
        return unsigned * 2 - 1 if self.binary else unsigned - self._zero_code()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` without building the scaled weight: the stored codes (as floats) multiply ``x``,
        the group scales and offsets apply to the products. Same values as ``F.linear(x, dequantize())``
        up to float rounding; fp16/bf16 inputs take that dequantizing path (code sums could overflow fp16)."""
        buffers = self._buffers
        if x.dtype == torch.float32 and self.blocks == 1 and buffers["qweight"].dtype == torch.int8:
            # int8 with a scale per row, the decode hot path: one conversion, one matmul, one multiply
            return F.linear(x, buffers["qweight"].to(torch.float32)) * buffers["scales"].view(-1)
        if x.dtype != torch.float32 or len(self.shape) != 2:
            return F.linear(x, self.dequantize(x.dtype))
        stored = self._stored()
        zero = 0 if stored.dtype == torch.int8 or self.binary else self._zero_code()
        stored = stored.to(x.dtype)
        rows, cols = self.shape
        xs = x.reshape(*x.shape[:-1], self.blocks, cols // self.blocks)
        if self.blocks == 1:
            y = F.linear(x, stored).unsqueeze(-1)  # [..., rows, 1]
        else:
            y = torch.einsum("...bk,nbk->...nb", xs, stored.view(rows, self.blocks, -1))
        sums = None  # [..., 1, blocks]: the input's sum over each run, which offsets and zero codes multiply
        if self.binary or zero or self.offsets is not None:
            sums = xs.sum(-1).unsqueeze(-2)
        if self.binary:  # codes 2u - 1
            y = 2 * y - sums
        elif zero:
            y = y - zero * sums
        if self.blocks == 1 and self.offsets is None:  # one scale per row: the common int8/int4 case
            return y.squeeze(-1) * self.scales.view(-1)
        y = y * self.scales
        if self.offsets is not None:
            y = y + self.offsets * sums
        return y.sum(-1) if self.blocks > 1 else y.squeeze(-1)

    def dequantize(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or some of its rows) in ``dtype``: fp32 ``code * scale + offset``, then cast."""
        codes = self.codes(rows)
        scales = self.scales if rows is None else self.scales[rows]
        runs = codes.reshape(*codes.shape[:-1], self.blocks, -1).float() * scales.unsqueeze(-1)
        if self.offsets is not None:
            runs = runs + (self.offsets if rows is None else self.offsets[rows]).unsqueeze(-1)
        values = runs.reshape(codes.shape).to(dtype)
        return values.reshape(self.shape) if rows is None else values

    def extra_repr(self) -> str:
        kind = "binary" if self.binary else "ternary" if self.bits == 2 else f"int{self.bits}"
        return f"shape={tuple(self.shape)}, {kind} in {self.storage_bits}-bit storage, blocks={self.blocks}"


class _PackedLayer(nn.Module):
    """Shared by the packed layers: the packed weight, a bias, and the source layer's activation quantizer."""

    def _take(self, layer: nn.Module, packed: PackedWeight) -> None:
        self.packed = packed
        self.compute_dtype = layer.weight.dtype
        bias = getattr(layer, "bias", None)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.activation_quantization = getattr(layer, "activation_quantization", None)
        self.activation_quantization_enabled = getattr(layer, "activation_quantization_enabled", False)
        if isinstance(getattr(layer, "activation_quantizer", None), nn.Module):
            self.activation_quantizer = layer.activation_quantizer  # the static range buffer

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (a temporary, for code that reads ``.weight``)."""
        return self.packed.dequantize(self.compute_dtype)

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        return Compressible.quantize_input(self, x)

    _input_reduce = staticmethod(lambda tensor, op: tensor)

    def _input_groups(self, x: torch.Tensor) -> int:
        return x.numel() // x.shape[-1]


class PackedLinear(_PackedLayer):
    """A cleaned ``nn.Linear``: packed weight, dequantized for each call."""

    def __init__(self, layer: nn.Module, packed: PackedWeight):
        super().__init__()
        self._take(layer, packed)
        self.in_features, self.out_features = packed.shape[1], packed.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_quantization_enabled:
            x = self._input(x)
        out = self._modules["packed"].linear(x)
        if self.bias is None:
            return out
        return out + (self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )

    def _layout(self) -> tuple:
        p = self.packed
        return (p.bits, p.storage_bits, p.blocks, p.signed, p.binary, p.asymmetric, self.in_features,
                self.bias is not None, self.compute_dtype, self.activation_quantization is None)  # fmt: skip

    @classmethod
    @torch.no_grad()
    def fuse(cls, modules) -> FusedPacked | None:
        """One packed weight for linears that read the same input (q/k/v, gate/up): their rows stacked, each
        module's buffers then views of it (inference/fusion.py calls this); None if their layouts differ."""
        if len({m._layout() for m in modules}) != 1 or not modules[0]._layout()[-1]:
            return None
        if any(m.packed.qweight.device.type == "meta" for m in modules):
            return None
        first = modules[0].packed
        rows = [m.out_features for m in modules]
        fused = PackedWeight((sum(rows), first.shape[1]), first.bits, first.blocks, signed=first.signed,
                             binary=first.binary, asymmetric=first.asymmetric, device=first.qweight.device)  # fmt: skip
        for name in ("qweight", "scales", "offsets"):
            parts = [getattr(m.packed, name) for m in modules]
            if parts[0] is None:
                continue
            torch.cat(parts, out=getattr(fused, name))
            offset = 0
            for module, count in zip(modules, rows):
                module.packed._buffers[name] = getattr(fused, name)[offset : offset + count]
                offset += count
        bias = torch.cat([m.bias for m in modules]) if modules[0].bias is not None else None
        return FusedPacked(fused, bias, rows)


class FusedPacked:
    """Several packed linears as one call; returns their outputs, split."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, sizes: list[int]):
        self.packed, self.bias, self.sizes = packed, bias, sizes
        # int8 with a scale per row: the tensors held directly, so a decode step skips the module look-ups
        self._int8 = (
            (packed.qweight, packed.scales.view(-1))
            if packed.qweight.dtype == torch.int8 and packed.blocks == 1
            else None
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.joint(x).split(self.sizes, dim=-1)

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs side by side on the last dimension, unsplit (as ``FusedLinear.joint``: the fast decoder
        applies RoPE to q and k together on it)."""
        if self._int8 is not None and x.dtype == torch.float32:
            out = F.linear(x, self._int8[0].to(torch.float32)) * self._int8[1]
        else:
            out = self.packed.linear(x)
        if self.bias is not None:
            out = out + (self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))
        return out


class PackedEmbedding(_PackedLayer):
    """A cleaned ``nn.Embedding``: looks up rows of packed codes and dequantizes only those."""

    def __init__(self, layer: nn.Embedding, packed: PackedWeight):
        super().__init__()
        self._take(layer, packed)
        self.num_embeddings, self.embedding_dim = packed.shape
        self.padding_idx = layer.padding_idx
        if layer.max_norm is not None:
            raise ValueError(
                "packing an nn.Embedding with max_norm (which rewrites its weight) is not supported"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = self.packed.dequantize(self.compute_dtype, input.reshape(-1))
        return rows.reshape(*input.shape, self.embedding_dim)


class PackedConv2d(_PackedLayer):
    """A cleaned ``nn.Conv2d``: packed weight, dequantized for each call."""

    def __init__(self, layer: nn.Conv2d, packed: PackedWeight):
        super().__init__()
        self._take(layer, packed)
        self.conv = dict(
            stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups
        )
        if layer.padding_mode != "zeros":
            raise ValueError(f"packing a Conv2d with padding_mode {layer.padding_mode!r} is not supported")

    def _input_groups(self, x: torch.Tensor) -> int:
        return x.shape[0] if x.dim() == 4 else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._input(x)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.conv2d(x, self.packed.dequantize(self.compute_dtype).to(x.dtype), bias, **self.conv)


def packed_layer(layer: nn.Module) -> nn.Module | None:
    """The packed twin of a cleaned quantized layer, or None when its codes cannot be packed."""
    codes = getattr(layer, "_codes", None)
    if codes is None or codes.bits > 8:
        return None
    packed = PackedWeight.from_codes(codes)
    if packed is None:
        return None
    if isinstance(layer, nn.Embedding):
        return PackedEmbedding(layer, packed)
    if isinstance(layer, nn.Conv2d):
        return PackedConv2d(layer, packed)
    return PackedLinear(layer, packed)


def pack_compressed(model: nn.Module) -> list[str]:
    """Replace every cleaned quantized layer of ``model`` by its packed twin; returns the packed names.
    A layer that cannot be packed keeps its floating-point weight (logged with the reason)."""
    from .helper import recursive_setattr

    done = []
    for name, module in list(model.named_modules()):
        if getattr(module, "_codes", None) is None:
            continue
        twin = packed_layer(module)
        if twin is None:
            logger.warning("redundancy_clean: %s keeps floating-point weights (%d-bit codes that do not pack: "
                           "group scales split unevenly by pruning, or more than 8 bits)", name, module._codes.bits)  # fmt: skip
            module._codes = None
            continue
        recursive_setattr(model, name, twin.to(module.weight.device))
        done.append(name)
    return done
