"""A tiny Mixtral-like model (Hugging Face's fused expert layout, Transformers 5) for the AutoEP tests, its
data, and a one-process reference training loop in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, FFN, EXPERTS, TOP_K, TOKENS = 8, 12, 4, 2, 5  # hidden, expert hidden, experts, top-k, tokens per sample
LR = 1e-2


class MixtralConfigLike:
    model_type = "mixtral"
    num_local_experts = EXPERTS
    num_experts_per_tok = TOP_K


class FusedExperts(nn.Module):
    """Transformers 5's Mixtral experts: gate_up_proj [E, 2*ffn, hidden], down_proj [E, hidden, ffn]."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * FFN, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, H, FFN) * 0.3)


class MixtralBlockLike(nn.Module):
    """Softmax router, top-2, weights renormalised; each expert SwiGLU — computed token by token."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, EXPERTS, bias=False)
        self.experts = FusedExperts()

    def forward(self, x):
        flat = x.reshape(-1, H)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = torch.topk(probs, TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        rows = []
        for t in range(flat.shape[0]):
            out = flat.new_zeros(H)
            for k in range(TOP_K):
                e = chosen[t, k]
                gate, up = (self.experts.gate_up_proj[e] @ flat[t]).chunk(2)
                out = out + weights[t, k] * (self.experts.down_proj[e] @ (F.silu(gate) * up))
            rows.append(out)
        return torch.stack(rows).reshape(x.shape)


class TinyMixtral(nn.Module):
    """in-projection -> one MoE block (at model.layers.0.mlp, Mixtral's path) -> head; MSE loss."""

    def __init__(self):
        super().__init__()
        self.config = MixtralConfigLike()
        self.inp = nn.Linear(H, H)
        self.model = nn.Module()
        layer = nn.Module()
        layer.mlp = MixtralBlockLike()
        self.model.layers = nn.ModuleList([layer])
        self.head = nn.Linear(H, H)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        return ((self.head(h + self.model.layers[0].mlp(h)) - y) ** 2).mean()


def build() -> TinyMixtral:
    torch.manual_seed(0)
    return TinyMixtral()


def data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(steps, batch, TOKENS, H, generator=gen), torch.randn(
        steps, batch, TOKENS, H, generator=gen
    )


def grouped_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Dense weights, and the experts as AutoEP's w1/w2/w3 over all experts (global order)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if "experts" not in name:
            state[name.replace(".mlp.gate.", ".mlp.router.gate.")] = tensor.detach().clone()
    experts = model.model.layers[0].mlp.experts
    if hasattr(experts, "gate_up_proj"):
        gate_up = experts.gate_up_proj.detach()
        state["w1"], state["w3"] = gate_up[:, :FFN].clone(), gate_up[:, FFN:].clone()
        state["w2"] = experts.down_proj.detach().clone()
    else:
        state.update({n: getattr(experts, n).detach().clone() for n in ("w1", "w2", "w3")})
    return state


def reference_run(steps: int, micro: int, world: int) -> dict[str, torch.Tensor]:
    """One process: each global batch as `world` micro-batches of `micro` samples, gradients averaged, Adam."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs, ys = data(steps, micro * world)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world):
            part = slice(r * micro, (r + 1) * micro)
            (model(xs[step, part], ys[step, part]) / world).backward()
        opt.step()
    return grouped_state(model)
