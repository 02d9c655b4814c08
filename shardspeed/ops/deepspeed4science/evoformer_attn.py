"""`DS4Sci_EvoformerAttention`: DeepSpeed4Science's Evoformer attention, block by block, nothing compiled.

    out = DS4Sci_EvoformerAttention(Q, K, V, [mask_bias, pair_bias])

Q, K, V are [batch, n_seq, n_res, heads, dim]; the optional biases are a residue mask bias
[batch, n_seq, 1, 1, n_res] and a pair bias [batch, 1, heads, n_res, n_res] (a pair bias alone goes in as
`[None, pair_bias]`); out[b, s, i, h] = softmax_j(Q[b, s, i, h] . K[b, s, j, h] / sqrt(dim) + biases) V[b, s, j, h],
the attention of every sequence over its residues. Gradients flow to Q, K, V and both biases.

Written plainly this holds [batch, n_seq, heads, n_res, n_res] logits and probabilities for autograd.
`EvoformerFusedAttention` instead runs the attention a block of sequences (and, for very long ones, a block
of query rows) at a time (chunking.py sizes the blocks), in forward and again in backward, where each
block's probabilities are rebuilt from a per-row log-sum-exp saved in forward; the pair bias's gradient,
summed over n_seq, is accumulated block by block (kernels.py has the per-block algebra). DeepSpeed's own op
is a CUTLASS kernel built at first call for CUDA GPUs only; this one runs wherever torch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from shardspeed.ops.deepspeed4science.chunking import (
    ChunkPlan,
    check_chunk_argument,
    memory_target_bytes,
    plan_chunks,
)
from shardspeed.ops.deepspeed4science.kernels import KERNELS

__all__ = ["DS4Sci_EvoformerAttention", "EvoformerFusedAttention"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = ("auto", *KERNELS)
_SHAPE_WORDS = "[batch, n_seq, n_res, heads, dim]"


@dataclass(frozen=True)
class AttentionOptions:
    """Block sizes (None: from the memory target) and the per-block kernel ("auto": SDPA on CUDA, else
    the explicit math kernel)."""

    chunk_size: int | None = None
    query_chunk_size: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        check_chunk_argument("chunk_size", self.chunk_size)
        check_chunk_argument("query_chunk_size", self.query_chunk_size)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")

    def kernel_for(self, device: torch.device):
        if self.backend == "auto":
            return KERNELS["sdpa" if device.type == "cuda" else "math"]
        return KERNELS[self.backend]

    def plan_for(self, q: torch.Tensor, kernel) -> ChunkPlan:
        itemsize = torch.empty((), dtype=kernel.compute_dtype(q.dtype)).element_size()
        target = memory_target_bytes(q.numel() * q.element_size(), q.device.type)
        return plan_chunks(tuple(q.shape), itemsize, target, self.chunk_size, self.query_chunk_size)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_same_kind(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but Q has {q.dtype}; all inputs must share Q's dtype")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but Q is on {q.device}; all inputs must be on Q's device")


def check_qkv(q, k, v) -> None:
    """Q, K, V: tensors of one 5-D shape, one supported dtype, one device; errors name the tensor."""
    for name, t in (("Q", q), ("K", k), ("V", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 5:
        raise ValueError(f"Q must have 5 dimensions {_SHAPE_WORDS}, got shape {_shape(q)}")
    if q.numel() == 0:
        raise ValueError(f"Q has shape {_shape(q)} {_SHAPE_WORDS}: every dimension must be at least 1")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Q has dtype {q.dtype}; supported: float32, bfloat16, float16 (and float64)")
    for name, t in (("K", k), ("V", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {_shape(t)} but Q has {_shape(q)}; Q, K and V must all be "
                             f"{_SHAPE_WORDS}")  # fmt: skip
        _check_same_kind(name, t, q)


def check_biases(q: torch.Tensor, mask, pair) -> None:
    """The mask bias must be [batch, n_seq, 1, 1, n_res] and the pair bias [batch, 1, heads, n_res, n_res]
    exactly (as DeepSpeed asserts), with Q's dtype and device."""
    batch, n_seq, n_res, heads, _ = q.shape
    expected = {
        0: ((batch, n_seq, 1, 1, n_res), "the mask bias [batch, n_seq, 1, 1, n_res]"),
        1: ((batch, 1, heads, n_res, n_res), "the pair bias [batch, 1, heads, n_res, n_res]"),
    }
    for index, bias in enumerate((mask, pair)):
        if bias is None:
            continue
        shape, words = expected[index]
        name = f"biases[{index}]"
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(bias).__name__}")
        if _shape(bias) != shape:
            hint = " (a pair bias alone goes in as [None, pair_bias])" if index == 0 else ""
            raise ValueError(f"{name} is {words}: for Q of shape {_shape(q)} it must have shape {shape}, "
                             f"got {_shape(bias)}{hint}")  # fmt: skip
        _check_same_kind(name, bias, q)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, N, R, H, D] -> [B, N, H, R, D], a view."""
    return x.transpose(2, 3)


def _forward(kernel, plan: ChunkPlan, q, k, v, mask, pair):
    compute = kernel.compute_dtype(q.dtype)
    batch, n_seq, n_res, heads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((batch, n_seq, heads, n_res), dtype=compute) if kernel.saves_lse else None
    qh, kh, vh, oh = (_heads_first(t) for t in (q, k, v, out))
    for s0, s1 in plan.seq_slices(n_seq):
        k_c, v_c = kh[:, s0:s1].to(compute), vh[:, s0:s1].to(compute)
        mask_c = None if mask is None else mask[:, s0:s1]
        for r0, r1 in plan.query_slices(n_res):
            pair_b = None if pair is None else pair[..., r0:r1, :]
            out_b, lse_b = kernel.forward(qh[:, s0:s1, :, r0:r1].to(compute), k_c, v_c, mask_c, pair_b)
            oh[:, s0:s1, :, r0:r1] = out_b
            if lse is not None:
                lse[:, s0:s1, :, r0:r1] = lse_b
    return out, lse


class _Gradients:
    """Gradient buffers of one backward: dQ written block by block, dK/dV summed over a sequence block's
    query blocks, the biases' gradients summed from dS (the mask's over heads and query rows, the pair's
    over sequences) in the compute dtype."""

    def __init__(self, q, mask, pair, need, compute):
        need_q, need_k, need_v, need_mask, need_pair = need
        self.dq, self.dk, self.dv = (
            torch.empty_like(q) if wanted else None for wanted in (need_q, need_k, need_v)
        )
        self.dmask = torch.zeros(mask.shape, dtype=compute, device=q.device) if need_mask else None
        self.dpair = torch.zeros(pair.shape, dtype=compute, device=q.device) if need_pair else None
        self.dk_c = self.dv_c = None

    def add_block(self, s0, s1, r0, r1, dq, dk, dv, grad_logits) -> None:
        if dq is not None:
            _heads_first(self.dq)[:, s0:s1, :, r0:r1] = dq
        self.dk_c = dk if self.dk_c is None or dk is None else self.dk_c.add_(dk)
        self.dv_c = dv if self.dv_c is None or dv is None else self.dv_c.add_(dv)
        if self.dmask is not None:
            self.dmask[:, s0:s1] += grad_logits.sum(dim=(2, 3), keepdim=True)
        if self.dpair is not None:
            # a one-sequence block adds in place; a sum over the block's sequences first is 1/c of a block
            per_pair = grad_logits if grad_logits.shape[1] == 1 else grad_logits.sum(dim=1, keepdim=True)
            self.dpair[..., r0:r1, :] += per_pair

    def end_sequence_block(self, s0, s1) -> None:
        for full, block in ((self.dk, self.dk_c), (self.dv, self.dv_c)):
            if full is not None:
                _heads_first(full)[:, s0:s1] = block
        self.dk_c = self.dv_c = None

    def result(self, mask, pair):
        dmask = None if self.dmask is None else self.dmask.to(mask.dtype)
        dpair = None if self.dpair is None else self.dpair.to(pair.dtype)
        return self.dq, self.dk, self.dv, dmask, dpair


def _backward(kernel, plan: ChunkPlan, saved, grad_out, needs_input_grad):
    q, k, v, out, lse, mask, pair = saved
    need = (*needs_input_grad[:3], needs_input_grad[3] and mask is not None,
            needs_input_grad[4] and pair is not None)  # fmt: skip
    compute = kernel.compute_dtype(q.dtype)
    grads = _Gradients(q, mask, pair, need, compute)
    kernel_need = (*need[:3], need[3] or need[4])
    n_seq, n_res = q.shape[1], q.shape[2]
    qh, kh, vh, oh, gh = (_heads_first(t) for t in (q, k, v, out, grad_out))
    for s0, s1 in plan.seq_slices(n_seq):
        k_c, v_c = kh[:, s0:s1].to(compute), vh[:, s0:s1].to(compute)
        mask_c = None if mask is None else mask[:, s0:s1]
        for r0, r1 in plan.query_slices(n_res):
            block = (s0, s1, r0, r1)
            rows = (slice(None), slice(s0, s1), slice(None), slice(r0, r1))
            pair_b = None if pair is None else pair[..., r0:r1, :]
            lse_b = None if lse is None else lse[rows]
            block_grads = kernel.backward(qh[rows].to(compute), k_c, v_c, mask_c, pair_b, oh[rows].to(compute),
                                          lse_b, gh[rows].to(compute), kernel_need)  # fmt: skip
            grads.add_block(*block, *block_grads)
            del block_grads  # else this block's dS stays alive through the next block's peak
        grads.end_sequence_block(s0, s1)
    return grads.result(mask, pair)


class EvoformerFusedAttention(torch.autograd.Function):
    """DeepSpeed's autograd function: `EvoformerFusedAttention.apply(q, k, v, bias1=None, bias2=None)`,
    here blockwise in forward and backward; `options` (ours) sets block sizes and the per-block kernel."""

    @staticmethod
    def forward(ctx, q, k, v, bias1=None, bias2=None, options=None):
        options = options if options is not None else AttentionOptions()
        check_qkv(q, k, v)
        check_biases(q, bias1, bias2)
        kernel = options.kernel_for(q.device)
        plan = options.plan_for(q, kernel)
        out, lse = _forward(kernel, plan, q, k, v, bias1, bias2)
        ctx.save_for_backward(q, k, v, out, lse, bias1, bias2)
        ctx.kernel, ctx.plan = kernel, plan
        return out

    @staticmethod
    @once_differentiable  # no double backward (DeepSpeed's kernel has none either): a clear error, not a wrong graph
    def backward(ctx, grad_out):
        grads = _backward(ctx.kernel, ctx.plan, ctx.saved_tensors, grad_out, ctx.needs_input_grad)
        return (*grads, None)


def DS4Sci_EvoformerAttention(Q, K, V, biases, *, chunk_size=None, query_chunk_size=None, backend="auto"):
    """Evoformer attention of Q, K, V [batch, n_seq, n_res, heads, dim] with up to two biases
    ([mask_bias [batch, n_seq, 1, 1, n_res], pair_bias [batch, 1, heads, n_res, n_res]], either may be None);
    returns [batch, n_seq, n_res, heads, dim] in Q's dtype.

    chunk_size / query_chunk_size: sequences / query rows per block (default: sized from the memory target,
    see chunking.py and `SHARDSPEED_EVOFORMER_CHUNK_MB`). backend: "auto" (SDPA on CUDA, the explicit math
    kernel elsewhere), "math" or "sdpa". Unlike DeepSpeed, `biases` is not modified (DeepSpeed appends None
    to the caller's list until it holds two).
    """
    if not isinstance(biases, (list, tuple)):
        raise TypeError(
            f"biases must be a list of at most two tensors (or None), got {type(biases).__name__}"
        )
    if len(biases) > 2:
        raise ValueError(f"biases holds {len(biases)} entries; at most two: [mask_bias, pair_bias]")
    mask, pair = (*biases, None, None)[:2]
    options = AttentionOptions(chunk_size, query_chunk_size, backend)
    return EvoformerFusedAttention.apply(Q, K, V, mask, pair, options)
