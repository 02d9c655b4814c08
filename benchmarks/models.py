"""The benchmark models (a GPT family and a parameter-heavy MLP) and their synthetic token data.

Every system builds its model from the same spec with the same seed, and every rank trains on the same
replicated batches (see README.md, "Why replicated data"), so all systems compute the same numbers as the
one-process reference and their final losses must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "MODELS", "Hyper", "ModelSpec", "build_model", "clip_gradients", "make_batches", "make_optimizer", "shard_units",
]  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """A model size: `kind` is "gpt" or "mlp"; `micro_batch` is the default micro-batch per rank."""

    name: str
    kind: str
    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    micro_batch: int


MODELS: dict[str, ModelSpec] = {
    # tiny: the CI smoke run (seconds per job, numbers meaningless)
    "tiny": ModelSpec("tiny", "gpt", vocab=64, dim=32, layers=2, heads=2, seq=16, micro_batch=2),
    "small": ModelSpec("small", "gpt", vocab=1024, dim=256, layers=4, heads=4, seq=128, micro_batch=8),
    "medium": ModelSpec("medium", "gpt", vocab=1024, dim=512, layers=8, heads=8, seq=128, micro_batch=8),
    "large": ModelSpec("large", "gpt", vocab=1024, dim=896, layers=12, heads=14, seq=128, micro_batch=4),
    # parameter-heavy: ~29M parameters and few tokens, so model states dominate memory and communication
    "mlp": ModelSpec("mlp", "mlp", vocab=1024, dim=2048, layers=6, heads=1, seq=16, micro_batch=4),
}


@dataclass(frozen=True)
class Hyper:
    """Optimizer hyper-parameters shared by every system (torch AdamW, fp32)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    impl: str = "fused"  # torch AdamW kernel: "fused", "foreach" or "loop"
    max_grad_norm: float = (
        0.0  # gradient clipping every system applies (the engines' gradient_clipping); 0: off
    )

    def torch_kwargs(self) -> dict:
        kwargs = dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.impl == "fused":
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = self.impl == "foreach"
        return kwargs


def make_optimizer(params, hyper: Hyper) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **hyper.torch_kwargs())


def clip_gradients(params, hyper: Hyper) -> None:
    """The torch systems' side of `max_grad_norm`: torch's own clipping (one foreach norm, one foreach
    scale), so with clipping on every system computes the same numbers as the engines."""
    if hyper.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, hyper.max_grad_norm, foreach=True)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-shaped language model (untied head, so every system sees plain, unshared parameters)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.dim)
        self.pos = nn.Embedding(spec.seq, spec.dim)
        self.blocks = nn.Sequential(*[Block(spec.dim, spec.heads) for _ in range(spec.layers)])
        self.ln_f = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=False)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TokenMLP(nn.Module):
    """Next-token prediction from the current token through a deep, wide MLP: parameters, few activations."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab, spec.dim)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(spec.dim, spec.dim), nn.GELU()) for _ in range(spec.layers)]
        )
        self.head = nn.Linear(spec.dim, spec.vocab)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.head(self.blocks(self.tok(inputs)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    """The model with its initial values drawn from `seed` (identical in every process)."""
    torch.manual_seed(seed)
    return GPT(spec) if spec.kind == "gpt" else TokenMLP(spec)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP2 wraps one by one (the root is wrapped last, around them)."""
    return list(model.blocks)


def make_batches(spec: ModelSpec, micro_batch: int, seed: int, pool: int = 4) -> list[torch.Tensor]:
    """`pool` fixed micro-batches of `seq + 1` tokens, cycled through: learnable, so the loss moves.

    The same on every rank and in every system (replicated data, see the module docstring).
    """
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(spec.vocab, (micro_batch, spec.seq + 1), generator=gen) for _ in range(pool)]
