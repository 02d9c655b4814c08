"""Token routing for Mixture of Experts: the top-1/top-2/top-k gates, `TopKGate` and `MOELayer`.

A gate turns the logits of S tokens over E experts into three things (DeepSpeed's names and shapes):
`combine_weights` (S, E, C) — the weight with which token s reads slot c of expert e's output;
`dispatch_mask` (S, E, C) — where each token is copied to; `l_aux` — the load-balancing loss; and
`exp_counts` (E,) — tokens routed to each expert before any were dropped. C is the capacity, each expert's
number of slots: `max(ceil(S / E * capacity_factor * k), min_capacity)` when tokens are dropped, else the
largest count any expert received on any rank of the expert-parallel group (so every rank exchanges
buffers of one size).

Which tokens an over-full expert keeps: with Random Token Selection (`use_rts`) a random priority; without,
the first tokens in order (top-1 and top-2), or the highest gate values (top-k, k > 2: DeepSpeed's "probs"
policy). DeepSpeed's top-1 without RTS takes `torch.topk` over a 0/1 mask, whose choice among equal values
is unspecified; taking tokens in order gives the same counts and a deterministic choice (docs/compatibility.md).

`MOELayer` dispatches with an all-to-all over the expert-parallel group (`comm.AllToAll`), runs the local
experts, and combines the returned outputs with the gate's weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardspeed import comm as dist
from shardspeed.moe.comm import AllToAll
from shardspeed.moe.sparse_routes import sparse_routes as _sparse_output

__all__ = ["TUTEL_INSTALLED", "MOELayer", "TopKGate", "top1gating", "top2gating", "topkgating"]

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
TUTEL_INSTALLED = False  # DeepSpeed's flag for Tutel's fused dispatch kernels, which are never used here


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * capacity_factor), int(min_capacity))


def _max_over_group(count: int, ep_group) -> int:
    """The largest `count` on any rank of `ep_group` (no-drop capacity must agree across the exchange).
    Through `dist` (shardspeed.comm, DeepSpeed's `sharded_moe.dist`), so the comms logger sees it."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return count
    from shardspeed.comm.collectives import comm_device

    value = torch.tensor([count], dtype=torch.int64, device=comm_device(ep_group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ep_group)
    return int(value.item())


def gumbel_rsample(shape, device) -> Tensor:
    uniform = torch.rand(shape, device=device).clamp_(min=1e-20, max=1 - 1e-7)
    return -torch.log(-torch.log(uniform))


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """The "Jitter" noisy gate: each input element multiplied by a factor drawn from [1-eps, 1+eps)."""
    if epsilon == 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


def _keep_within_capacity(mask: Tensor, capacity: int, priority: Tensor | None) -> Tensor:
    """Keep at most `capacity` tokens per expert: the highest `priority` ones, or the first ones in order."""
    if priority is None:
        return mask * (torch.cumsum(mask, dim=0) <= capacity).to(mask.dtype)
    k = min(capacity, mask.shape[0])
    top = torch.topk(priority, k=k, dim=0)[1]
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def _combine(choices: list[tuple[Tensor, Tensor, Tensor]], capacity: int) -> tuple[Tensor, Tensor]:
    """`choices`: (gate weight per token (S,), expert mask (S, E), slot per token and expert (S, E))."""
    combine = None
    for weight, mask, slots in choices:
        slot_s = torch.sum(slots * mask, dim=1)  # 0 for a dropped token, whose weight is then zero
        gates = weight.unsqueeze(1) * mask.to(weight.dtype)
        term = torch.einsum("se,sc->sec", gates, F.one_hot(slot_s, num_classes=capacity).to(weight.dtype))
        combine = term if combine is None else combine + term
    return combine, combine.bool()


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None, sparse_routes: bool = False, use_tutel: bool = False):  # fmt: skip
    """Top-1 gating. Returns (l_aux, combine_weights, dispatch_mask, exp_counts), or with `sparse_routes`
    (l_aux, capacity, num_experts, indices, locations, gates, exp_counts) (moe/sparse_routes.py)."""
    del use_tutel
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chooser = (
        logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    )
    mask1 = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.to(mask1.dtype).unsqueeze(1)
    exp_counts = torch.sum(mask1, dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = max(1, _max_over_group(int(exp_counts.max()), ep_group))
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    priority = mask1 * torch.rand(mask1.shape, device=logits.device) if use_rts else None
    mask1 = _keep_within_capacity(mask1, capacity, priority)
    slots1 = torch.cumsum(mask1, dim=0) - 1
    weight1 = torch.sum(gates * mask1, dim=1)
    if sparse_routes:
        return _sparse_output([(weight1, mask1, slots1)], capacity, num_experts, l_aux, exp_counts)
    combine, dispatch = _combine([(weight1, mask1, slots1)], capacity)
    return l_aux, combine, dispatch, exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False):  # fmt: skip
    """Top-2 gating: each token to its best expert and (sampled with Gumbel noise, or the) second best."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    mask2 = F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1), num_experts)
    # second choices queue behind every first choice of the same expert
    slots1 = torch.cumsum(mask1, dim=0) - 1
    slots2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (slots1 < capacity).to(mask1.dtype)
        mask2 = mask2 * (slots2 < capacity).to(mask2.dtype)
    else:
        capacity = max(1, _max_over_group(int(exp_counts.max()), ep_group))
    gates1 = torch.sum(gates * mask1, dim=1)
    gates2 = torch.sum(gates * mask2, dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    choices = [(gates1 / denom, mask1, slots1), (gates2 / denom, mask2, slots2)]
    if sparse_routes:
        return _sparse_output(choices, capacity, num_experts, l_aux, exp_counts)
    return (l_aux, *_combine(choices, capacity), exp_counts)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs", sparse_routes: bool = False):  # fmt: skip
    """General top-k gating; an over-full expert keeps its highest-gate tokens ("probs") or its first ones
    ("position"). Gate weights of the kept choices are renormalised to sum to one per token."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.int64).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach()
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        priority = torch.zeros_like(gates).scatter(1, top_idx, top_gate) if drop_policy == "probs" else None
        mask = _keep_within_capacity(mask, capacity, priority)
    else:
        capacity = max(1, _max_over_group(int(exp_counts.max()), ep_group))
    slots = torch.cumsum(mask, dim=0) - 1
    kept = gates * mask
    kept = kept / torch.clamp(kept.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    if sparse_routes:  # one choice per column of top_idx, in order of gate value
        columns = [F.one_hot(top_idx[:, j], num_experts) * mask for j in range(k)]
        choices = [(torch.sum(kept * col, dim=1), col, slots) for col in columns]
        return _sparse_output(choices, capacity, num_experts, l_aux, exp_counts)
    combine = torch.einsum(
        "se,sec->sec", kept, F.one_hot(slots.clamp(min=0), num_classes=capacity).to(kept.dtype)
    )
    combine = combine * mask.unsqueeze(2).to(kept.dtype)
    return l_aux, combine, combine.bool(), exp_counts


class TopKGate(nn.Module):
    """The gate: a bias-free linear map to expert logits (run in fp32), then top-1, top-2 or top-k routing."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True):  # fmt: skip
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False):  # fmt: skip
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens,
                              self.use_rts, self.ep_group, sparse_routes, use_tutel)  # fmt: skip
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling, sparse_routes)  # fmt: skip
        return topkgating(logits, self.k, factor, self.min_capacity, self.drop_tokens, self.ep_group,
                          sparse_routes=sparse_routes)  # fmt: skip


class MOELayer(nn.Module):
    """Route tokens with `gate`, exchange them over the expert-parallel group, run `experts`, combine."""

    def __init__(self, gate: TopKGate, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False):  # fmt: skip
        super().__init__()
        if use_tutel:
            raise NotImplementedError(_TUTEL_MESSAGE)
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: Tensor, **kwargs) -> Tensor:
        hidden = input[0]
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: build the engine with "
                "deepspeed.initialize() first, or call MoE.set_deepspeed_parallelism()"
            )
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else kwargs.get("used_token")
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(tokens, used_token)
        dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(tokens), tokens)
        if self.ep_size > 1:  # one expert-parallel rank exchanges nothing
            dispatched = AllToAll.apply(self.ep_group, dispatched)
        # (ep_size source ranks, local experts, capacity, d_model): each local expert sees every rank's slots
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched)
        if expert_output.shape != dispatched.shape:
            raise ValueError(
                f"MoE experts returned shape {tuple(expert_output.shape)}, expected the input's shape "
                f"{tuple(dispatched.shape)}: an expert must map (..., {d_model}) to (..., {d_model})"
            )
        if self.ep_size > 1:
            expert_output = AllToAll.apply(self.ep_group, expert_output)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined = torch.einsum("sec,ecm->sm", combine_weights.type_as(tokens), expert_output)
        return combined.reshape(hidden.shape)


_TUTEL_MESSAGE = (
    "use_tutel=True: Tutel's fused dispatch kernels are not available in shardspeed (they are a compiled "
    "extension); use use_tutel=False, which routes with the same semantics"
)
