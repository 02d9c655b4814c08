"""The attention of one block, forward and backward, in two interchangeable forms.

A block is `seq_chunk` sequences x `query_chunk` query rows, heads-first:

    q [B, c, H, rq, D]   k, v [B, c, H, R, D]   mask [B, c, 1, 1, R] or None   pair [B, 1, H, rq, R] or None

and its logits are S = q k^T / sqrt(D) + mask + pair, [B, c, H, rq, R]. Each kernel's backward returns the
gradients of q, k and v and, when a bias needs one, dS, the gradient of the logits: both biases enter S by
addition, so their gradients are dS summed over what they were broadcast along (the caller does that).

- `MathKernel` writes the algebra out. Forward keeps the log-sum-exp of each row (B*c*H*rq numbers) so that
  backward rebuilds the probabilities as exp(S - lse) with one matmul and no second softmax; every step on a
  logits-sized tensor is in place, so a block holds two logits-sized tensors at its peak. fp16/bf16 inputs
  are computed in fp32 (a block at a time), which also makes the result closer to the exact one than the
  plain half-precision reference.
- `SdpaKernel` calls `torch.nn.functional.scaled_dot_product_attention` with the biases as an additive float
  mask, and recomputes the block under autograd in backward. On CUDA the memory-efficient kernel takes a
  mask that requires grad and never forms the probabilities; on CPU PyTorch's flash kernel serves the
  no-grad forward, but a mask that requires grad sends backward to its math path (the block's logits are
  materialised, still one block at a time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["KERNELS", "MathKernel", "SdpaKernel"]


def _add_biases(logits: torch.Tensor, mask: torch.Tensor | None, pair: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        logits += mask
    if pair is not None:
        logits += pair
    return logits


class MathKernel:
    """Explicit matmuls and an in-place softmax; log-sum-exp saved for backward (see the module docstring)."""

    name = "math"
    saves_lse = True

    @staticmethod
    def compute_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    @staticmethod
    def _logits(q, k, mask, pair) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        logits = torch.matmul(q * scale, k.transpose(-1, -2))
        return _add_biases(logits, mask, pair)  # in place: a half-precision bias adds into fp32 logits

    def forward(self, q, k, v, mask, pair):
        """(output [B, c, H, rq, D], lse [B, c, H, rq])."""
        probs = self._logits(q, k, mask, pair)
        row_max = probs.amax(dim=-1, keepdim=True)
        # A row whose logits are all -inf has max -inf: subtracting it gives NaN, as softmax does.
        probs.sub_(row_max).exp_()
        row_sum = probs.sum(dim=-1, keepdim=True)
        probs.div_(row_sum)
        lse = (row_max + row_sum.log()).squeeze(-1)
        return torch.matmul(probs, v), lse

    def backward(self, q, k, v, mask, pair, out, lse, grad_out, need):
        """(dq, dk, dv, dS); entries not asked for in `need` (q, k, v, bias) are None."""
        need_q, need_k, need_v, need_bias = need
        scale = 1.0 / math.sqrt(q.shape[-1])
        probs = self._logits(q, k, mask, pair).sub_(lse.unsqueeze(-1)).exp_()
        dv = torch.matmul(probs.transpose(-1, -2), grad_out) if need_v else None
        # softmax backward: dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_logits = torch.matmul(grad_out, v.transpose(-1, -2)).sub_(delta).mul_(probs)
        del probs
        dq = torch.matmul(grad_logits, k).mul_(scale) if need_q else None
        dk = torch.matmul(grad_logits.transpose(-1, -2), q).mul_(scale) if need_k else None
        return dq, dk, dv, grad_logits if need_bias else None


def _flat(x: torch.Tensor | None) -> torch.Tensor | None:
    """[B, c, ...] -> [B*c, ...]: the fused kernels take 4-D tensors."""
    return None if x is None else x.flatten(0, 1)


def _combined_bias(mask, pair, q_shape, dtype, materialise: bool) -> torch.Tensor | None:
    """mask + pair as one additive SDPA mask, [B*c, H or 1, rq or 1, R]. `materialise` gives the full
    [B*c, H, rq, R] tensor (needed when its gradient is wanted, so the gradient has every entry)."""
    if mask is None and pair is None:
        return None
    batch, chunk, heads, rows, _ = q_shape
    keys = (mask if mask is not None else pair).shape[-1]
    if mask is not None and pair is not None:
        bias = mask.to(dtype) + pair.to(dtype)  # broadcast to [B, c, H, rq, R]
    else:
        bias = (mask if mask is not None else pair).to(dtype)
    if not materialise and bias.shape[1] == 1 and batch == 1:
        return bias[0]  # [1, H, rq, R] broadcasts over the block's sequences without a copy
    if materialise or bias.shape[1] != chunk:
        bias = bias.expand(batch, chunk, heads, rows, keys).contiguous()
    return bias.flatten(0, 1)


class SdpaKernel:
    """`scaled_dot_product_attention` per block; backward recomputes the block under autograd."""

    name = "sdpa"
    saves_lse = False

    @staticmethod
    def compute_dtype(dtype: torch.dtype) -> torch.dtype:
        return dtype

    def forward(self, q, k, v, mask, pair):
        bias = _combined_bias(mask, pair, q.shape, q.dtype, materialise=False)
        out = F.scaled_dot_product_attention(_flat(q), _flat(k), _flat(v), attn_mask=bias)
        return out.unflatten(0, q.shape[:2]), None

    def backward(self, q, k, v, mask, pair, out, lse, grad_out, need):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(wanted) for t, wanted in zip((q, k, v), need[:3])]
            bias = _combined_bias(mask, pair, q.shape, q.dtype, materialise=need[3])
            if bias is not None and need[3]:
                bias = bias.detach().requires_grad_()
            result = F.scaled_dot_product_attention(*(_flat(t) for t in leaves), attn_mask=bias)
            inputs = [t for t in (*leaves, bias) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(result, inputs, _flat(grad_out)))
        dq, dk, dv = (next(grads) if wanted else None for wanted in need[:3])
        grad_bias = next(grads).unflatten(0, q.shape[:2]) if need[3] else None
        return dq, dk, dv, grad_bias


KERNELS = {"math": MathKernel(), "sdpa": SdpaKernel()}
