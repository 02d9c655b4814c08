"""Optimizers from config (names, flags, param groups, errors), our Lamb and Lion against slow per-tensor
references written here, and the DeepSpeed-named `ops` classes."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from shardspeed.config.errors import ConfigError
from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
from shardspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardspeed.ops.lamb import FusedLamb
from shardspeed.ops.lion import DeepSpeedCPULion, FusedLion
from shardspeed.optimizers import Lamb, Lion
from shardspeed.runtime.optim import ZERO_TESTED_OPTIMIZERS, build_optimizer, is_zero_tested_optimizer

SHAPES = [(7,), (3, 5), (4, 2, 3)]


def make_params(dtype=torch.float32, seed=0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def set_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def model_params():
    return torch.nn.Linear(4, 3).parameters()


# --- name and flag mapping ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_name,params,offload,expected",
    [
        ("adam", {}, False, torch.optim.AdamW),
        ("Adam", {"adam_w_mode": False}, False, torch.optim.Adam),
        ("ADAM", {"torch_adam": True}, False, torch.optim.AdamW),
        ("AdamW", {"adam_w_mode": False}, False, torch.optim.AdamW),
        ("adam", {}, True, DeepSpeedCPUAdam),
        ("adamw", {}, True, DeepSpeedCPUAdam),
        ("adam", {"bias_correction": False}, False, FusedAdam),
        ("Lamb", {}, False, FusedLamb),
        ("lion", {}, False, FusedLion),
        ("Lion", {}, True, DeepSpeedCPULion),
        ("adagrad", {}, False, torch.optim.Adagrad),
        ("Adagrad", {}, True, DeepSpeedCPUAdagrad),
        ("SGD", {"lr": 0.1, "momentum": 0.9}, False, torch.optim.SGD),
        ("sgd", {"lr": 0.1}, False, torch.optim.SGD),
        ("RMSprop", {}, False, torch.optim.RMSprop),
        ("nadam", {}, False, torch.optim.NAdam),
    ],
)
def test_name_to_class(type_name, params, offload, expected):
    opt = build_optimizer(type_name, params, model_params(), offload=offload)
    assert type(opt) is expected
    assert isinstance(opt, torch.optim.Optimizer)


def test_adam_w_mode_and_weight_decay_defaults():
    adamw = build_optimizer("adam", {"lr": 0.01}, model_params())
    assert adamw.defaults["weight_decay"] == 0.0  # FusedAdam's default, not torch AdamW's 0.01
    assert build_optimizer("adamw", {"torch_adam": True}, model_params()).defaults["weight_decay"] == 0.01
    l2 = build_optimizer("adam", {"adam_w_mode": False, "weight_decay": 0.1}, model_params())
    assert type(l2) is torch.optim.Adam and not l2.defaults["decoupled_weight_decay"]
    cpu = build_optimizer("adam", {"adam_w_mode": False}, model_params(), offload=True)
    assert type(cpu) is DeepSpeedCPUAdam and not cpu.defaults["decoupled_weight_decay"]


def test_kernel_choice_fused_on_cpu_unless_asked():
    assert build_optimizer("adamw", {}, model_params()).defaults["fused"] is True
    assert build_optimizer("adagrad", {}, model_params()).defaults["fused"] is True
    explicit = build_optimizer("adamw", {"foreach": True}, model_params())
    assert explicit.defaults["foreach"] is True and not explicit.defaults["fused"]
    assert build_optimizer("sgd", {"lr": 0.1}, model_params()).defaults["foreach"] is True


def test_fused_cpu_adam_matches_foreach():
    """The finding behind choosing fused on CPU: identical within 1e-6 to foreach over 50 steps."""
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        runs = []
        for kernel in ("fused", "foreach"):
            params = make_params()
            opt = cls(params, lr=1e-2, weight_decay=0.05, **{kernel: True})
            for step in range(50):
                set_grads(params, step)
                opt.step()
            runs.append(params)
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_betas_list_becomes_tuple():
    opt = build_optimizer("adam", {"betas": [0.8, 0.99]}, model_params())
    assert opt.defaults["betas"] == (0.8, 0.99)
    assert build_optimizer("lamb", {"betas": [0, 0.5]}, model_params()).defaults["betas"] == (0.0, 0.5)


# --- param groups ---------------------------------------------------------------------------------------


def test_param_groups_keep_their_options_and_empty_ones_are_dropped():
    a, b, c = make_params()
    groups = [
        {"params": [a], "lr": 0.5, "weight_decay": 0.1},
        {"params": []},
        {"params": iter([b, c])},
    ]
    opt = build_optimizer("adamw", {"lr": 0.01}, groups)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.1
    assert opt.param_groups[1]["lr"] == 0.01 and opt.param_groups[1]["params"] == [b, c]


def test_generator_of_tensors_is_accepted():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("sgd", {"lr": 0.1}, (p for p in model.parameters()))
    assert len(opt.param_groups[0]["params"]) == 2


@pytest.mark.parametrize(
    "model_parameters",
    [
        lambda a, b: [{"params": [a, b]}, {"params": [a]}],
        lambda a, b: [a, b, a],
        lambda a, b: [{"params": []}],
        lambda a, b: [],
        lambda a, b: [{"params": [a]}, b],
        lambda a, b: [{"lr": 0.1}],
        lambda a, b: None,
        lambda a, b: [a, "not a tensor"],
    ],
)
def test_bad_param_groups(model_parameters):
    a, b, _ = make_params()
    with pytest.raises(ConfigError, match="model_parameters"):
        build_optimizer("adam", {}, model_parameters(a, b))


# --- errors name the key ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "type_name,params,key",
    [
        ("adamm", {}, "optimizer.type"),
        ("", {}, "optimizer.type"),
        (3, {}, "optimizer.type"),
        ("OneBitAdam", {}, "optimizer.type"),
        ("zerooneadam", {}, "optimizer.type"),
        ("OneBitLamb", {}, "optimizer.type"),
        ("MuAdam", {}, "optimizer.type"),
        ("muadamw", {}, "optimizer.type"),
        ("MuSGD", {}, "optimizer.type"),
        ("LBFGS", {}, "optimizer.type"),
        ("adam", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
        ("lamb", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
        ("adam", {"lrr": 0.1}, "optimizer.params.lrr"),
        ("sgd", {"momentun": 0.9}, "optimizer.params.momentun"),
        ("lion", {"eps": 1e-8}, "optimizer.params.eps"),
        ("adam", {"betas": [0.9]}, "optimizer.params.betas"),
        ("adam", {"betas": [0.9, 1.5]}, "optimizer.params.betas"),
        ("adam", {"betas": "0.9,0.99"}, "optimizer.params.betas"),
        ("adam", {"lr": -1}, "optimizer.params.lr"),
        ("adam", {"lr": "auto"}, "optimizer.params.lr"),
        ("adamw", {"weight_decay": -0.1}, "optimizer.params.weight_decay"),
        ("adam", {"eps": True}, "optimizer.params.eps"),
        ("adam", {"torch_adam": "yes"}, "optimizer.params.torch_adam"),
        ("adam", {"adam_w_mode": 1}, "optimizer.params.adam_w_mode"),
        ("adam", {"bias_correction": False, "amsgrad": True}, "optimizer.params.amsgrad"),
        ("adam", {"amsgrad": True}, None),  # torch's AdamW supports it: no error
        ("lamb", {"amsgrad": True}, "optimizer.params.amsgrad"),
        ("adam", "params", "optimizer.params"),
    ],
)
def test_config_errors_name_the_key(type_name, params, key):
    if key is None:
        build_optimizer(type_name, params, model_params())
        return
    with pytest.raises(ConfigError) as info:
        build_optimizer(type_name, params, model_params())
    assert key in str(info.value)


def test_error_messages_help():
    with pytest.raises(ConfigError, match="did you mean 'adamw'"):
        build_optimizer("adamww", {}, model_params())
    with pytest.raises(ConfigError, match="did you mean 'RMSprop'"):
        build_optimizer("RMSProp_", {}, model_params())
    with pytest.raises(ConfigError, match="gradient_clipping"):
        build_optimizer("adam", {"max_grad_norm": 1.0}, model_params())
    with pytest.raises(ConfigError, match="not supported"):
        build_optimizer("onebitadam", {}, model_params())
    with pytest.raises(ConfigError, match=r"accepted: .*momentum") as info:
        build_optimizer("sgd", {"momentun": 0.9}, model_params())
    assert "did you mean 'momentum'" in str(info.value)


def test_zero_tested_optimizers():
    assert {torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, Lion} <= ZERO_TESTED_OPTIMIZERS
    assert {
        FusedAdam,
        DeepSpeedCPUAdam,
        DeepSpeedCPUAdagrad,
        FusedLion,
        DeepSpeedCPULion,
    } <= ZERO_TESTED_OPTIMIZERS
    assert not {torch.optim.SGD, Lamb, FusedLamb} & ZERO_TESTED_OPTIMIZERS
    assert is_zero_tested_optimizer(build_optimizer("adam", {}, model_params()))
    assert not is_zero_tested_optimizer(build_optimizer("sgd", {"lr": 0.1}, model_params()))


# --- Lamb and Lion against slow references ------------------------------------------------------------------


def reference_lamb(params, grads_per_step, lr, betas, eps, weight_decay, bias_correction, eps_inside_sqrt,
                   max_coeff=10.0, min_coeff=0.01):  # fmt: skip
    """DeepSpeed FusedLamb's update, one tensor at a time, in float64."""
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = torch.sqrt(v[i] + eps) if eps_inside_sqrt else torch.sqrt(v[i]) + eps
            update = m[i] / denom + weight_decay * p
            w_norm, u_norm = p.norm().item(), update.norm().item()
            trust = 1.0
            if w_norm != 0 and u_norm != 0:
                trust = min(max(w_norm / u_norm, min_coeff), max_coeff)
            step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            params[i] = p - step_size * trust * update
    return params


def reference_lion(params, grads_per_step, lr, betas, weight_decay):
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    b1, b2 = betas
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            c = b1 * m[i] + (1 - b1) * g
            params[i] = p * (1 - lr * weight_decay) - lr * torch.sign(c)
            m[i] = b2 * m[i] + (1 - b2) * g
    return params


def run_steps(opt, params, steps, first=0):
    grads_per_step = []
    for step in range(first, first + steps):
        set_grads(params, step)
        grads_per_step.append([p.grad.clone() for p in params])
        opt.step()
    return grads_per_step


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight_decay": 0.01, "lr": 0.01},
        {"bias_correction": False, "eps_inside_sqrt": True, "betas": (0.8, 0.9)},
        {"max_coeff": 0.5, "min_coeff": 0.3, "weight_decay": 0.1},  # the clamp bites both ways
    ],
)
def test_lamb_matches_reference(options):
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
              "eps_inside_sqrt": False, **options}  # fmt: skip
    params = make_params()
    params.append(torch.nn.Parameter(torch.zeros(4)))  # zero weight norm: trust ratio 1
    start = [p.detach().clone() for p in params]
    grads = run_steps(Lamb(params, **kwargs), params, 6)
    expected = reference_lamb(start, grads, **kwargs)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.double(), e, atol=1e-6, rtol=0)


def test_lamb_trust_ratios_are_reported_and_fused_lamb_matches():
    params, twins = make_params(), make_params()
    lamb, fused = Lamb(params, lr=0.01, weight_decay=0.01), FusedLamb(twins, lr=0.01, weight_decay=0.01)
    for step in range(3):
        set_grads(params, step)
        set_grads(twins, step)
        lamb.step()
        fused.step()
    assert len(lamb.get_lamb_coeffs()) == len(params)
    assert all(0.01 <= c <= 10.0 for c in lamb.get_lamb_coeffs())
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1, "lr": 0.01}, {"betas": (0.5, 0.9)}])
def test_lion_matches_reference(options):
    kwargs = {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0, **options}
    params = make_params()
    start = [p.detach().clone() for p in params]
    grads = run_steps(Lion(params, **kwargs), params, 6)
    for p, e in zip(params, reference_lion(start, grads, **kwargs)):
        torch.testing.assert_close(p.double(), e, atol=1e-6, rtol=0)


@pytest.mark.parametrize("cls", [Lamb, Lion, FusedAdam])
def test_state_dict_resume_is_exact(cls):
    params = make_params()
    opt = cls(params, lr=0.01, weight_decay=0.01)
    run_steps(opt, params, 3)
    saved_params = [p.detach().clone() for p in params]
    saved_state = copy.deepcopy(opt.state_dict())
    run_steps(opt, params, 3, first=3)

    resumed = [torch.nn.Parameter(p) for p in saved_params]
    opt2 = cls(resumed, lr=0.01, weight_decay=0.01)
    opt2.load_state_dict(saved_state)
    run_steps(opt2, resumed, 3, first=3)
    for a, b in zip(params, resumed):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_lion_fp32_states_for_bf16_params():
    params = make_params(torch.bfloat16)
    opt = DeepSpeedCPULion(params, lr=0.01)
    run_steps(opt, params, 2)
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)


# --- ops classes ------------------------------------------------------------------------------------------


OPS = [
    (FusedAdam, {"lr": 0.01, "weight_decay": 0.01}),
    (FusedAdam, {"adam_w_mode": False, "bias_correction": False}),
    (DeepSpeedCPUAdam, {"lr": 0.01, "adamw_mode": False, "weight_decay": 0.01}),
    (FusedLamb, {"lr": 0.01, "eps_inside_sqrt": True}),
    (FusedLion, {"lr": 1e-3}),
    (DeepSpeedCPULion, {"lr": 1e-3, "weight_decay": 0.1}),
    (DeepSpeedCPUAdagrad, {"lr": 0.1}),
]


@pytest.mark.parametrize("cls,kwargs", OPS)
def test_ops_classes_construct_and_step(cls, kwargs):
    params = make_params()
    start = [p.detach().clone() for p in params]
    opt = cls(params, **kwargs)
    assert isinstance(opt, torch.optim.Optimizer)
    run_steps(opt, params, 3)
    assert all(not torch.equal(p, s) for p, s in zip(params, start))
    assert all(torch.isfinite(p).all() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam, FusedLamb, DeepSpeedCPUAdagrad])
def test_amsgrad_is_refused_as_deepspeed(cls):
    with pytest.raises(ValueError, match="AMSGrad"):
        cls(make_params(), amsgrad=True)
    with pytest.raises(RuntimeError, match="AMSGrad"):  # DeepSpeed raised RuntimeError: both work
        cls(make_params(), amsgrad=True)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_equals_torch_adam(adam_w_mode):
    params, twins = make_params(), make_params()
    ours = FusedAdam(params, lr=0.01, weight_decay=0.05, adam_w_mode=adam_w_mode)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs = torch_cls(twins, lr=0.01, weight_decay=0.05, foreach=True)
    run_steps(ours, params, 5)
    run_steps(theirs, twins, 5)
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_without_bias_correction_matches_reference(adam_w_mode):
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.999), 1e-8, 0.05
    params = make_params()
    ref = [p.detach().double().clone() for p in params]
    grads = run_steps(FusedAdam(params, lr=lr, bias_correction=False, adam_w_mode=adam_w_mode, weight_decay=wd),
                      params, 5)  # fmt: skip
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            g = g.double()
            if adam_w_mode:
                ref[i] = ref[i] * (1 - lr * wd)
            else:
                g = g + wd * ref[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            ref[i] = ref[i] - lr * m[i] / (v[i].sqrt() + eps)
    for p, e in zip(params, ref):
        torch.testing.assert_close(p.double(), e, atol=1e-6, rtol=0)


def test_cpu_adam_keeps_fp32_states_for_bf16_params():
    params = make_params(torch.bfloat16)
    fp32_twins = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = DeepSpeedCPUAdam(params, lr=0.01)
    reference = torch.optim.AdamW(fp32_twins, lr=0.01, weight_decay=0)
    run_steps(opt, params, 1)
    run_steps(reference, fp32_twins, 1)
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.float32 for p in params)
    for p, q in zip(params, fp32_twins):  # one step from the same start: equal up to the bf16 rounding
        torch.testing.assert_close(p.float(), q.detach(), atol=2e-2, rtol=1e-2)
    halves = [[torch.zeros_like(p, dtype=torch.float16) for p in params]]
    opt.step(fp16_param_groups=halves)
    for p, h in zip(params, halves[0]):
        torch.testing.assert_close(h.float(), p.float(), atol=1e-2, rtol=1e-2)


def test_set_grad_none_false_zeroes_instead():
    params = make_params()
    opt = FusedAdam(params, set_grad_none=False)
    set_grads(params, 0)
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in params)


def test_fused_adam_state_dict_loads_into_torch_adamw():
    params = make_params()
    opt = FusedAdam(params, lr=0.01)
    run_steps(opt, params, 2)
    twin = torch.optim.AdamW(params, lr=0.01, weight_decay=0.0)
    twin.load_state_dict(opt.state_dict())
    assert float(twin.state_dict()["state"][0]["step"]) == 2.0


def test_cpu_adagrad_steps_sparse_embedding_gradients_like_torch():
    """The fused kernel refuses sparse gradients; such a step takes torch's per-tensor path, then fused again."""
    torch.manual_seed(0)
    ours, reference = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(10, 4, sparse=True)
    reference.load_state_dict(ours.state_dict())
    optimizer = DeepSpeedCPUAdagrad(ours.parameters(), lr=0.1)
    expected = torch.optim.Adagrad(reference.parameters(), lr=0.1, eps=1e-10)
    for _ in range(3):
        for module, opt in ((ours, optimizer), (reference, expected)):
            opt.zero_grad()
            module(torch.tensor([1, 3, 3, 7])).sum().backward()
            opt.step()
    assert torch.equal(ours.weight, reference.weight)
    assert optimizer.param_groups[0]["fused"] is True
