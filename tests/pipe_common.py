"""Shared pieces of the pipeline tests: a tiny tied-embedding language model as layer specs, its data, and a
plain-PyTorch single-process reference that trains the same layers on the same global batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, SEQ, BASE_SEED = 16, 8, 6, 1234


class Block(nn.Module):
    """A residual tanh MLP block (the pipeline's repeated layer). `calls` counts forwards (recomputation)."""

    calls = 0

    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x):
        Block.calls += 1
        return x + torch.tanh(self.lin(x))


class InfGradOnce(torch.autograd.Function):
    """Identity forward; backward gives the parameter an inf gradient (the input's gradient stays finite)."""

    @staticmethod
    def forward(ctx, x, w):
        return x + 0 * w

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((1,), float("inf"), dtype=grad.dtype)


class Tripwire(nn.Module):
    """A layer whose parameter gets an inf gradient while `armed` (an fp16 overflow on one stage only)."""

    armed = False

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return InfGradOnce.apply(x, self.w) if Tripwire.armed else x + 0 * self.w


def head(embedding: nn.Embedding, x):
    """The tied output projection: logits from the embedding matrix."""
    return x @ embedding.weight.t().to(x.dtype)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(blocks: int = 4, tripwire: bool = False):
    from shardspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN)]
    if tripwire:
        specs.append(LayerSpec(Tripwire))
    specs += [LayerSpec(Block, HIDDEN) for _ in range(blocks)]
    specs.append(TiedLayerSpec("embed", nn.Embedding, VOCAB, HIDDEN, forward_fn=head))
    return specs


def global_batches(steps: int, samples: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token inputs and next-token labels, [steps, samples, SEQ] each."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (steps, samples, SEQ + 1), generator=g)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def replica_iterator(inputs, labels, steps: range, dp_rank: int, dp: int, micro: int, gas: int):
    """What data-parallel replica `dp_rank` reads: micro-batch k of step t is its slice of that micro-step."""
    for t in steps:
        for k in range(gas):
            start = (k * dp + dp_rank) * micro
            yield inputs[t, start : start + micro], labels[t, start : start + micro]


def reference_train(specs, config: dict, inputs, labels, steps: int) -> dict:
    """Plain PyTorch: the same layers (same per-layer seeds), one process, the whole global batch.

    Returns the final parameters by name, each step's mean loss, and the final model's mean loss on batch 0.
    """
    modules, funcs, tied = nn.ModuleDict(), [], {}
    for index, spec in enumerate(specs):
        torch.manual_seed(BASE_SEED + index)
        key = getattr(spec, "key", None)
        if key is not None:
            if key not in tied:
                tied[key] = spec.build()
                modules[f"tied_modules.{key}".replace(".", "/")] = tied[key]
            module = tied[key]
            funcs.append((lambda m, fn: (lambda x: fn(m, x)) if fn else m)(module, spec.forward_fn))
        else:
            module = spec.build()
            modules[str(index)] = module
            funcs.append(module)
    opt_cfg = config["optimizer"]
    optimizer = getattr(torch.optim, opt_cfg["type"])(modules.parameters(), **opt_cfg["params"])
    gas = config["gradient_accumulation_steps"]
    clip = config.get("gradient_clipping", 0.0)
    per_micro = inputs.shape[1] // gas

    def micro_loss(t: int, k: int):
        x = inputs[t, k * per_micro : (k + 1) * per_micro]
        for f in funcs:
            x = f(x)
        return loss_fn(x, labels[t, k * per_micro : (k + 1) * per_micro])

    losses = []
    for t in range(steps):
        total = 0.0
        for k in range(gas):
            loss = micro_loss(t, k) / gas
            loss.backward()
            total += loss.item()
        losses.append(total)
        if clip:
            torch.nn.utils.clip_grad_norm_(modules.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        eval_loss = sum(micro_loss(0, k).item() for k in range(gas)) / gas
    params = {name.replace("/", "."): p.detach().clone() for name, p in modules.named_parameters()}
    return {"params": params, "losses": losses, "eval_loss": eval_loss}
