"""Mixed precision: which dtypes a run uses, and the fp16 loss scaler.

DeepSpeed's contract, kept here: with fp16 or bf16 enabled the module's parameters are cast to that dtype
(users feed half-precision inputs), the optimizer works on fp32 master copies, and fp16 multiplies the loss
by a scale so small gradients survive the backward pass. The scaler below is DeepSpeed's state machine
(reference §2.2): an overflowing step is skipped and the scale halves once hysteresis runs out; after
`loss_scale_window` clean steps it doubles. As in DeepSpeed 0.19, a step whose gradients hold inf or nan is
skipped under fp16 (dynamic or static scale) and, unless `bf16.check_grad_overflow` is false, under bf16.

With `torch_autocast` the parameters stay fp32 and the forward runs under torch.autocast (runtime/autocast.py);
gradients are communicated in fp32 except those of the lower-precision-safe modules (their `comm_dtype`
mark), and an fp16 autocast scales the loss with the same dynamic scaler.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes of one run: parameters/activations, gradient accumulation and communication."""

    param_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    check_overflow: bool = False
    """Skip a step whose gradients hold inf/nan (fp16; bf16 with check_grad_overflow; fp16 autocast)."""
    loss_scaling: bool = False
    """Scale the loss (fp16, or an fp16 torch.autocast)."""

    @property
    def mixed(self) -> bool:
        """True when fp32 master weights live beside lower-precision module parameters."""
        return self.param_dtype != torch.float32

    @classmethod
    def from_config(cls, cfg, sequence_parallel: bool = False) -> PrecisionPlan:
        """`sequence_parallel`: gradients are then communicated in `seq_parallel_communication_data_type`,
        which replaces `communication_data_type` (as in DeepSpeed)."""
        autocast = cfg.torch_autocast
        if autocast.enabled:  # fp32 parameters; marked modules communicate in the autocast dtype
            fp16_autocast = autocast.dtype == "fp16"
            return cls(torch.float32, torch.float32, torch.float32, fp16_autocast, fp16_autocast)
        if cfg.fp16.enabled:
            param = torch.float16
        elif cfg.bf16.enabled:
            param = torch.bfloat16
        else:
            param = torch.float32
        accum = cfg.data_types.grad_accum_dtype
        if accum is not None:
            grad_accum = DTYPES[accum]
        elif param == torch.bfloat16 and not cfg.zero_enabled:
            # bf16's 8-bit mantissa loses small contributions when summing micro-batches; DeepSpeed's bf16
            # optimizer accumulates in fp32 for the same reason (reference §2.2).
            grad_accum = torch.float32
        else:
            grad_accum = param
        if sequence_parallel:
            comm = DTYPES[cfg.seq_parallel_communication_data_type]
        else:
            comm = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else grad_accum
        check = cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow)
        return cls(param, grad_accum, comm, check, cfg.fp16.enabled)


def make_scaler(fp16_cfg, plan: PrecisionPlan) -> LossScaler:
    """The run's scaler from the `fp16` block: DeepSpeed's loss scaler for fp16 (and an fp16 autocast, whose
    fp16 block holds DeepSpeed's defaults), else a scale of 1 that still skips non-finite steps where the
    plan says so."""
    if plan.loss_scaling:
        return LossScaler.from_config(fp16_cfg)
    return NoScaler(check_overflow=plan.check_overflow)


class LossScaler:
    """DeepSpeed's dynamic loss scaler (or a static scale when `dynamic` is False).

    `update(overflow)` is called once per optimizer step with the overflow flag agreed by all ranks.
    """

    check_overflow = (
        True  # fp16 steps with inf/nan gradients are skipped, whether the scale is dynamic or not
    )

    def __init__(
        self,
        init_scale: float = 2.0**16,
        dynamic: bool = True,
        scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
    ):
        self.cur_scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = scale_factor
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis

    @classmethod
    def from_config(cls, fp16_cfg) -> LossScaler:
        if fp16_cfg.loss_scale > 0:
            return cls(init_scale=fp16_cfg.loss_scale, dynamic=False)
        return cls(
            init_scale=2.0**fp16_cfg.initial_scale_power,
            scale_window=fp16_cfg.loss_scale_window,
            hysteresis=fp16_cfg.hysteresis,
            consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
            min_scale=fp16_cfg.min_loss_scale,
        )

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.float() * self.cur_scale

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16 loss scale is already at its minimum ({self.min_scale}) and gradients still "
                        "overflow: the model's values do not fit fp16 (a model pretrained in bf16 often "
                        "doesn't). Use bf16, or lower fp16.min_loss_scale / raise fp16.hysteresis."
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.cur_hysteresis = int(state["cur_hysteresis"])


class NoScaler(LossScaler):
    """fp32 and bf16 need no loss scaling: a scale of exactly 1 that never changes. `check_overflow`: skip
    steps with inf/nan gradients (bf16's `check_grad_overflow`)."""

    def __init__(self, check_overflow: bool = False):
        super().__init__(init_scale=1.0, dynamic=False)
        self.check_overflow = check_overflow

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def step_multiplier(scaled_norm: float, scaler: LossScaler, clip: float) -> tuple[bool, float, float]:
    """From the global norm of the scaled gradients: (overflow, true norm, gradient multiplier).

    The multiplier folds loss unscaling and clipping (DeepSpeed's `k = max(1, norm / clip)`, which equals
    torch's `clip / (norm + 1e-6)` coefficient) into one number. On overflow (inf/nan where the scaler checks
    for it) the scaler is updated here and the step must be skipped.
    """
    if not math.isfinite(scaled_norm) and scaler.check_overflow:
        scaler.update(True)
        return True, scaled_norm, 0.0
    norm = scaled_norm / scaler.loss_scale
    multiplier = 1.0 / scaler.loss_scale
    if clip > 0 and clip / (norm + 1e-6) < 1.0:
        multiplier *= clip / (norm + 1e-6)
    return False, norm, multiplier


def _kernel_unscales(optimizer: torch.optim.Optimizer) -> bool:
    """True when every group steps in a torch fused kernel that divides gradients by `grad_scale`."""
    own_update = getattr(optimizer, "_needs_own_update", None)
    return (
        getattr(optimizer, "_step_supports_amp_scaling", False)
        and all(group.get("fused") for group in optimizer.param_groups)
        and not (own_update is not None and own_update())
    )


@contextlib.contextmanager
def unscaled_in_kernel(optimizer: torch.optim.Optimizer, multiplier: float, grads: list[torch.Tensor]):
    """Apply the gradient `multiplier` (unscaling and clipping) during the step inside this context.

    torch's fused kernels take a `grad_scale` tensor — the hook `torch.amp.GradScaler` uses — and divide each
    gradient by it as they read it, which saves a full read and write of every gradient before the step
    (a third of the step's memory traffic for Adam). Other optimizers get the gradients multiplied first.
    """
    if multiplier == 1.0 or not grads:
        yield
        return
    # A multiplier of 0 (clipping an inf norm when overflow checks are off) has no reciprocal: multiply
    # (inf * 0 = nan reaches the parameters, as in DeepSpeed, instead of a ZeroDivisionError)
    if not _kernel_unscales(optimizer) or multiplier == 0.0 or not math.isfinite(multiplier):
        torch._foreach_mul_(grads, multiplier)
        yield
        return
    optimizer.grad_scale = torch.tensor(1.0 / multiplier, dtype=torch.float32, device=grads[0].device)
    try:
        yield
    finally:
        del optimizer.grad_scale
