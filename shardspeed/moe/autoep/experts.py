"""AutoEP's grouped experts: one rank's experts as three stacked weights, run over tokens sorted by expert.

`w1` (gate) and `w3` (up) are `[E, hidden, dim]`, `w2` (down) is `[E, dim, hidden]`; expert `e` computes
`w2[e] @ act(w1[e] @ x, w3[e] @ x)`. Tokens arrive grouped by expert, `num_tokens_per_expert[e]` rows each.
`use_grouped_mm` runs each projection as one `torch._grouped_mm` over all experts (needs row strides that are a
multiple of 16 bytes); otherwise a loop over experts runs the same products one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EXPERT_ACTIVATIONS", "FusedExpertLayout", "GroupedExperts", "classify_fused_gate_up_layout"]


def _swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return F.silu(gate) * up


def _geglu_tanh(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def _swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's form: clamped, `gate * sigmoid(alpha * gate)`, and the up projection offset by one."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


#: Expert MLP activations by name: `fn(gate, up, alpha, limit)`.
EXPERT_ACTIVATIONS: dict[str, Callable] = {
    "swiglu": _swiglu,
    "geglu_tanh": _geglu_tanh,
    "swiglu_clamped": _swiglu_clamped,
    "swiglu_oai": _swiglu_oai,
}


@dataclass(frozen=True)
class FusedExpertLayout:
    """How a fused gate+up expert weight is laid out, read from its shape."""

    layout: str  # "gate_up_first": [E, 2*ffn, hidden]; "hidden_first": [E, hidden, 2*ffn]
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: tuple, w2_shape: tuple) -> FusedExpertLayout | None:
    """The layout of fused `gate_up` `w1_shape` given `down` `w2_shape`, or None when the shapes fit neither."""
    if len(w1_shape) != 3 or len(w2_shape) != 3:
        return None
    _, rows, cols = w1_shape
    if rows % 2 == 0 and tuple(w2_shape[1:]) == (cols, rows // 2):
        return FusedExpertLayout("gate_up_first", cols, rows // 2, False)
    if cols % 2 == 0 and tuple(w2_shape[1:]) == (cols // 2, rows):
        return FusedExpertLayout("hidden_first", rows, cols // 2, True)
    return None


class GroupedExperts(nn.Module):
    """`num_experts` gated MLPs `dim -> hidden_dim -> dim`, stored stacked."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        disable_triton_grouped_mm: bool = False,
        activation: str = "swiglu",
        activation_alpha: float = 1.702,
        activation_limit: float = 7.0,
        gate_up_impl: str = "separate",
    ) -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"unknown expert activation {activation!r}; expected one of {tuple(EXPERT_ACTIVATIONS)}"
            )
        if gate_up_impl not in ("separate", "fused"):
            raise ValueError(f'gate_up_impl must be "separate" or "fused", got {gate_up_impl!r}')
        if use_grouped_mm and not hasattr(torch, "_grouped_mm"):
            raise RuntimeError("use_grouped_mm=True needs torch._grouped_mm; set use_grouped_mm=False")
        if gate_up_impl == "fused" and not use_grouped_mm:
            raise ValueError('gate_up_impl="fused" needs use_grouped_mm=True')
        self.activation = activation
        self.activation_alpha = activation_alpha
        self.activation_limit = activation_limit
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.use_triton_grouped_mm = (
            False  # no Triton kernels here; disable_triton_grouped_mm changes nothing
        )
        self.gate_up_impl = gate_up_impl
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        for weight in (self.w1, self.w2, self.w3):
            weight.is_expert_group = True  # per-expert matrices (Muon orthogonalises each one)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return EXPERT_ACTIVATIONS[self.activation](gate, up, self.activation_alpha, self.activation_limit)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.reshape(-1)
        if counts.numel() != self.num_experts:
            raise ValueError(
                f"num_tokens_per_expert has {counts.numel()} entries for {self.num_experts} experts"
            )
        if self.use_grouped_mm:
            return self._grouped(x, counts)
        outputs = []
        for expert, rows in enumerate(torch.split(x, counts.tolist(), dim=0)):
            hidden = self._act(rows @ self.w1[expert].t(), rows @ self.w3[expert].t())
            outputs.append(hidden @ self.w2[expert].t())
        return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, self.w2.shape[1])

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts.to(torch.int32), dim=0, dtype=torch.int32)
        if self.gate_up_impl == "fused":
            gate_up = torch._grouped_mm(
                x, torch.cat((self.w1, self.w3), dim=1).transpose(-2, -1), offs=offsets
            )
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets)
            up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        hidden = self._act(gate, up).to(x.dtype)
        return torch._grouped_mm(hidden, self.w2.transpose(-2, -1), offs=offsets)
