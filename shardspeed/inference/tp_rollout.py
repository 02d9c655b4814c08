"""Tensor-parallel generation inside the hybrid engine (``hybrid_engine.inference_tp_size`` > 1).

DeepSpeed-Chat's actor trains under ZeRO-3, each data-parallel rank holding a slice of every weight. For
rollouts DeepSpeed's hybrid engine puts the model back together differently: consecutive ranks form groups
of ``inference_tp_size``, and inside a group each rank keeps only its tensor-parallel shard of every layer
(its heads of q/k/v and their columns of o_proj, its columns of gate/up and rows of down_proj). The layers
are gathered ``tp_gather_partition_size`` at a time, split, and let go before the next group is gathered,
so the whole model is never whole on a rank. The group then decodes its ranks' prompts as one batch (each
rank's prompts all-gathered) with one all-reduce after o_proj and one after down_proj per layer and token,
and each rank keeps its own rows of the result. Afterwards the shards are dropped and training continues
ZeRO-3 partitioned, from weights nothing here wrote.

Per rank this holds, for the call: its 1/tp of the layers' linear weights (copies: the model's parameters
are never rebound, the optimizer and ZeRO hold them by identity), copies of the layers' norms, and the
parameters outside the layers (embedding, final norm, LM head) gathered whole, as DeepSpeed holds them.
``TensorParallelSplit.held`` reports those bytes for the last call. LoRA linears (lora.py) are split with
their low-rank term folded in, as DeepSpeed fuses LoRA before it slices.

The split is what module_inject's AutoTP does for inference (``shard_tensor`` over a ``TPPartition``), on
copies made while a layer group is gathered; the decode is ``FastDecoder`` over those ``LayerParts``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardspeed.module_inject.layers import TPPartition, shard_tensor

from .decoder import FastDecoder, LayerParts, _direct, _rms_norm
from .fusion import FusedLinear
from .lora import fused_weight, is_lora_linear

__all__ = ["TensorParallelSplit"]


class _RowParallel:
    """A row-parallel linear over a shard copy: this rank's input columns, partial products summed over
    the tensor group (one all-reduce), the bias added once after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        self.weight, self.bias, self.group = weight, bias, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out + self.bias if self.bias is not None else out


def _weight_and_bias(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linear's effective weight (LoRA folded in) and bias, as they are now (the layer is gathered)."""
    weight = fused_weight(linear) if is_lora_linear(linear) else linear.weight.detach()
    bias = linear.bias.detach() if getattr(linear, "bias", None) is not None else None
    return weight, bias


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class TensorParallelSplit:
    """Splits a Llama-layout model over one tensor group for a ``generate`` call (see the module docstring).

    ``gather(params)`` makes ZeRO-3 parameters whole for a block (``GatheredParameters``: a no-op below
    stage 3); ``hooks_paused()`` stops ZeRO-3's per-module hooks, so calling the embedding and the LM head
    gathers nothing behind the split's back.
    """

    def __init__(self, module: nn.Module, group, partition_size: int,
                 gather: Callable[[list], AbstractContextManager],
                 hooks_paused: Callable[[], AbstractContextManager]):  # fmt: skip
        self.module, self.group, self.partition_size = module, group, partition_size
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.gather, self.hooks_paused = gather, hooks_paused
        self.layers = list(module.model.layers)
        layer_ids = {id(p) for layer in self.layers for p in layer.parameters()}
        self.outside = [p for p in module.parameters() if id(p) not in layer_ids]  # embedding, norm, head
        # bytes of the last call: "whole" (gathered for the decode), "shards" (this rank's 1/tp of the layers'
        # linears), "copies" (the layers' norms), "peak_split" (layer weights whole at once while splitting)
        self.held: dict[str, int] = {}

    @staticmethod
    def check_layout(module: nn.Module, tp_size: int, max_len: int) -> str | None:
        """Why ``module`` cannot be split for generation, or None."""
        if not FastDecoder.supports(module, max_len):
            return "the model is not in the Llama layout the tensor-parallel decode runs"
        for index, layer in enumerate(module.model.layers):
            mlp, attn = layer.mlp, layer.self_attn
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return f"layer {index}'s mlp has no gate_proj/up_proj/down_proj/act_fn"
            for name in (
                "q_proj",
                "k_proj",
            ):  # heads: whole ones per rank (a ZeRO-3 weight's shape is ds_shape)
                weight = getattr(attn, name).weight
                heads = getattr(weight, "ds_shape", weight.shape)[0] // attn.head_dim
                if heads % tp_size:
                    return (
                        f"layer {index}'s {name} has {heads} heads, which do not divide over {tp_size} ranks"
                    )
        return None

    def _heads_check(self, q: int, kv: int, head_dim: int) -> None:
        for what, rows in (("attention heads", q), ("key/value heads", kv)):
            if (rows // head_dim) % self.size:
                raise ValueError(
                    f"hybrid_engine.inference_tp_size: {rows // head_dim} {what} do not divide over "
                    f"{self.size} ranks"
                )

    def _shard(self, weight: torch.Tensor, dim: int) -> torch.Tensor:
        part = TPPartition(dim, (weight.shape[dim],), self.size)
        part.check("hybrid_engine.inference_tp_size")
        shard = shard_tensor(weight, part, self.rank).clone()
        self.held["shards"] += _nbytes([shard])
        return shard

    def _copy(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A whole copy (norms, row-parallel biases: added once after the sum, so not split)."""
        if tensor is None:
            return None
        self.held["copies"] += _nbytes([tensor])
        return tensor.detach().clone()

    def _column(self, linears) -> FusedLinear:
        """Several column-parallel linears (q/k/v, gate/up) as one matmul over this rank's rows of each."""
        pairs = [_weight_and_bias(m) for m in linears]
        weights = [self._shard(w, 0) for w, _ in pairs]
        bias = None
        if any(b is not None for _, b in pairs):  # a missing bias among biased ones: zeros in its place
            bias = torch.cat([self._shard(b, 0) if b is not None else w.new_zeros(w.shape[0])
                              for w, (_, b) in zip(weights, pairs)])  # fmt: skip
        return FusedLinear(list(linears), torch.cat(weights), bias, [w.shape[0] for w in weights], copy=True)

    def _norm(self, norm: nn.Module) -> Callable:
        """The norm over a copy of its parameters (whole: norms are not split)."""
        params = {name: self._copy(p) for name, p in norm.named_parameters()}
        if set(params) == {"weight"}:
            fast = _rms_norm(norm, weight=params["weight"])
            if fast is not norm:
                return fast
        return functools.partial(torch.func.functional_call, norm, params)

    def _split_layer(self, layer: nn.Module) -> LayerParts:
        attn, mlp = layer.self_attn, layer.mlp
        self._heads_check(attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.head_dim)
        o_weight, o_bias = _weight_and_bias(attn.o_proj)
        down_weight, down_bias = _weight_and_bias(mlp.down_proj)
        return LayerParts(
            qkv=self._column([attn.q_proj, attn.k_proj, attn.v_proj]),
            o_proj=_RowParallel(self._shard(o_weight, 1), self._copy(o_bias), self.group),
            gate_up=self._column([mlp.gate_proj, mlp.up_proj]),
            down_proj=_RowParallel(self._shard(down_weight, 1), self._copy(down_bias), self.group),
            act_fn=_direct(mlp.act_fn),
            input_norm=self._norm(layer.input_layernorm),
            post_norm=self._norm(layer.post_attention_layernorm),
        )

    def _split_layers(self) -> list[LayerParts]:
        parts = []
        self.held.update(shards=0, copies=0, peak_split=0)
        for start in range(0, len(self.layers), self.partition_size):
            group = self.layers[start : start + self.partition_size]
            with self.gather([p for layer in group for p in layer.parameters()]):
                # what is whole right now (a released ZeRO-3 parameter's data is empty)
                whole = _nbytes(p for layer in self.layers for p in layer.parameters())
                self.held["peak_split"] = max(self.held["peak_split"], whole)
                parts.extend(self._split_layer(layer) for layer in group)
        return parts

    @contextlib.contextmanager
    def split(self):
        """Inside: the parameters outside the layers whole, and every layer's ``LayerParts`` (yielded)."""
        with torch.no_grad(), self.hooks_paused(), self.gather(self.outside):
            self.held = {"whole": _nbytes(self.outside)}
            yield self._split_layers()

    def gather_inputs(self, input_ids: torch.Tensor, mask: torch.Tensor | None):
        """The group's prompts as one batch, in group-rank order (every rank's must have the same shape)."""
        shape = torch.tensor(input_ids.shape, device=input_ids.device)
        shapes = [torch.empty_like(shape) for _ in range(self.size)]
        dist.all_gather(shapes, shape, group=self.group)
        if any(not torch.equal(s, shape) for s in shapes):
            raise ValueError(
                "hybrid_engine.inference_tp_size: the ranks of a tensor group decode their prompts as one batch, "
                f"so they must be the same shape; got {[tuple(s.tolist()) for s in shapes]} (pad the prompts "
                "to one length, as DeepSpeed-Chat's DataCollatorRLHF does)"
            )
        mask = torch.ones_like(input_ids) if mask is None else mask.to(input_ids.dtype)
        return self._all_gather(input_ids), self._all_gather(mask)

    def _all_gather(self, rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty((rows.shape[0] * self.size, *rows.shape[1:]))
        dist.all_gather_into_tensor(out, rows.contiguous(), group=self.group)
        return out

    def own_rows(self, tokens: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's rows of the group's result."""
        return tokens[self.rank * batch : (self.rank + 1) * batch]
