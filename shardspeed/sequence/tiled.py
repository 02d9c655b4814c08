"""ALST's tiled compute: run a per-token computation over tiles of the sequence, recomputing each in backward.

At long sequence lengths the largest activations are not attention's but the MLP's ([tokens, 4 x hidden] or
more) and the logits ([tokens, vocab], before the loss upcasts them to fp32). These autograd functions run the
computation tile by tile under `no_grad` in forward, so only the input is saved, and in backward recompute
one tile at a time with autograd on and back-propagate it at once, so at most one tile's intermediates exist.
The cost is one more forward of the tiled computation per step (twice with activation checkpointing).

- `TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` over tiles of dimension -2 of x.
- `SequenceTiledCompute` / `sequence_tiled_compute(...)`: the general form: named tensors sharded on
  dimension 1, others passed whole, outputs concatenated (and optionally reduced to their mean or sum).
- `TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`: a loss over
  tiles of the tokens, so the full logits never exist.

Parameters used inside `fn` receive one gradient per tile. `compute_params` are marked `ds_grad_is_ready =
False` for every tile but the last, DeepSpeed's signal to the engine's gradient hooks to keep accumulating
instead of reducing after the first tile's contribution (shardspeed's gradient buckets honour it).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "AutogradComputeMLP",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "sequence_tiled_compute",
]

_REDUCTIONS = (None, "mean", "sum")


def _requiring_grad(params) -> list[torch.Tensor]:
    return [p for p in (params or []) if p.requires_grad]


def _mark_grads_ready(params: list[torch.Tensor], ready: bool) -> None:
    """DeepSpeed's per-parameter flag: False while more tiles will add to this parameter's gradient."""
    for p in params:
        p.ds_grad_is_ready = ready


def _leaf_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new autograd leaf sharing `t`'s storage, so a tile's gradient stops at it."""
    return t.detach().requires_grad_(requires_grad)


class TiledMLP(torch.autograd.Function):
    """`fn(module, x)` in `shards` tiles of dimension -2 of `x` (the sequence of [b, s, h], the tokens of
    [tokens, h]); `fn` must treat each position independently, as an MLP does."""

    @staticmethod
    def forward(ctx, fn, module, x, shards, compute_params):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.compute_params = _requiring_grad(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        # Batch and sequence flattened into one row dimension: a tile is then contiguous rows whatever the
        # batch size, so its gradient lands in one contiguous slice of x_grad.
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        x_grad = torch.empty_like(rows) if x.requires_grad else None
        row_tiles = rows.chunk(ctx.shards, dim=0)
        offset = 0
        for i, tile in enumerate(row_tiles):
            _mark_grads_ready(ctx.compute_params, i == len(row_tiles) - 1)
            leaf = _leaf_like(tile, x.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            n = tile.shape[0]
            torch.autograd.backward(out, grad_rows[offset : offset + n])
            if x_grad is not None:
                x_grad[offset : offset + n].copy_(leaf.grad)
            offset += n
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None


def _shard_bounds(seqlen: int, shards: int) -> list[tuple[int, int]]:
    """DeepSpeed's tiles: `shards` slices of ceil(seqlen / shards) positions (the last ones may be short)."""
    step = math.ceil(seqlen / shards)
    return [(min(i * step, seqlen), min((i + 1) * step, seqlen)) for i in range(shards)]


class SequenceTiledCompute(torch.autograd.Function):
    """The general tiled compute; call it through `sequence_tiled_compute` (autograd functions take no dicts).

    `args` are the values of `keys_to_shard` (tensors [b, s, ...], sliced on dimension 1) then those of
    `keys_to_pass` (given whole). Only the tensor named `grad_requiring_tensor_key` gets a gradient; parameters
    inside `fn` accumulate theirs. Outputs are concatenated on `output_unshard_dimension` (0: stacked, for a
    per-tile loss) and reduced by `output_reduction` (None, "mean" or "sum").
    """

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
                compute_params, output_unshard_dimension, output_reduction, *args):  # fmt: skip
        if output_reduction not in _REDUCTIONS:
            raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
        keys = list(keys_to_shard) + list(keys_to_pass)
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(
                f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of the sharded keys "
                f"{list(keys_to_shard)}"
            )
        if len(args) != len(keys):
            raise ValueError(f"SequenceTiledCompute: {len(args)} values for the {len(keys)} keys {keys}")
        ctx.fn, ctx.reduction, ctx.dim = fn, output_reduction, output_unshard_dimension
        ctx.sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        ctx.passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :]))
        ctx.key, ctx.key_index = grad_requiring_tensor_key, keys.index(grad_requiring_tensor_key)
        ctx.num_args = len(args)
        ctx.bounds = _shard_bounds(seqlen, shards)
        ctx.compute_params = _requiring_grad(compute_params)
        with torch.no_grad():
            outputs = [fn(**_tile(ctx.sharded, start, stop), **ctx.passed) for start, stop in ctx.bounds]
        if output_unshard_dimension == 0:  # one value per tile: stacked, as DeepSpeed does
            outputs = [o.unsqueeze(0) for o in outputs]
        ctx.sizes = [o.shape[output_unshard_dimension] for o in outputs]
        unsharded = torch.cat(outputs, dim=output_unshard_dimension)
        ctx.unsharded_shape = unsharded.shape
        if output_reduction == "mean":
            return unsharded.mean()
        if output_reduction == "sum":
            return unsharded.sum()
        return unsharded

    @staticmethod
    def backward(ctx, grad_output):
        # The gradient of the concatenated output, before the reduction this function applied itself
        if ctx.reduction == "sum":
            grad_output = grad_output.expand(ctx.unsharded_shape)
        elif ctx.reduction == "mean":
            grad_output = (grad_output / math.prod(ctx.unsharded_shape)).expand(ctx.unsharded_shape)
        target = ctx.sharded[ctx.key]
        target_grad = torch.zeros_like(target) if target.requires_grad else None
        offset = 0
        for i, (start, stop) in enumerate(ctx.bounds):
            _mark_grads_ready(ctx.compute_params, i == len(ctx.bounds) - 1)
            tile = _tile(ctx.sharded, start, stop)
            tile[ctx.key] = _leaf_like(tile[ctx.key], target.requires_grad)
            with torch.enable_grad():
                out = ctx.fn(**tile, **ctx.passed)
            grad = grad_output.narrow(ctx.dim, offset, ctx.sizes[i])
            offset += ctx.sizes[i]
            torch.autograd.backward(out, grad.squeeze(0) if ctx.dim == 0 else grad.view_as(out))
            if target_grad is not None and tile[ctx.key].grad is not None:
                target_grad[:, start:stop] = tile[ctx.key].grad
        arg_grads = [None] * ctx.num_args
        arg_grads[ctx.key_index] = target_grad
        return (None,) * 9 + tuple(arg_grads)


def _tile(tensors: dict, start: int, stop: int) -> dict:
    return {k: v[:, start:stop] for k, v in tensors.items()}


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):  # fmt: skip
    """`fn(**kwargs_to_shard tiles, **kwargs_to_pass)` over `shards` tiles of dimension 1 (see
    SequenceTiledCompute); returns the concatenated output, or its mean or sum."""
    return SequenceTiledCompute.apply(
        fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass), grad_requiring_tensor_key,
        compute_params, output_unshard_dimension, output_reduction,
        *kwargs_to_shard.values(), *kwargs_to_pass.values(),
    )  # fmt: skip


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`fn(module, x_tile, y_tile[, mask_tile])` -> a scalar loss per tile of the tokens; returns their mean
    or sum. `x` is [b, s, ...] (typically hidden states, `fn` applying the LM head), `y` [b, s, ...] (shifted
    labels), `mask` None or [b, s]. Only one tile's logits ever exist, in forward and in backward.

    DeepSpeed back-propagates each tile inside forward and only scales the input's gradient by the incoming
    one, so the parameters' gradients miss any scale given to backward (gradient accumulation's 1/steps, a
    loss scale). Here backward recomputes each tile (one more LM-head forward) and propagates the incoming
    gradient to the input and the parameters alike.
    """

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, compute_params, output_reduction):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(
                f"x and y must be at least 2D [batch_size, seq_len, ...], got {x.dim()}D and {y.dim()}D"
            )
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y batch/seq dims must match: {tuple(x.shape)} and {tuple(y.shape)}")
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(
                f"mask must be 2D [batch_size, seq_len] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
            )
        ctx.fn, ctx.module, ctx.shards, ctx.reduction = fn, module, shards, output_reduction
        ctx.compute_params = _requiring_grad(compute_params)
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, mask if mask is not None else torch.empty(0))
        with torch.no_grad():
            losses = torch.stack([fn(module, *tile) for tile in _token_tiles(x, y, mask, shards)])
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx, grad_output):
        x, y, mask = ctx.saved_tensors
        tiles = _token_tiles(x, y, mask if ctx.has_mask else None, ctx.shards)
        # d(mean of the tile losses)/d(tile loss) = 1/tiles: the reduction is applied here, not by autograd
        grad = grad_output / len(tiles) if ctx.reduction == "mean" else grad_output
        x_grad = torch.empty_like(x).view(-1, *x.shape[2:]) if x.requires_grad else None
        offset = 0
        for i, (x_tile, *rest) in enumerate(tiles):
            _mark_grads_ready(ctx.compute_params, i == len(tiles) - 1)
            leaf = _leaf_like(x_tile, x.requires_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, leaf, *rest)
            torch.autograd.backward(loss, grad)
            if x_grad is not None:
                x_grad[offset : offset + x_tile.shape[0]].copy_(leaf.grad)
            offset += x_tile.shape[0]
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None, None, None, None


def _token_tiles(x, y, mask, shards: int) -> list[tuple]:
    """`shards` tiles of the flattened [batch x sequence] tokens of x, y and mask (flattened so that a tile is
    contiguous whatever the batch size)."""
    parts = [x.reshape(-1, *x.shape[2:]).chunk(shards), y.reshape(-1, *y.shape[2:]).chunk(shards)]
    if mask is not None:
        parts.append(mask.reshape(-1).chunk(shards))
    return list(zip(*parts))


class AutogradComputeMLP(torch.autograd.Function):
    """`fn(module, x)` recomputed in backward, untiled (DeepSpeed keeps it as the simplest form of TiledMLP)."""

    @staticmethod
    def forward(ctx, fn, module, x):
        ctx.fn, ctx.module = fn, module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(module, x)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        leaf = _leaf_like(x, x.requires_grad)
        with torch.enable_grad():
            out = ctx.fn(ctx.module, leaf)
        torch.autograd.backward(out, grad_output)
        return None, None, leaf.grad
