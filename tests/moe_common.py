"""A tiny MoE model, its data, and a one-process reference training loop for the MoE tests."""

from __future__ import annotations

import torch
from torch import nn

from shardspeed.moe.layer import MoE

D, EXPERTS, TOKENS = 8, 4, 6  # hidden size, experts, tokens per sample
LR = 1e-2


class Expert(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class TinyMoE(nn.Module):
    """in-projection -> MoE -> head; the loss adds the load-balancing loss."""

    def __init__(
        self, ep_size: int, k: int, drop_tokens: bool, capacity_factor: float = 1.0, ckpt=False, aux=0.01
    ):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, Expert(), num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=capacity_factor,
                       min_capacity=1, drop_tokens=drop_tokens, use_rts=False,
                       top2_2nd_expert_sampling=False)  # fmt: skip
        self.head = nn.Linear(D, D)
        self.ckpt = ckpt
        self.aux = aux

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        if self.ckpt:
            from shardspeed import checkpointing

            out, l_aux, _ = checkpointing.checkpoint(self.moe, h)
        else:
            out, l_aux, _ = self.moe(h)
        return ((self.head(h + out) - y) ** 2).mean() + self.aux * l_aux


def build(ep_size: int, ep_rank: int, k: int, drop: bool, **kw) -> TinyMoE:
    """Same dense weights everywhere; expert e (global index) gets weights seeded by e."""
    torch.manual_seed(0)
    model = TinyMoE(ep_size, k, drop, **kw)
    local = EXPERTS // ep_size
    with torch.no_grad():
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(100 + ep_rank * local + i)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(steps, batch, TOKENS, D, generator=gen), torch.randn(
        steps, batch, TOKENS, D, generator=gen
    )


def full_state(model: TinyMoE, ep_size: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """The model's weights with local expert indices turned into global ones."""
    local = EXPERTS // ep_size
    out = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if "deepspeed_experts" in parts:
            i = parts.index("deepspeed_experts") + 1
            parts[i] = str(ep_rank * local + int(parts[i]))
        out[".".join(parts)] = t.detach().clone().float()
    return out


def reference_run(k: int, drop: bool, steps: int, micro: int, world: int, clip: float) -> dict:
    """ep 1, one process, plain torch: each global batch as `world` micro-batches of `micro` samples (what
    each rank sees), gradients averaged, clipped over the whole model, Adam."""
    model = build(1, 0, k, drop)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs, ys = data(steps, micro * world)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            sl = slice(r * micro, (r + 1) * micro)
            (model(xs[step, sl], ys[step, sl]) / world).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return full_state(model, 1, 0)
