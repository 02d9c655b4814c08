"""Blockwise symmetric quantization for ZeRO++'s collectives, in plain torch (CPU and GPU alike).

ZeRO++ quantizes slices of a unit's flat buffer: a rank's parameter shard (qwZ), or the slice of a gradient
bucket meant for one rank (qgZ). A `BlockLayout` cuts each of the N slices into *blocks* that never cross
a parameter boundary — a LayerNorm weight of ones next to a matrix of values around 0.02 would otherwise
set the matrix's scale — each at most `max_block` elements. Every block keeps one fp32 scale,
`absmax / qmax`, and its values as integers in [-qmax, qmax] (`qmax` = 127 for int8, 7 for int4;
symmetric, so zero stays zero and the block's largest value is exact).

On the wire a quantized slice is one *record* of bytes: the integers (int4 packed two to a byte, low nibble
first), then the scales, padded to the largest block count of any slice. All records of one layout have
the same size, so `k` of them travel as one `(k, record_bytes)` uint8 tensor through a single collective.

Block sizes follow DeepSpeed's: weights (qwZ, int8) at most 8,000 elements per scale, DeepSpeed's
`CUDAQuantizer.target_group_size`; gradients (qgZ, int4) at most 512 (DeepSpeed groups each gradient by
the rows of its larger dimension, 768 elements for a 768 x 3072 weight; ours are flat buckets). A longer
parameter piece is split into equal blocks.

Non-finite values survive: a block holding an inf or a nan gets a nan scale and every value of the block
dequantizes to nan, so fp16 overflow detection after a quantized reduction still sees it.
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["GRADIENT_BLOCK", "WEIGHT_TARGET_BLOCK", "BlockLayout", "dequantize", "quantize"]

WEIGHT_TARGET_BLOCK = 8000
GRADIENT_BLOCK = 512


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _split(length: int, max_block: int) -> list[int]:
    """`length` elements in the fewest blocks of at most `max_block`, as equal as possible."""
    count = math.ceil(length / max_block)
    return [length // count + (1 if i < length % count else 0) for i in range(count)]


class BlockLayout:
    """The blocks of each of `len(lengths)` slices of `slice_numel` elements, quantized to `bits` bits."""

    def __init__(self, lengths: list[list[int]], bits: int):
        self.lengths = [list(row) for row in lengths]
        self.slice_numel = sum(self.lengths[0])
        if any(sum(row) != self.slice_numel for row in self.lengths):
            raise ValueError("every slice of a block layout must have the same number of elements")
        self.bits = bits
        self.qmax = 2 ** (bits - 1) - 1
        self.max_blocks = max(len(row) for row in self.lengths)
        self.data_bytes = _round_up(self.slice_numel, 8) * bits // 8
        self.record_bytes = self.data_bytes + 4 * self.max_blocks
        self._cache: dict = {}

    @classmethod
    def for_buffer(cls, offsets, numels, slice_numel: int, slices: int, *, bits: int,
                   max_block: int) -> BlockLayout:  # fmt: skip
        """Blocks of a flat buffer of `slices` x `slice_numel` elements holding parameters at `offsets`
        with `numels` elements (the rest is padding): each slice's parameter pieces, split at `max_block`."""
        bounds = sorted(
            {0, slices * slice_numel} | {o for o in offsets} | {o + n for o, n in zip(offsets, numels)}
        )
        lengths = []
        for s in range(slices):
            lo, hi = s * slice_numel, (s + 1) * slice_numel
            cuts = [lo] + [b for b in bounds if lo < b < hi] + [hi]
            lengths.append([n for a, b in itertools.pairwise(cuts) for n in _split(b - a, max_block)])
        return cls(lengths, bits)

    @classmethod
    def for_weights(cls, unit) -> BlockLayout:
        """qwZ: int8 blocks of each rank's shard of a unit (a FlatParamBucket)."""
        return cls.for_buffer(unit.offsets, unit.numels, unit.shard_numel, unit.world, bits=8,
                              max_block=WEIGHT_TARGET_BLOCK)  # fmt: skip

    @classmethod
    def for_gradients(cls, unit) -> BlockLayout:
        """qgZ: int4 blocks of each rank's slice of a unit's gradient buffer."""
        return cls.for_buffer(unit.offsets, unit.numels, unit.shard_numel, unit.world, bits=4,
                              max_block=GRADIENT_BLOCK)  # fmt: skip

    def _index(self, rows: tuple[int, ...], device: torch.device):
        """Block lengths of `rows` in order, and which of each row's `max_blocks` scale slots they use."""
        key = (rows, device)
        if key not in self._cache:
            lengths = torch.tensor([n for r in rows for n in self.lengths[r]], device=device)
            used = torch.tensor(
                [[i < len(self.lengths[r]) for i in range(self.max_blocks)] for r in rows], device=device
            )
            self._cache[key] = (lengths, used)
        return self._cache[key]


def quantize(values: torch.Tensor, layout: BlockLayout, rows) -> torch.Tensor:
    """Quantize `values` (shape `(k, slice_numel)`, any float dtype), row i being slice `rows[i]` of the
    layout, into a `(k, record_bytes)` uint8 tensor of records."""
    k, numel = values.shape[0], layout.slice_numel
    lengths, used = layout._index(tuple(rows), values.device)
    flat = values.reshape(-1).float()
    absmax = torch.segment_reduce(flat.abs(), "max", lengths=lengths)
    scale = absmax / layout.qmax
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # nan > 0 is false
    q = torch.round(flat / torch.repeat_interleave(divisor, lengths)).clamp_(-layout.qmax, layout.qmax)
    q = torch.nan_to_num(q, nan=0.0).view(k, numel)
    records = torch.zeros((k, layout.record_bytes), dtype=torch.uint8, device=values.device)
    width = layout.data_bytes * 8 // layout.bits
    if layout.bits == 8:
        records[:, :numel] = q.to(torch.int8).view(torch.uint8)
    else:  # two int4 values per byte, offset by 8 into [0, 15]: low nibble the even element
        nibbles = torch.full((k, width), 8, dtype=torch.uint8, device=values.device)
        nibbles[:, :numel] = (q + 8).to(torch.uint8)
        pairs = nibbles.view(k, -1, 2)
        records[:, : layout.data_bytes] = pairs[..., 0] | (pairs[..., 1] << 4)
    scales = torch.zeros((k, layout.max_blocks), dtype=torch.float32, device=values.device)
    scales[used] = scale
    records[:, layout.data_bytes :] = scales.view(torch.uint8)
    return records


def dequantize(
    records: torch.Tensor, layout: BlockLayout, rows, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The `(k, slice_numel)` values of `k` records (a `(k, record_bytes)` or flat uint8 tensor) of slices
    `rows`, in `dtype`."""
    records = records.view(-1, layout.record_bytes)
    k, numel = records.shape[0], layout.slice_numel
    lengths, used = layout._index(tuple(rows), records.device)
    data = records[:, : layout.data_bytes]
    if layout.bits == 8:
        q = data.contiguous().view(torch.int8)[:, :numel].to(torch.float32)
    else:
        q = torch.stack((data & 15, data >> 4), dim=2).view(k, -1)[:, :numel].to(torch.float32).sub_(8)
    scales = records[:, layout.data_bytes :].contiguous().view(torch.float32)[used]
    values = q.reshape(-1).mul_(torch.repeat_interleave(scales, lengths))
    return values.view(k, numel).to(dtype)
