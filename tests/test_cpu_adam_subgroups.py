"""DeepSpeedCPUAdam.step_subgroup / rollback_subgroup: a sub-group's step matches torch's Adam(W), the state
lives under the sub-group's number, and a rollback returns parameter and moments to before the step."""

from __future__ import annotations

import pytest
import torch

from shardspeed.ops.adam import DeepSpeedCPUAdam


def _param(seed: int, dtype=torch.float32) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(64, generator=gen).to(dtype))
    param.grad = torch.randn(64, generator=gen).to(dtype)
    return param


@pytest.mark.parametrize("adamw", [True, False])
def test_step_matches_torch_and_rollback_undoes_it(adamw):
    param, reference = _param(0), _param(0)
    options = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    optimizer = DeepSpeedCPUAdam([param], adamw_mode=adamw, **options)
    torch_optimizer = (torch.optim.AdamW if adamw else torch.optim.Adam)([reference], **options)
    history = []
    for _ in range(3):  # three steps with new gradients, each checked against torch's optimizer
        history.append((param.detach().clone(), {k: v.clone() for k, v in optimizer.state[7].items()
                                                if torch.is_tensor(v)}))  # fmt: skip
        param.grad = torch.randn(64)
        reference.grad = param.grad.clone()
        optimizer.step_subgroup(7)
        torch_optimizer.step()
        torch.testing.assert_close(param.detach(), reference.detach(), rtol=1e-6, atol=1e-7)
    assert optimizer.state[7]["step"] == 3 and param not in optimizer.state

    optimizer.rollback_subgroup(7)  # the last step, from the same gradient
    before, moments = history[-1]
    assert optimizer.state[7]["step"] == 2
    torch.testing.assert_close(param.detach(), before, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(optimizer.state[7][key], moments[key], rtol=1e-4, atol=1e-7)


def test_half_parameters_keep_fp32_state():
    param = _param(1, torch.bfloat16)
    optimizer = DeepSpeedCPUAdam([param])
    initial = param.detach().clone()
    optimizer.step_subgroup(0)
    assert not torch.equal(param.detach(), initial) and param.dtype == torch.bfloat16
    assert optimizer.state[0]["exp_avg"].dtype == torch.float32


def test_refusals():
    first, second = _param(2), _param(3)
    optimizer = DeepSpeedCPUAdam([first, second])
    with pytest.raises(ValueError, match="2 parameters have gradients"):
        optimizer.step_subgroup(0)
    with pytest.raises(RuntimeError, match="sub_group_id 0 as it has not been initialized"):
        optimizer.rollback_subgroup(0)
    second.grad = None
    optimizer.step_subgroup(0)
    optimizer.rollback_subgroup(0)
    with pytest.raises(RuntimeError, match="step count is 0"):
        optimizer.rollback_subgroup(0)
