"""Blockwise symmetric quantization for ZeRO++'s collectives, in plain torch (CPU and GPU alike).

A 1-D tensor of `numel` elements is cut into `blocks` blocks of `block` elements (the last one padded with
zeros); each block keeps one fp32 scale, `absmax / qmax`, and its values as integers in [-qmax, qmax]
(`qmax` = 127 for int8, 7 for int4; symmetric, so zero stays exactly zero and the block's largest value
is exact). On the wire a quantized tensor is one *record* of bytes: the integers (int4 packed two to a
byte, low nibble first), then the scales. Records of equal `numel` have equal size, so `k` of them travel
as one `(k, record_bytes)` uint8 tensor through a single collective.

Block sizes follow DeepSpeed's: weights (qwZ, int8) use at most 8,000 elements per scale, DeepSpeed's
`CUDAQuantizer.target_group_size`, in `ceil(numel / 8000)` equal blocks. DeepSpeed groups each gradient
(qgZ, int4) by the rows of its larger dimension (768 elements for a 768 x 3072 weight); ours are flat
buckets spanning many parameters, so they use fixed 512-element blocks (4 scale bytes per 256 data bytes).

Non-finite values survive: a block holding an inf or a nan gets a non-finite scale, and every value of the
block dequantizes to nan, so fp16 overflow detection after a quantized reduction still sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GRADIENT_BLOCK", "WEIGHT_TARGET_BLOCK", "BlockFormat", "dequantize", "quantize"]

WEIGHT_TARGET_BLOCK = 8000
GRADIENT_BLOCK = 512
_ALIGN = 8  # blocks are a multiple of 8 elements: int4 packs evenly and the scales start 4-byte aligned


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BlockFormat:
    """How a tensor of `numel` elements is quantized: `bits` per value, `blocks` blocks of `block`."""

    numel: int
    bits: int
    block: int
    blocks: int

    @classmethod
    def for_weights(cls, numel: int) -> BlockFormat:
        """qwZ: int8, at most ~8,000 elements per scale (DeepSpeed's target group size)."""
        blocks = max(1, math.ceil(numel / WEIGHT_TARGET_BLOCK))
        return cls(numel, 8, _round_up(max(1, math.ceil(numel / blocks)), _ALIGN), blocks)

    @classmethod
    def for_gradients(cls, numel: int) -> BlockFormat:
        """qgZ: int4 in 512-element blocks (one smaller block for a shorter tensor)."""
        block = min(GRADIENT_BLOCK, _round_up(max(1, numel), _ALIGN))
        return cls(numel, 4, block, math.ceil(max(1, numel) / block))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def data_bytes(self) -> int:
        return self.blocks * self.block * self.bits // 8

    @property
    def record_bytes(self) -> int:
        """Bytes of one quantized tensor on the wire: integers, then one fp32 scale per block."""
        return self.data_bytes + 4 * self.blocks


def quantize(values: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Quantize each row of `values` (shape `(k, numel)`, any float dtype) into a `(k, record_bytes)` uint8
    tensor of records."""
    rows = values.shape[0]
    padded = values.new_zeros((rows, fmt.blocks * fmt.block), dtype=torch.float32)
    padded[:, : fmt.numel] = values
    blocks = padded.view(rows, fmt.blocks, fmt.block)
    scale = blocks.abs().amax(dim=2) / fmt.qmax  # nan or inf when the block holds one
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(2)
    q = torch.nan_to_num(torch.round(blocks / divisor).clamp_(-fmt.qmax, fmt.qmax), nan=0.0)
    records = torch.empty((rows, fmt.record_bytes), dtype=torch.uint8, device=values.device)
    if fmt.bits == 8:
        records[:, : fmt.data_bytes] = q.to(torch.int8).view(rows, -1).view(torch.uint8)
    else:  # two int4 values per byte, offset by 8 into [1, 15]: low nibble the even element
        nibbles = (q + 8).to(torch.uint8).view(rows, -1, 2)
        records[:, : fmt.data_bytes] = nibbles[..., 0] | (nibbles[..., 1] << 4)
    records[:, fmt.data_bytes :] = scale.contiguous().view(torch.uint8)
    return records


def dequantize(records: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `(k, numel)` values of `k` records (a `(k, record_bytes)` or flat uint8 tensor), in `dtype`."""
    records = records.view(-1, fmt.record_bytes)
    rows = records.shape[0]
    data = records[:, : fmt.data_bytes]
    scale = records[:, fmt.data_bytes :].contiguous().view(torch.float32)
    if fmt.bits == 8:
        q = data.contiguous().view(torch.int8).to(torch.float32)
    else:
        q = torch.stack(((data & 15), (data >> 4)), dim=2).to(torch.float32).sub_(8)
    values = q.view(rows, fmt.blocks, fmt.block).mul_(scale.unsqueeze(2)).view(rows, -1)
    return values[:, : fmt.numel].to(dtype)
