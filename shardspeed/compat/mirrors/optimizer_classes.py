"""DeepSpeed's optimizer-wrapper classes as `isinstance` checks over the wrappers shardspeed's engine builds.

DeepSpeed returns a different wrapper class per configuration, and user code (and DeepSpeed's own tests)
branch on it: `isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)`. shardspeed has one wrapper
for stage 0 (`DataParallelOptimizer`) and one for stages 1-3 (`ZeroOptimizer`), each knowing its stage and
precision, so each DeepSpeed class here is a check of those facts, true exactly where DeepSpeed 0.19.8
would have built that class:

| DeepSpeed class | shardspeed wrapper, when |
|---|---|
| `runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` | `ZeroOptimizer` at stage 3 with an optimizer |
| `runtime.zero.parameter_offload.DeepSpeedZeRoOffload` | `ZeroOptimizer` at stage 3 built without an optimizer (an evaluation-only engine, such as TRL's reference model), and the `parameter_offload` of any stage-3 wrapper |
| `runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer` | `ZeroOptimizer` at stage 1 or 2, but not the next-but-one row |
| `runtime.fp16.fused_optimizer.FP16_Optimizer` | stage 0, fp16, an Adam-family optimizer |
| `runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer` | stage 0, fp16 with another optimizer (Lamb, ...), or bf16 accumulating in bf16 |
| `runtime.bf16_optimizer.BF16_Optimizer` | bf16 with gradients accumulated in fp32, at stage 0, or at stage 1 without optimizer offload (DeepSpeed's own ZeRO-1 for bf16) |

The checks follow what shardspeed's wrapper does: at stage 0 with bf16, gradients accumulate in fp32 unless
`data_types.grad_accum_dtype` says bf16, so that configuration is a `BF16_Optimizer` (DeepSpeed 0.19.8
accumulates in bf16 there and builds an `FP16_UnfusedOptimizer`). The wrappers are built by `initialize`;
constructing one of these classes directly raises NotOfferedError.
"""

from __future__ import annotations

import torch

from shardspeed.compat.not_offered import NotOfferedError

__all__ = [
    "BF16Optimizer",
    "FP16Optimizer",
    "FP16UnfusedOptimizer",
    "ZeroParameterOffload",
    "ZeroStage3Optimizer",
    "ZeroStage12Optimizer",
]


class _WrapperCheck(type):
    """`isinstance(x, cls)` asks `cls.matches(x)`; calling `cls(...)` is refused (initialize builds wrappers)."""

    def __instancecheck__(cls, instance) -> bool:
        return cls.matches(instance)

    def __call__(cls, *args, **kwargs):
        raise NotOfferedError(
            f"deepspeed's {cls.deepspeed_name} is not constructed directly in shardspeed: deepspeed.initialize "
            f"builds the optimizer wrapper (engine.optimizer), and isinstance(engine.optimizer, "
            f"{cls.__name__}) tells whether it is this kind"
        )


def _stage(wrapper) -> int | None:
    from shardspeed.core.optimizer_wrapper import OptimizerWrapper

    return wrapper.zero_stage if isinstance(wrapper, OptimizerWrapper) else None


def _dtypes(wrapper) -> tuple[torch.dtype, torch.dtype]:
    return wrapper.plan.param_dtype, wrapper.plan.grad_accum_dtype


def _adam_family(wrapper) -> bool:
    return isinstance(wrapper.optimizer, (torch.optim.Adam, torch.optim.AdamW))


class ZeroStage3Optimizer(metaclass=_WrapperCheck):
    deepspeed_name = "runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"

    @staticmethod
    def matches(wrapper) -> bool:
        return _stage(wrapper) == 3 and not wrapper.evaluation_only


class ZeroParameterOffload(metaclass=_WrapperCheck):
    """DeepSpeed builds a `DeepSpeedZeRoOffload` as `engine.optimizer` when ZeRO-3 has no optimizer, and one as
    the stage-3 optimizer's `parameter_offload`; ROLL's offload code branches on it."""

    deepspeed_name = "runtime.zero.parameter_offload.DeepSpeedZeRoOffload"

    @staticmethod
    def matches(wrapper) -> bool:
        from shardspeed.zero.parameter_offload import ParameterOffload

        return isinstance(wrapper, ParameterOffload) or (_stage(wrapper) == 3 and wrapper.evaluation_only)


class _UniversalCheckpointLinks:
    """DeepSpeed's `_enable_universal_checkpoint` of its ZeRO-1/2 and BF16 wrappers, over their own attribute
    (`bit16_groups` / `bf16_groups`: the low-precision parameters by group) on an instance made without
    `__init__` (`object.__new__`, as code driving DeepSpeed's internals does): binds each parameter's
    `load_hp_checkpoint_state` (checkpoint/tp_restore.py) and keeps the first `universal_checkpoint_info`
    a parameter carries (AutoTP puts it there), so `_get_universal_checkpoint_info` still answers after the
    parameters drop it. shardspeed's own wrappers record that info on the model instead."""

    _groups_attribute = ""

    def _enable_universal_checkpoint(self) -> None:
        import types

        from shardspeed.checkpoint.tp_restore import load_hp_checkpoint_state

        self._universal_checkpoint_info = None
        for group in getattr(self, self._groups_attribute):
            for param in group:
                info = getattr(param, "universal_checkpoint_info", None)
                if self._universal_checkpoint_info is None and info is not None:
                    self._universal_checkpoint_info = info
                param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)

    def _get_universal_checkpoint_info(self):
        return getattr(self, "_universal_checkpoint_info", None)


class ZeroStage12Optimizer(_UniversalCheckpointLinks, metaclass=_WrapperCheck):
    _groups_attribute = "bit16_groups"
    deepspeed_name = "runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"

    @staticmethod
    def matches(wrapper) -> bool:
        return _stage(wrapper) in (1, 2) and not BF16Optimizer.matches(wrapper)


class FP16Optimizer(metaclass=_WrapperCheck):
    deepspeed_name = "runtime.fp16.fused_optimizer.FP16_Optimizer"

    @staticmethod
    def matches(wrapper) -> bool:
        return _stage(wrapper) == 0 and _dtypes(wrapper)[0] == torch.float16 and _adam_family(wrapper)


class FP16UnfusedOptimizer(metaclass=_WrapperCheck):
    deepspeed_name = "runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"

    @staticmethod
    def matches(wrapper) -> bool:
        if _stage(wrapper) != 0:
            return False
        param, accum = _dtypes(wrapper)
        return (param == torch.float16 and not _adam_family(wrapper)) or (param == accum == torch.bfloat16)


class BF16Optimizer(_UniversalCheckpointLinks, metaclass=_WrapperCheck):
    _groups_attribute = "bf16_groups"
    deepspeed_name = "runtime.bf16_optimizer.BF16_Optimizer"

    @staticmethod
    def matches(wrapper) -> bool:
        stage = _stage(wrapper)
        if stage not in (0, 1) or _dtypes(wrapper) != (torch.bfloat16, torch.float32):
            return False
        return (
            stage == 0 or getattr(wrapper, "offload", None) is None
        )  # DeepSpeed: ZeRO-1 without CPU offload
