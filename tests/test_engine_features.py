"""DeepSpeed 0.19's engine features and config keys, each shown to take effect on 2 ranks.

Three process groups, several sub-cases each: the engine's public surface (getters, attribute look-up,
loss dtype, `disable_python_gc`, `log_level`, `dump_state`) and the gradient keys
(`gradient_allreduce_op`, `compute_grad_norm`, `bf16.check_grad_overflow`, sequence-parallel
communication dtype); ZeRO-3 (`zero.Init`'s `ds_*` attributes, `empty_partition_cache`, `leaf_module`,
`stage3_allgather_sequential`, `stage3_use_all_reduce_for_fetch_params`, `log_trace_cache_warnings`) and
`offload_states` / `reload_states` at every stage; `torch_autocast` and `engine.compile()`.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from engine_features_common import (
    MLP,
    AutocastMLP,
    LeafyModel,
    batches,
    config,
    make_engine,
    params,
    same,
    train,
)

from harness import run_ranks


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _capture():
    from shardspeed.utils.logging import logger

    handler = _Captured()
    logger.addHandler(handler)
    return handler


class _Bf16Loss(MLP):
    """A model whose loss is computed, and returned, in bf16."""

    def forward(self, x):
        return super().forward(x.to(torch.bfloat16))


# -- 1: the surface and the gradient keys ----------------------------------------------------------------------


def _surface(root: str) -> dict:
    import gc

    from shardspeed.utils import safe_set_full_grad
    from shardspeed.utils.logging import logger

    rank, out = int(os.environ["RANK"]), {}  # the process group starts with the first engine
    engine = make_engine(config(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}))
    out["getters"] = (engine.get_data_parallel_rank(), engine.dp_world_size, engine.optimizer_name(),
                      engine.zero_offload_optimizer(), engine.zero_offload_param(), engine.zero_optimization_stage(),
                      engine.zero_use_cpu_optimizer(), engine.communication_data_type)  # fmt: skip
    out["forwarded"] = (engine.config_class, engine.describe(), engine.up is engine.module.up)
    sgd = make_engine(config(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    out["client optimizer name"] = sgd.optimizer_name()
    offload = make_engine(config(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}))
    block = offload.zero_offload_optimizer()
    out["offload getters"] = (block.device, offload.zero_cpu_offload(), offload.zero_offload_param())

    bf16 = make_engine(config(bf16={"enabled": True}), model=_Bf16Loss)
    x = torch.randn(2, 8)
    loss = bf16(x)
    returned = bf16.backward(loss)
    out["bf16 loss dtypes"] = (loss.dtype, returned.dtype, torch.equal(returned, loss / 2))

    held = make_engine(config(disable_python_gc=True, log_level="error"))
    out["gc off while held"] = not gc.isenabled()
    out["log level"] = logger.level
    out["collect"] = isinstance(held.collect_python_gc(), int)
    held.destroy()
    out["gc back after destroy"] = gc.isenabled()
    make_engine(config(log_level="info"))
    handler = _capture()
    make_engine(config(dump_state=True))
    out["dump_state logged"] = rank != 0 or any('"dump_state": true' in m for m in handler.messages)
    logger.removeHandler(handler)

    # gradient_allreduce_op: with SGD and no clipping, the update of "sum" is world x the update of "mean"
    for stage in (0, 1, 2):
        before = params(make_engine(config(zero_optimization={"stage": stage})))
        deltas = {}
        for op in ("mean", "sum"):
            engine = make_engine(config(zero_optimization={"stage": stage}, gradient_allreduce_op=op))
            train(engine, steps=1)
            deltas[op] = {k: v - before[k] for k, v in params(engine).items()}
        out[f"sum is world x mean, stage {stage}"] = all(
            torch.allclose(deltas["sum"][k], 2 * deltas["mean"][k], rtol=1e-5, atol=1e-7) for k in before
        ) and not same(deltas["sum"], deltas["mean"])

    # compute_grad_norm: false skips the norm (None) and trains the same (no clipping to need it)
    runs = {}
    for compute in (True, False):
        engine = make_engine(config(zero_optimization={"stage": 2, "compute_grad_norm": compute}))
        train(engine)
        runs[compute] = (params(engine), engine.get_global_grad_norm())
    out["compute_grad_norm"] = (
        same(runs[True][0], runs[False][0]),
        runs[True][1] is not None,
        runs[False][1],
    )

    # check_grad_overflow: bf16 skips a step with inf gradients unless told not to (and then gets nan)
    # (at ZeRO-1 too, where the fused Adam kernel unscales: clipping an inf norm gives a multiplier of 0)
    for check, stage in ((True, 0), (False, 0), (False, 1)):
        engine = make_engine(
            config(bf16={"enabled": True, "check_grad_overflow": check}, gradient_accumulation_steps=1,
                   zero_optimization={"stage": stage}, gradient_clipping=1.0,
                   optimizer={"type": "Adam", "params": {"lr": 1e-3}})
        )  # fmt: skip
        start = params(engine)
        loss = engine(torch.randn(2, 8).bfloat16())
        engine.backward(loss)
        for p in engine.module.parameters():  # every gradient inf: the norm is inf (not nan)
            safe_set_full_grad(p, torch.full(p.shape, float("inf")))
        engine.step()
        after = params(engine)
        out[f"inf step, check {check}, stage {stage}"] = (engine.skipped_steps, same(start, after),
                                           all(torch.isfinite(v).all().item() for v in after.values()))  # fmt: skip
    # compute_grad_norm false still skips an overflowing fp16 step (a MAX all-reduce of a flag, no norm)
    fp16 = make_engine(config(fp16={"enabled": True}, zero_optimization={"stage": 1, "compute_grad_norm": False},
                              gradient_accumulation_steps=1))  # fmt: skip
    loss = fp16(torch.randn(2, 8).half())
    fp16.backward(loss * (torch.tensor(float("inf")) if rank == 1 else 1))  # only rank 1 overflows
    fp16.step()
    out["fp16 overflow without norm"] = (
        fp16.skipped_steps,
        fp16.get_global_grad_norm(),
        fp16.optimizer.loss_scale,
    )

    # seq_parallel_communication_data_type replaces communication_data_type under sequence parallelism
    sp = make_engine(config(sequence_parallel_size=2, communication_data_type="fp16",
                            seq_parallel_communication_data_type="bf16"))  # fmt: skip
    plain = make_engine(config(communication_data_type="fp16", seq_parallel_communication_data_type="bf16"))
    out["comm dtypes"] = (sp.communication_data_type, {b.comm_dtype for b in sp.optimizer.reducer.buckets},
                          plain.communication_data_type)  # fmt: skip
    return out


def test_surface_and_gradient_keys():
    ranks = run_ranks(_surface, 2, "", timeout=150)
    for rank, out in enumerate(ranks):
        assert out["getters"] == (rank, 2, "adamw", None, None, 0, False, torch.float32)
        assert out["forwarded"] == ("MLPConfig", "a method of the model", True)
        assert out["client optimizer name"] == "SGD"
        assert out["offload getters"] == ("cpu", True, None)
        assert out["bf16 loss dtypes"] == (torch.bfloat16, torch.bfloat16, True)
        assert out["gc off while held"] and out["gc back after destroy"] and out["collect"]
        assert out["log level"] == logging.ERROR
        assert out["dump_state logged"]
        for stage in (0, 1, 2):
            assert out[f"sum is world x mean, stage {stage}"], stage
        assert out["compute_grad_norm"] == (True, True, None)
        assert out["inf step, check True, stage 0"] == (1, True, True)  # skipped, unchanged
        for stage in (0, 1):
            applied = out[f"inf step, check False, stage {stage}"]
            assert applied[0] == 0 and not applied[2]  # applied: nan
        skipped, norm, scale = out["fp16 overflow without norm"]
        assert skipped == 1 and norm is None and scale == 2.0**16  # hysteresis 2: the first overflow keeps it
        assert out["comm dtypes"] == (torch.bfloat16, {torch.bfloat16}, torch.float16)


# -- 2: ZeRO-3 and offload_states ------------------------------------------------------------------------------


def _zero3(root: str) -> dict:
    import shardspeed
    from shardspeed.zero import GatheredParameters

    rank, out = int(os.environ["RANK"]), {}  # the process group starts with the first engine
    with shardspeed.zero.Init():
        model = MLP()
    weight = model.up.weight
    out["zero.Init attributes"] = (
        isinstance(weight.ds_id, int), len({p.ds_id for p in model.parameters()}) == 6, weight.ds_status,
        tuple(weight.ds_shape), weight.ds_numel, tuple(weight.ds_tensor.shape), weight.numel(),
    )  # fmt: skip
    with GatheredParameters([weight]):
        out["gathered status"] = (weight.ds_status, tuple(weight.shape))
    out["released status"] = weight.ds_status
    stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine = make_engine(config(zero_optimization=stage3), model=model)
    seen = []
    engine.module.up.register_forward_hook(lambda m, i, o: seen.append(m.weight.ds_status))
    train(engine, steps=1)
    out["engine status"] = (
        seen[0],
        engine.module.up.weight.ds_status,
        engine.module.up.weight.ds_id == weight.ds_id,
    )

    # empty_partition_cache: units kept gathered for a coming backward are released
    engine(torch.randn(2, 8))  # a forward without backward keeps units gathered (reuse distance)
    units = engine.optimizer.coordinator.units
    gathered_before = sum(u.gathered for u in units if not u.persistent)
    engine.empty_partition_cache()
    out["empty_partition_cache"] = (gathered_before > 0, sum(u.gathered for u in units if not u.persistent))

    _zero3_knobs(out, stage3, rank)
    _offload_cases(out)
    return out


def _zero3_knobs(out: dict, stage3: dict, rank: int) -> None:
    """leaf_module, the three ways of gathering a unit, log_trace_cache_warnings."""
    # leaf_module: a marked module is one unit, whatever its size; training is unchanged
    trained = {}
    for leaf in ({"classes": []}, {"classes": ["LeafyBlock"]}, {"names": ["blocks.1"], "classes": []},
                 {"name_suffixes": [".1"], "classes": []}):  # fmt: skip
        engine = make_engine(config(zero_optimization={**stage3, "reduce_bucket_size": 40, "leaf_module": leaf}),
                             model=LeafyModel)  # fmt: skip
        train(engine)
        roots = [type(u.module).__name__ for u in engine.optimizer.coordinator.units]
        trained[str(leaf)] = (roots.count("LeafyBlock"), params(engine))
    results = list(trained.values())
    out["leaf units"] = [count for count, _ in results]
    out["leaf training unchanged"] = all(same(results[0][1], r[1]) for r in results[1:])

    # the three ways of gathering a unit give the same training, with their collectives
    from shardspeed.zero import param_units

    counted = {"all_reduce": 0}
    real_all_reduce = param_units.all_reduce

    def counting(*args, **kwargs):
        counted["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    param_units.all_reduce = counting
    fetched = {}
    for mode in ({}, {"stage3_allgather_sequential": True}, {"stage3_use_all_reduce_for_fetch_params": True}):
        counted["all_reduce"] = 0
        engine = make_engine(config(zero_optimization={**stage3, **mode}))
        train(engine)
        fetched[str(mode)] = (counted["all_reduce"], params(engine))
    param_units.all_reduce = real_all_reduce
    runs = list(fetched.values())
    out["fetch all-reduces"] = [n for n, _ in runs]
    out["fetch modes agree"] = all(same(runs[0][1], r[1]) for r in runs[1:])

    # log_trace_cache_warnings: a model whose module order changes every step
    from models import DynamicGPT, token_batches

    handler = _capture()
    for warn in (False, True):
        torch.manual_seed(0)
        gpt = make_engine(config(zero_optimization={**stage3, "log_trace_cache_warnings": warn}, gradient_accumulation_steps=1),
                          model=DynamicGPT)  # fmt: skip
        data = token_batches(3, gpt.train_batch_size())
        for step in range(3):
            gpt.module.set_step(step)
            gpt.backward(gpt(data[step, rank * 2 : rank * 2 + 2]))
            gpt.step()
        out[f"order warnings {warn}"] = sum("gather order changed" in m for m in handler.messages)
        handler.messages.clear()


def _offload_cases(out: dict) -> None:
    """offload_states / reload_states at every stage, in fp32 and bf16, and what they refuse."""
    from shardspeed.zero.offload_kinds import OffloadDeviceEnum, OffloadStateTypeEnum

    # offload_states / reload_states at every stage: errors while offloaded, bit-exact training after
    for stage in (0, 1, 2, 3):
        for dtype_block in ({}, {"bf16": {"enabled": True}}):
            cfg = config(zero_optimization={"stage": stage}, **dtype_block)
            dtype = torch.bfloat16 if dtype_block else None
            reference = make_engine(cfg)
            train(reference, steps=2, dtype=dtype)
            engine = make_engine(cfg)
            train(engine, steps=1, dtype=dtype)
            engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                                           OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads,
                                           OffloadStateTypeEnum.contiguous_grad_buffer],
                                  device=OffloadDeviceEnum.cpu)  # fmt: skip
            try:
                engine(torch.randn(2, 8))
                refused = "no error"
            except RuntimeError as err:
                refused = str(err)
            engine.reload_states()
            engine.offload_states()  # everything, the default
            engine.reload_states(non_blocking=True)
            # the second step starts from the offloaded-and-reloaded state: it must equal the reference
            for x in batches(engine, 2)[1]:
                engine.backward(engine(x.to(dtype) if dtype is not None else x))
                engine.step()
            out[f"offload stage {stage} {dtype}"] = (same(params(reference), params(engine)), refused,
                                                     engine.global_steps)  # fmt: skip
    engine = make_engine(config(zero_optimization={"stage": 2}))
    for bad in (OffloadDeviceEnum.nvme,):
        try:
            engine.offload_states(device=bad)
            out["nvme"] = "accepted"
        except ValueError as err:
            out["nvme"] = str(err)
    param_off = make_engine(config(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))
    try:
        param_off.offload_states()
        out["param offload"] = "accepted"
    except ValueError as err:
        out["param offload"] = str(err)


def test_zero3_attributes_knobs_and_offload_states():
    ranks = run_ranks(_zero3, 2, "", timeout=240)
    from shardspeed.zero import ZeroParamStatus

    for out in ranks:
        ds_id_is_int, distinct, status, shape, numel, chunk, local = out["zero.Init attributes"]
        assert ds_id_is_int and distinct and status is ZeroParamStatus.NOT_AVAILABLE
        assert shape == (16, 8) and numel == 128 and chunk == (64,) and local == 0
        assert out["gathered status"] == (ZeroParamStatus.AVAILABLE, (16, 8))
        assert out["released status"] is ZeroParamStatus.NOT_AVAILABLE
        assert out["engine status"] == (ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE, True)
        assert out["empty_partition_cache"] == (True, 0)
        assert out["leaf units"] == [0, 2, 1, 1] and out["leaf training unchanged"]
        default, sequential, all_reduce = out["fetch all-reduces"]
        assert default == 0 and sequential > all_reduce > 0 and out["fetch modes agree"]
        assert out["order warnings False"] == 0 and out["order warnings True"] >= 1
        for stage in (0, 1, 2, 3):
            for dtype in (None, torch.bfloat16):
                exact, refused, steps = out[f"offload stage {stage} {dtype}"]
                assert exact, (stage, dtype)
                assert "states are offloaded" in refused and "reload_states()" in refused
                assert steps == 2
        assert "only the host" in out["nvme"]
        assert "offload_param" in out["param offload"]


# -- 3: torch_autocast and compile ------------------------------------------------------------------------------


def _autocast_and_compile(root: str) -> dict:
    out = {}
    autocast = {"enabled": True, "dtype": "bf16"}
    engine = make_engine(config(torch_autocast=autocast))
    out["params stay fp32"] = {p.dtype for p in engine.module.parameters()}
    out["forward dtype"] = engine.module.up(torch.randn(2, 8)).dtype, _forward_dtype(engine)
    out["bucket comm dtypes"] = sorted(str(b.comm_dtype) for b in engine.optimizer.reducer.buckets)
    for stage in (0, 3):  # stage 3 also splits its units by communication dtype
        base = config(zero_optimization={"stage": stage})
        manual = make_engine(base, model=AutocastMLP)  # fp32 communication, autocast opened by the model
        train(manual)
        fp32_comm = make_engine(config(zero_optimization={"stage": stage},
                                       torch_autocast={**autocast, "lower_precision_safe_modules": []}))  # fmt: skip
        train(fp32_comm)
        bf16_comm = make_engine(config(zero_optimization={"stage": stage}, torch_autocast=autocast))
        train(bf16_comm)
        reference, lowp = params(manual), params(bf16_comm)
        out[f"autocast stage {stage}"] = (
            same(reference, params(fp32_comm)),  # the config's autocast is exactly the hand-opened one
            not same(reference, lowp),  # Linear gradients reduced in bf16 differ...
            all(torch.allclose(reference[k], lowp[k], atol=2e-2) for k in reference),  # ...by bf16 rounding
        )
    fp16 = make_engine(config(torch_autocast={"enabled": True, "dtype": "fp16"}))
    initial = (fp16.optimizer.loss_scale, fp16.optimizer.scaler.dynamic)
    losses = train(fp16)
    out["fp16 autocast"] = (*initial, all(math.isfinite(v) for v in losses))

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = make_engine(config())
    compiled.compile(backend=counting_backend, compile_kwargs={"dynamic": False})
    plain = make_engine(config())
    train(compiled)
    train(plain)
    out["compiled"] = (
        compiled.is_compiled,
        plain.is_compiled,
        len(graphs) > 0,
        same(params(compiled), params(plain)),
    )
    try:
        plain.compile(schedule=[(0, ["z3"])])
        out["schedule"] = "accepted"
    except ValueError as err:
        out["schedule"] = str(err)
    return out


def _forward_dtype(engine) -> torch.dtype:
    seen = []
    handle = engine.module.up.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    engine(torch.randn(2, 8))
    handle.remove()
    return seen[0]


def test_torch_autocast_and_compile():
    ranks = run_ranks(_autocast_and_compile, 2, "", timeout=150)
    for out in ranks:
        assert out["params stay fp32"] == {torch.float32}
        assert out["forward dtype"] == (torch.float32, torch.bfloat16)  # autocast only inside the engine
        assert out["bucket comm dtypes"] == ["torch.bfloat16", "torch.float32"]  # Linear vs LayerNorm
        for stage in (0, 3):
            assert out[f"autocast stage {stage}"] == (True, True, True), stage
        assert out["fp16 autocast"] == (2.0**16, True, True)  # a dynamic loss scale, as torch's GradScaler
        assert out["compiled"] == (True, False, True, True)
        assert "schedules are DeepCompile's" in out["schedule"]


@pytest.mark.parametrize("value", ["sum", "mean"])
def test_gradient_allreduce_op_is_case_insensitive(value):
    from shardspeed.config import load_config

    assert load_config(config(gradient_allreduce_op=value.upper())).gradient_allreduce_op == value
