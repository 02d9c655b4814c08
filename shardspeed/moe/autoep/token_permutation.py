"""Token permutation for grouped expert matmuls: rows grouped by expert, each expert's group padded to a multiple
of `TOKEN_GROUP_ALIGN_SIZE_M` rows (DeepSpeed's `deepspeed.moe.ep_kernels`, in PyTorch).

`torch._grouped_mm` wants every group's row count aligned. After the all-to-all a rank holds, for each source
rank r and local expert e, `counts[r * E + e]` rows, source-major. `generate_permute_indices` gives the order
that puts them expert-major instead (every source rank's rows of expert 0, then of expert 1, ...), with each
expert's group padded; padding slots are -1. `permute_rows` / `unpermute_rows` apply that order and its inverse
as differentiable gathers: each row lands in exactly one slot, so a backward is a gather too (no scatter-add),
and padding slots get zero rows and no gradient. `indices_padding_wrapper` wraps an expert function
`f(w1, w2, w3, x, counts)` with the two.

DeepSpeed runs the index fill and the row gather as Triton kernels on CUDA; here they are PyTorch operations on
any device (the results are the same: its CPU path is the reference its kernels are checked against).
shardspeed's own AutoEP layer (layer.py) orders rows with a stable argsort instead and does not pad (its
`use_grouped_mm` path pads inside experts.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "TOKEN_GROUP_ALIGN_SIZE_M",
    "fill_indices_cpu",
    "fill_indices_wrapper",
    "gather_rows",
    "generate_permute_indices",
    "indices_padding_wrapper",
    "inverse_permutation",
    "permute_rows",
    "permute_rows_supported",
    "unpermute_rows",
]

#: Rows per aligned expert group: 16 bytes of bf16 (fp8 would need 16, mxfp8 32).
TOKEN_GROUP_ALIGN_SIZE_M = 8


def _round_up(x: int, y: int) -> int:
    return -(-x // y) * y


def fill_indices_cpu(
    tokens_per_expert_group: torch.Tensor,
    start_index_values: torch.Tensor,
    write_offsets: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    max_len: int,
) -> torch.Tensor:
    """`max_len` slots (int32, -1 = padding): for local expert e, from `write_offsets[e]` on, the source indices
    of its rows from rank 0, then rank 1, ... (`tokens_per_expert_group[r * E + e]` rows starting at
    `start_index_values[r * E + e]`); whatever passes `max_len` is cut."""
    out = torch.full((max_len,), -1, dtype=torch.int32)
    counts = tokens_per_expert_group.tolist()
    starts = start_index_values.tolist()
    for e in range(experts_per_rank):
        at = int(write_offsets[e])
        for r in range(num_ranks):
            i = r * experts_per_rank + e
            length = int(counts[i])
            end = min(at + length, max_len)
            if end > at:
                out[at:end] = torch.arange(int(starts[i]), int(starts[i]) + end - at, dtype=torch.int32)
            at += length
    return out.to(tokens_per_expert_group.device)


def fill_indices_wrapper(
    tokens_per_expert_group: torch.Tensor,
    start_index_values: torch.Tensor,
    write_offsets: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    max_len: int,
    block_size: int = 128,
    max_blocks: int = 1024,
) -> torch.Tensor:
    """DeepSpeed's Triton launch of the fill; here the same fill in PyTorch (`block_size`/`max_blocks` only shape
    a kernel launch, which there is none of)."""
    del block_size, max_blocks
    return fill_indices_cpu(
        tokens_per_expert_group, start_index_values, write_offsets, experts_per_rank, num_ranks, max_len
    )


def generate_permute_indices(
    tokens_per_expert_group: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    max_len: int,
    alignment: int,
    use_cpu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(permuted indices, aligned rows per local expert `m_sizes`, their running sum `m_offsets`) for
    `tokens_per_expert_group` (rank-major counts, `num_ranks * experts_per_rank`). Each expert's group is
    rounded up to `alignment` rows, and an expert without rows still gets `alignment` (padding only)."""
    del use_cpu  # one implementation here
    starts = torch.cumsum(tokens_per_expert_group, 0) - tokens_per_expert_group
    per_expert = tokens_per_expert_group.view(num_ranks, -1).sum(0).clamp_min(alignment)
    m_sizes = ((per_expert + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = torch.cumsum(m_sizes, 0)
    indices = fill_indices_cpu(
        tokens_per_expert_group, starts, m_offsets - m_sizes, experts_per_rank, num_ranks, max_len
    )
    return indices, m_sizes, m_offsets.to(torch.int32)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`out[r] = src[index[r]]`, a zero row where `index[r]` is outside `[0, len(src))` (padding). Not tracked by
    autograd: `permute_rows` is the differentiable form. (It copies `src` once, with a zero row appended; DeepSpeed's
    CUDA kernel reads it in place.)"""
    index = index.to(torch.int64)
    rows = src.shape[0]
    with torch.no_grad():
        padded = torch.cat((src.detach(), src.new_zeros((1, *src.shape[1:]))))
        return padded[torch.where((index >= 0) & (index < rows), index, rows)]


def inverse_permutation(permuted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each of `num_rows` source rows, the slot `permuted_indices` put it in. `permuted_indices` must hold each
    of `0 .. num_rows - 1` once and padding otherwise (as `generate_permute_indices` gives when the counts sum to
    `num_rows`; not checked)."""
    slots = torch.arange(permuted_indices.numel(), device=permuted_indices.device)
    indices = permuted_indices.to(torch.int64)
    valid = (indices >= 0) & (indices < num_rows)
    inverse = torch.empty(
        num_rows + permuted_indices.numel(), dtype=torch.int64, device=permuted_indices.device
    )
    # padding slots are written past num_rows, each to its own place, then dropped
    inverse.scatter_(0, torch.where(valid, indices, num_rows + slots), slots)
    return inverse[:num_rows]


class _PermuteRows(torch.autograd.Function):
    """Padded expert-major rows from source-major rows; backward: each source row's gradient from its slot."""

    @staticmethod
    def forward(ctx, rows, permuted_indices, inverse):
        ctx.save_for_backward(permuted_indices, inverse)
        return gather_rows(rows, permuted_indices)

    @staticmethod
    def backward(ctx, grad):
        permuted_indices, inverse = ctx.saved_tensors
        return _UnpermuteRows.apply(grad, permuted_indices, inverse), None, None


class _UnpermuteRows(torch.autograd.Function):
    """Source-major rows from padded expert-major rows; backward: the padded gather (padding gets zero)."""

    @staticmethod
    def forward(ctx, rows, permuted_indices, inverse):
        ctx.save_for_backward(permuted_indices, inverse)
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad):
        permuted_indices, inverse = ctx.saved_tensors
        return _PermuteRows.apply(grad, permuted_indices, inverse), None, None


def permute_rows(rows: torch.Tensor, permuted_indices: torch.Tensor) -> torch.Tensor:
    """`rows` in the padded order of `permuted_indices`, zero rows at padding slots (differentiable, twice)."""
    return _PermuteRows.apply(rows, permuted_indices, inverse_permutation(permuted_indices, rows.shape[0]))


def unpermute_rows(rows: torch.Tensor, permuted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The `num_rows` source rows back from the padded order (padding rows are never read)."""
    return _UnpermuteRows.apply(rows, permuted_indices, inverse_permutation(permuted_indices, num_rows))


def permute_rows_supported(rows: torch.Tensor) -> bool:
    """Whether `permute_rows` / `unpermute_rows` take `rows`: 2-D (DeepSpeed's kernels also want CUDA and Triton;
    these gathers run on any device)."""
    return rows.dim() == 2


def indices_padding_wrapper(func: Callable) -> Callable:
    """Wrap `func(w1, w2, w3, x, num_tokens_per_expert)` so that it sees `x` expert-major with every expert's
    group padded to `TOKEN_GROUP_ALIGN_SIZE_M` rows (and the aligned counts); its output comes back in `x`'s
    order, padding rows dropped."""

    def wrapper(w1, w2, w3, x, num_tokens_per_expert):
        num_local_experts = w1.shape[0]
        ep_degree = num_tokens_per_expert.shape[0] // num_local_experts
        align = TOKEN_GROUP_ALIGN_SIZE_M
        max_len = _round_up(x.shape[0] + num_local_experts * align, align)
        with torch.no_grad():
            indices, aligned, _ = generate_permute_indices(
                num_tokens_per_expert, num_local_experts, ep_degree, max_len, align
            )
        out = func(w1, w2, w3, permute_rows(x, indices), aligned)
        return unpermute_rows(out, indices, x.shape[0])

    return wrapper
