"""AutoTP: find the linear layers of a model's transformer blocks and shard them over a tensor group.

`shard_model(model, tp_group)` walks the model once and decides, per linear layer (`nn.Linear` or Hugging
Face's transposed `Conv1D`), one of three placements:

- column (`LinearLayer`): q/k/v, gate/up, fc_in — and the fused projections (GPT-2 `c_attn`, `qkv_proj`,
  `Wqkv` as [q; k; v] with GQA-sized parts; `gate_up_proj` as [gate; up]);
- row (`LinearAllreduce`): o/out projections, down, fc_out, GPT-2's `c_proj`;
- replicated: linears outside the repeated blocks (a classifier, the LM head unless vocabulary-parallel).

Names follow LLaMA/Mistral/Qwen2 (`q_proj`...`down_proj`), GPT-2 (`c_attn`, `c_proj`, `c_fc`), OPT
(`out_proj`, `fc1`, `fc2`), GPT-J (`fc_in`, `fc_out`), BERT (`query`/`key`/`value`, `intermediate.dense`,
`output.dense`), Falcon/NeoX MLPs (`dense_h_to_4h`, `dense_4h_to_h`) and Meta's (`wq`...`w3`).
`layer_specs` (DeepSpeed's `tensor_parallel.partition_config.layer_specs`: `{"patterns": [regex],
"partition_type": "column"|"row"|"skip", "shape": ...}`) are tried first and override the names.

A spec's `gather_output` makes a column layer all-gather its output (every rank gets all features: an
untied LM head); its `grad_allreduce` makes a skipped layer's parameters sum their gradients over the tensor
group (a norm over sharded heads sees only this rank's heads). A column spec on a linear whose weight is
tied to another module (an LM head sharing the embedding's weight) keeps it whole: sharding one side of a
tie would untie it.

A linear inside a block (a name with a numeric index, as `layers.3.mlp.gate`) that matches no rule is an
error naming it — replicating it silently could make a row layer's input half of what it expects — unless
the rules are the model's own complete plan (`replicate_unmatched=True`, a Hugging Face tp_plan), which
leaves out on purpose what it does not name. Heads:
the attention module that owns sharded q/k/v has its head-count attributes (`num_heads`, `n_head`,
`num_key_value_heads`, `split_size`, ...) divided by the tensor size, after checking they divide.

Works on a meta-device model too (shards are views of nothing until weights are loaded into them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from shardspeed.config.tensor_parallel import PartitionRule, parse_layer_specs
from shardspeed.module_inject.layers import LinearAllreduce, LinearLayer, TPPartition
from shardspeed.module_inject.tp_comm import SharedInputCopy, group_size, sum_gradient_over_group
from shardspeed.module_inject.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead

__all__ = ["TPReport", "shard_model"]

COLUMN_NAMES = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "q", "k", "v",
                "gate_proj", "up_proj", "w1", "w3", "fc_in", "fc1", "c_fc", "dense_h_to_4h"}  # fmt: skip
ROW_NAMES = {"o_proj", "out_proj", "o", "wo", "down_proj", "w2", "fc_out", "fc2", "dense_4h_to_h", "c_proj"}
FUSED_QKV_NAMES = {"c_attn", "qkv_proj", "Wqkv", "qkv"}
FUSED_GATE_UP_NAMES = {"gate_up_proj"}
KV_NAMES = {"k_proj", "v_proj", "key", "value", "wk", "wv", "k", "v"}
Q_NAMES = {"q_proj", "query", "wq", "q"}
# Attributes of an attention module that count its heads (divided by tp when its q/k/v are sharded)
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
WIDTH_ATTRS = ("split_size", "all_head_size")  # widths of the local q/k/v (GPT-2 splits c_attn by it; BERT)
LM_HEAD_NAMES = {"lm_head", "embed_out", "output"}


@dataclass
class TPReport:
    """What `shard_model` did, by module name."""

    tp_size: int
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)  # linears left whole (outside blocks, or "skip")
    vocab_parallel: list[str] = field(default_factory=list)
    gathered: list[str] = field(default_factory=list)  # column layers whose output is all-gathered
    grad_summed: list[str] = field(default_factory=list)  # replicated layers whose gradients are summed
    heads_divided: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> {attr: local value}

    def summary(self) -> str:
        return (f"AutoTP tp={self.tp_size}: {len(self.column)} column, {len(self.row)} row, "
                f"{len(self.vocab_parallel)} vocabulary-parallel, {len(self.replicated)} replicated linears")  # fmt: skip


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's `Conv1D` (GPT-2): a linear with weight [in, out]; recognised without importing it."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def _in_block(name: str) -> bool:
    return any(part.isdigit() for part in name.split("."))


def _default_kind(name: str) -> tuple[str, str | None] | None:
    """(placement, fused kind) from the module's name, or None when the name says nothing."""
    parts = name.split(".")
    leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
    if leaf in FUSED_QKV_NAMES:
        return "column", "qkv"
    if leaf in FUSED_GATE_UP_NAMES:
        return "column", "gate_up"
    if leaf in COLUMN_NAMES:
        return "column", None
    if leaf in ROW_NAMES:
        return "row", None
    if leaf == "dense":  # BERT: intermediate.dense (column); attention.output.dense / output.dense (row)
        if parent == "intermediate":
            return "column", None
        if parent in ("output", "self_attn", "attention", "attn"):
            return "row", None
    return None


def _spec_for(name: str, specs: list[PartitionRule], model_type: str | None = None) -> PartitionRule | None:
    for spec in specs:
        if spec.applies_to(model_type) and any(
            p.match(name) or p.match(name + ".weight") for p in spec.patterns
        ):
            return spec
    return None


def _tied_weights(model: nn.Module) -> set[int]:
    """ids of the weights that more than one module holds (tied input/output embeddings)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders[id(weight)] = holders.get(id(weight), 0) + 1
    return {key for key, count in holders.items() if count > 1}


def _attr(module: nn.Module, names) -> tuple[str, int] | None:
    for n in names:
        value = getattr(module, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return n, value
    return None


class _Sharder:
    def __init__(self, model: nn.Module, group, specs: list[PartitionRule], use_defaults: bool,
                 replicate_unmatched: bool = False):  # fmt: skip
        self.model, self.group, self.specs, self.use_defaults = model, group, specs, use_defaults
        self.replicate_unmatched = replicate_unmatched
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.tp = group_size(group)
        self.rank = dist.get_rank(group) if self.tp > 1 else 0
        self.report = TPReport(self.tp)
        self.modules = dict(model.named_modules())
        self.input_copy = SharedInputCopy()  # column layers reading one input all-reduce its gradient once

    def plan(self) -> dict[str, tuple[str, str | None, PartitionRule | None]]:
        plan, unplaced = {}, []
        tied = _tied_weights(self.model)
        for name, module in self.modules.items():
            if not _is_linear(module):
                continue
            spec = _spec_for(name, self.specs, self.model_type)
            if spec is not None and spec.kind != "skip" and id(module.weight) in tied:
                plan[name] = ("skip", None, None)  # sharding one side of a tie would untie it: keep it whole
                continue
            if spec is not None:  # the name's fused kind still applies (heads checked and divided)
                default = _default_kind(name)
                plan[name] = (spec.kind, default[1] if default and default[0] == spec.kind else None, spec)
                continue
            kind = _default_kind(name) if self.use_defaults and _in_block(name) else None
            if kind is not None:
                plan[name] = (*kind, None)
            elif _in_block(name) and not self.replicate_unmatched:
                unplaced.append(name)
            else:
                plan[name] = ("skip", None, None)
        if unplaced:
            raise ValueError(
                f"AutoTP cannot place {len(unplaced)} linear layer(s) inside the model's blocks: "
                f"{', '.join(unplaced)}. Name them in tensor_parallel.partition_config.layer_specs "
                '(partition_type "column", "row", or "skip" to keep them whole on every rank).'
            )
        return plan

    def parent(self, name: str) -> tuple[str, nn.Module]:
        parent_name = name.rpartition(".")[0]
        return parent_name, self.modules[parent_name] if parent_name else self.model

    def check_heads(self, name: str, fused: str | None) -> None:
        parent_name, parent = self.parent(name)
        leaf = name.rpartition(".")[2]
        checks = []
        if fused == "qkv" or leaf in Q_NAMES:
            checks.append(_attr(parent, HEAD_ATTRS))
        if fused == "qkv" or leaf in KV_NAMES:
            checks.append(_attr(parent, KV_HEAD_ATTRS) or _attr(parent, HEAD_ATTRS))
        for found in filter(None, checks):
            attr, value = found
            if value % self.tp:
                raise ValueError(
                    f"{parent_name or 'model'}.{attr} = {value} (heads of {name}) is not divisible by the "
                    f"tensor-parallel size {self.tp}"
                )

    def segments(
        self, name: str, module: nn.Module, fused: str | None, spec: PartitionRule | None, size: int
    ):
        wanted = spec.segments if spec is not None else None
        if isinstance(wanted, tuple):
            if sum(wanted) != size:
                raise ValueError(
                    f"{name}: layer_specs shape parts {list(wanted)} do not add up to its {size} outputs"
                )
            return wanted
        count = wanted if isinstance(wanted, int) else {"qkv": 3, "gate_up": 2}.get(fused, 1)
        if fused == "qkv" and wanted is None:
            return self.qkv_segments(name, size)
        if size % count:
            raise ValueError(f"{name}: {size} outputs do not split into {count} equal fused parts")
        return (size // count,) * count

    def qkv_segments(self, name: str, size: int) -> tuple[int, ...]:
        _, parent = self.parent(name)
        heads, kv = _attr(parent, HEAD_ATTRS), _attr(parent, KV_HEAD_ATTRS)
        if heads and kv and kv[1] != heads[1]:  # GQA: [q (H*d); k (KV*d); v (KV*d)]
            head_dim = size // (heads[1] + 2 * kv[1])
            return heads[1] * head_dim, kv[1] * head_dim, kv[1] * head_dim
        return (size // 3,) * 3

    def shard_linear(self, name: str, module: nn.Module, kind: str, fused, spec) -> nn.Module:
        transposed = _is_conv1d(module)
        if kind == "column":
            self.check_heads(name, fused)
            out_dim = 1 if transposed else 0
            segments = self.segments(name, module, fused, spec, module.weight.shape[out_dim])
            TPPartition(out_dim, segments, self.tp).check(f"{name} (column-parallel output features)")
            self.report.column.append(name)
            layer = LinearLayer.from_module(module, self.group, self.rank, segments, transposed)
            layer.input_copy = self.input_copy
            if spec is not None and spec.gather_output:
                if len(segments) > 1:
                    raise ValueError(
                        f"{name}: gather_output cannot gather a fused layer ({len(segments)} parts)"
                    )
                layer.gather_output = True
                self.report.gathered.append(name)
            return layer
        in_dim = 0 if transposed else 1
        TPPartition(in_dim, (module.weight.shape[in_dim],), self.tp).check(
            f"{name} (row-parallel input features)"
        )
        self.report.row.append(name)
        return LinearAllreduce.from_module(module, self.group, self.rank, transposed)

    def divide_heads(self, attention_names: set[str]) -> None:
        for parent_name in sorted(attention_names):
            parent = self.modules[parent_name] if parent_name else self.model
            changed = {}
            for attr in HEAD_ATTRS + KV_HEAD_ATTRS + WIDTH_ATTRS:
                value = getattr(parent, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    if value % self.tp:
                        raise ValueError(
                            f"{parent_name}.{attr} = {value} is not divisible by the tensor-parallel size {self.tp}"
                        )
                    setattr(parent, attr, value // self.tp)
                    changed[attr] = value // self.tp
            if changed:
                self.report.heads_divided[parent_name] = changed


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def shard_model(model: nn.Module, tp_group, *, layer_specs=None, vocab_parallel: bool = False,
                use_default_specs: bool = True, replicate_unmatched: bool = False) -> TPReport:  # fmt: skip
    """Shard `model` in place for this rank's position in `tp_group`; returns what went where.

    `tp_group` of size 1 (or None) changes nothing. `layer_specs` is DeepSpeed's list of
    `{"patterns", "partition_type", "shape", ...}` dicts or `TPLayerSpec`s (tried before the built-in names);
    `replicate_unmatched=True` keeps linears no rule places whole instead of refusing them;
    `vocab_parallel=True` also splits the token embedding and the LM head over the vocabulary (the model
    must then compute its loss with `vocab_parallel_cross_entropy`).
    """
    specs = parse_layer_specs([s.as_dict() if hasattr(s, "as_dict") else s for s in layer_specs or []])
    sharder = _Sharder(model, tp_group, specs, use_default_specs, replicate_unmatched)
    if sharder.tp == 1:
        return sharder.report
    plan = sharder.plan()
    attention_parents = set()
    for name, (kind, fused, spec) in plan.items():
        module = sharder.modules[name]
        leaf = name.rpartition(".")[2]
        if vocab_parallel and leaf in LM_HEAD_NAMES and not _in_block(name) and not _is_conv1d(module):
            continue  # split over the vocabulary with the embedding below (whatever a column rule says)
        if kind == "skip":
            sharder.report.replicated.append(name)
            continue
        layer = sharder.shard_linear(name, module, kind, fused, spec)
        variant = getattr(module, "tensor_parallel_variant", None)  # compression layers keep their techniques
        _replace(model, name, variant(layer, sharder.rank) if variant is not None else layer)
        if kind == "column" and (fused == "qkv" or leaf in Q_NAMES | KV_NAMES | FUSED_QKV_NAMES):
            attention_parents.add(name.rpartition(".")[0])
    sharder.divide_heads(attention_parents)
    _sum_replicated_gradients(model, sharder)
    if vocab_parallel:
        _shard_vocabulary(model, sharder)
    return sharder.report


def _sum_replicated_gradients(model: nn.Module, sharder: _Sharder) -> None:
    """Parameters (of any module: a norm too) that a `grad_allreduce` rule names sum their gradients."""
    rules = [spec for spec in sharder.specs if spec.grad_allreduce and spec.applies_to(sharder.model_type)]
    if not rules:
        return
    for name, param in model.named_parameters():
        if any(p.match(name) for spec in rules for p in spec.patterns):
            sum_gradient_over_group(param, sharder.group)
            sharder.report.grad_summed.append(name)


def _shard_vocabulary(model: nn.Module, sharder: _Sharder) -> None:
    heads = [
        (n, m)
        for n, m in sharder.modules.items()
        if n.rpartition(".")[2] in LM_HEAD_NAMES and isinstance(m, nn.Linear) and not _in_block(n)
    ]
    if len(heads) != 1:
        raise ValueError(
            f"vocab_parallel: expected one LM head (a Linear named {sorted(LM_HEAD_NAMES)}), found "
            f"{[n for n, _ in heads] or 'none'}"
        )
    head_name, head = heads[0]
    vocab = head.weight.shape[0]
    embeddings = [
        (n, m)
        for n, m in sharder.modules.items()
        if isinstance(m, nn.Embedding) and m.num_embeddings == vocab
    ]
    tied = None
    for name, emb in embeddings:
        new_emb = VocabParallelEmbedding.from_module(emb, sharder.group, sharder.rank)
        if head.weight is emb.weight:
            tied = new_emb.weight
        _replace(model, name, new_emb)
        sharder.report.vocab_parallel.append(name)
    TPPartition(0, (vocab,), sharder.tp).check(f"{head_name} (vocabulary-parallel LM head)")
    new_head = VocabParallelLMHead.from_module(head, sharder.group, sharder.rank)
    if tied is not None:
        new_head.weight = tied  # tied input/output embeddings stay one parameter
    _replace(model, head_name, new_head)
    sharder.report.vocab_parallel.append(head_name)
