"""Per-layer settings and state of the two quantizations (weights, activations).

``WeightQuantization`` is one layer's weight schedule: it starts at ``start_bits`` and, once enabled, drops
one bit each time ``quantization_period`` quantization steps have passed, doubling the period after each
drop, until ``target_bits`` (0.18.9's MoQ rule in ``runtime/quantize.py``). That schedule belongs to MoQ
(``quantize_weight_in_forward: false``); a layer quantized in forward, as the config requires, starts at
``target_bits`` (0.18.9's in-forward quantizer uses only ``target_bits``), so nothing steps. With ``fp16_mixed_quantize``
the forward blends ``r * w + (1 - r) * q(w)``, r falling by ``quantize_change_ratio`` per step and reset
to 1 at each drop. ``ActivationQuantization`` holds bits, type and range calibration; its static range lives
in the layer's ``QuantAct`` buffer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shardspeed.utils.logging import log_dist

from .quantizers import Reduce, fake_quantize, straight_through

__all__ = ["ActivationQuantization", "WeightQuantization"]


@dataclass
class WeightQuantization:
    start_bits: int
    target_bits: int
    period: int
    groups: int = 1
    symmetric: bool = True
    stochastic: bool = False
    mixed: bool = False
    change_ratio: float = 0.001
    verbose: bool = False
    # state, saved in the scheduler's state_dict
    bits: int = 0
    steps: int = 0  # quantization steps since the layer's quantization was enabled
    mixed_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not self.bits:
            self.bits = self.start_bits

    def advance(self, name: str = "") -> None:
        """One quantization step (the scheduler calls it after each optimizer step once enabled)."""
        self.steps += 1
        if self.mixed:
            self.mixed_ratio = max(0.0, self.mixed_ratio - self.change_ratio)
        if self.bits > self.target_bits and self.steps >= self.period:
            self.bits -= 1
            self.period *= 2
            self.mixed_ratio = 1.0
            if self.verbose:
                log_dist(
                    f"weight quantization {name}: {self.bits} bits from step {self.steps}, next period {self.period}"
                )

    def apply(self, weight: torch.Tensor, reduce: Reduce) -> torch.Tensor:
        """The weight the forward uses: quantized at the current bits (straight-through gradient)."""
        quantized = fake_quantize(weight, self.bits, self.groups, self.symmetric, self.stochastic, reduce)
        if self.mixed and self.mixed_ratio > 0:
            ratio = self.mixed_ratio
            quantized = straight_through(weight, ratio * weight.detach() + (1 - ratio) * quantized.detach())
        return quantized

    def state(self) -> dict:
        return {
            "bits": self.bits,
            "period": self.period,
            "steps": self.steps,
            "mixed_ratio": self.mixed_ratio,
        }

    def load_state(self, state: dict) -> None:
        self.bits, self.period = int(state["bits"]), int(state["period"])
        self.steps, self.mixed_ratio = int(state["steps"]), float(state["mixed_ratio"])

    def settings(self) -> dict:
        return asdict(self)


@dataclass
class ActivationQuantization:
    bits: int
    symmetric: bool
    static: bool

    @property
    def method(self) -> str:
        """DeepSpeed's ``activation_quantization_method`` string, e.g. "symmetric_dynamic"."""
        return f"{'symmetric' if self.symmetric else 'asymmetric'}_{'static' if self.static else 'dynamic'}"
