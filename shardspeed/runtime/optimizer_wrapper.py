"""The optimizer-wrapper protocol the engine drives, shared by stage 0 and the ZeRO stages.

A wrapper owns the gradients, the fp32 masters and the step of one stage. The engine calls
`backward_begin(is_boundary)`, `backward_end()`, `step() -> applied`, `zero_grad()`, `state_dict()`,
`load_state_dict()`, `load_universal()` and `remove_hooks()`; users see `param_groups` and the loss scale,
as on DeepSpeed's optimizer wrappers. `optimizer` is the wrapped torch optimizer.
"""

from __future__ import annotations


class OptimizerWrapper:
    optimizer = None  # the torch optimizer
    scaler = None  # the LossScaler

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.loss_scale

    @property
    def cur_scale(self) -> float:
        return self.scaler.loss_scale
