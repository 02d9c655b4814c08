"""Models and configs for the compression tests.

`Bert` names its layers as DeepSpeed's compression tests do (`layer.N.attention.self.query`,
`attention.output.dense`, `intermediate.dense`, `output.dense`), so 0.18.9's example configs apply as
written; its attention reads the head count from `attention.self.num_attention_heads`, which
redundancy_clean updates after head pruning. `ConvNet` is conv -> batch norm -> conv for channel pruning.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_attention_heads = heads
        self.all_head_size = dim
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.num_attention_heads
        q, k, v = (m(x).view(b, t, heads, -1).transpose(1, 2) for m in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, self.all_head_size)


class Output(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.dense = nn.Linear(dim_in, dim_out)
        self.LayerNorm = nn.LayerNorm(dim_out)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.self = SelfAttention(dim, heads)
        self.output = Output(dim, dim)

    def forward(self, x):
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, 4 * dim)

    def forward(self, x):
        return F.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention = Attention(dim, heads)
        self.intermediate = Intermediate(dim)
        self.output = Output(4 * dim, dim)

    def forward(self, x):
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class Bert(nn.Module):
    """A small BERT-style causal LM; called with tokens [B, T+1] it returns the next-token loss."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.layer = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.classifier = nn.Linear(dim, vocab)

    def logits(self, tokens):
        x = self.embeddings(tokens)
        for layer in self.layer:
            x = layer(x)
        return self.classifier(x)

    def forward(self, tokens):
        logits = self.logits(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv2(F.relu(self.bn1(self.conv1(x))))


def group(params: dict, modules, related=None) -> dict:
    entry = {"params": params, "modules": list(modules)}
    if related is not None:
        entry["related_modules"] = related
    return entry


def technique(shared: dict, **groups) -> dict:
    return {"shared_parameters": {"enabled": True, **shared}, "different_groups": groups}


def weight_technique(shared: dict, **groups) -> dict:
    """Weight quantization, in forward (the path shardspeed builds; false is refused)."""
    return technique({"quantize_weight_in_forward": True, **shared}, **groups)


def every_technique(offset: int = 0, sparse: str = "topk", row: str = "l1", head: str = "topk",
                    wq: dict | None = None, aq: str = "dynamic") -> dict:  # fmt: skip
    """Weight and activation quantization, sparse, row and head pruning on `Bert`, all from step `offset`."""
    return {
        "weight_quantization": weight_technique(
            {
                "schedule_offset": offset,
                "quantize_groups": 4,
                "quantization_type": "asymmetric",
                **(wq or {}),
            },
            wq1=group({"start_bits": 8, "target_bits": 8}, ["attention.self"]),
            wq2=group(
                {"start_bits": 4, "target_bits": 4},
                ["attention.output", "intermediate", r"layer\.\d+\.output"],
            ),
        ),
        "activation_quantization": technique(
            {"schedule_offset": offset, "range_calibration": aq}, aq1=group({"bits": 8}, ["intermediate"])
        ),
        "sparse_pruning": technique(
            {"schedule_offset": offset, "method": sparse}, sp1=group({"dense_ratio": 0.5}, ["attention.self"])
        ),
        "row_pruning": technique(
            {"schedule_offset": offset, "method": row},
            rp1=group({"dense_ratio": 0.5}, ["intermediate.dense"], [[r"layer\.\d+\.output\.dense"]]),
        ),
        "head_pruning": technique(
            {"schedule_offset": offset, "method": head, "num_heads": 4},
            hp1=group(
                {"dense_ratio": 0.5}, ["attention.output.dense"], [["self.query", "self.key", "self.value"]]
            ),
        ),
    }


def ds_config(compression: dict, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,  # SGD is elementwise: shards step as whole tensors would
        "compression_training": compression,
    }
    config.update(extra)
    return config


def batches(steps: int, batch: int = 4, seq: int = 9, vocab: int = 64, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=generator) for _ in range(steps)]


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
