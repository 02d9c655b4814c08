"""Comms logger: the bytes the library's collectives move per step equal the ZeRO formula, user collectives
through `shardspeed.comm` are recorded, `log_summary` prints DeepSpeed's table, and prof_ops/off work."""

from __future__ import annotations

import torch
from torch import nn

from harness import run_ranks

PSI = 16 * 32 + 32 + 32 * 16 + 16  # parameters of the model below; every tensor even, so no shard padding
LAST_UNIT_BYTES = 4 * (32 * 16 + 16)
NORM_BYTES = 4  # stages 1-3 all-reduce one fp32 number (the global gradient norm) per step


def _engine(stage: int, reuse_distance: int | None = None):
    import shardspeed

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if reuse_distance is not None:
        zero["stage3_max_reuse_distance"] = reuse_distance
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "comms_logger": {"enabled": True},
    }
    engine, *_ = shardspeed.initialize(model=model, config=config)
    return engine


def _step(engine) -> None:
    x = torch.randn(4, 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def _bytes_per_step(stage: int, reuse_distance: int | None = None) -> dict[str, int]:
    from shardspeed.comm import logger

    engine = _engine(stage, reuse_distance)
    _step(engine)  # the first step also records stage 3's order; measure a steady one
    logger.active().reset()
    _step(engine)
    measured = logger.active().bytes_by_op()
    engine.destroy()  # (stage 3 gathers the full parameters back into the module here)
    return measured


def _cases(world: int):
    import torch.distributed as dist

    import shardspeed.comm as comm
    from shardspeed.comm import logger

    out = {f"stage{s}": _bytes_per_step(s) for s in (0, 1, 2)}
    out["stage3_reuse0"] = _bytes_per_step(3, reuse_distance=0)
    out["stage3_default"] = _bytes_per_step(3)

    # a user's collectives through the facade, with DeepSpeed's logging keywords
    comm.configure(enabled=True, prof_all=True, debug=True)
    t = torch.ones(10)
    comm.all_reduce(t, log_name="my_all_reduce")
    comm.broadcast(t, src=0)
    comm.barrier()
    gathered = [torch.empty(10) for _ in range(world)]
    comm.all_gather(gathered, t)
    user = logger.active().bytes_by_op()
    summary = comm.log_summary(show_straggler=True)

    comm.configure(enabled=True, prof_all=False, prof_ops=["broadcast"])
    comm.all_reduce(t)
    comm.broadcast(t, src=0)
    only = logger.active().bytes_by_op()

    comm.configure(enabled=False)
    off = logger.active() is None
    dist.all_reduce(t)
    return {"engine": out, "user": user, "summary": summary, "only": only, "off": off, "sum": t.tolist()}


def test_bytes_per_step_equal_the_zero_formula_and_user_ops_are_logged():
    ranks = run_ranks(_cases, 2, 2)
    full = 4 * PSI  # fp32 bytes of the whole model
    for r in ranks:
        e = r["engine"]
        # stage 0: one all-reduce of Ψ (2Ψ of traffic in ZeRO's accounting: reduce-scatter + all-gather)
        assert e["stage0"] == {"all_reduce": full}
        # stages 1 and 2: reduce-scatter Ψ + all-gather Ψ = 2Ψ, plus the one-number norm all-reduce
        for stage in ("stage1", "stage2"):
            assert e[stage] == {"reduce_scatter_tensor": full, "all_gather_into_tensor": full,
                                "all_reduce": NORM_BYTES}  # fmt: skip
        # stage 3 with stage3_max_reuse_distance 0: parameters gathered for forward and again for
        # backward, gradients reduce-scattered: 3Ψ — less the last unit (the second Linear), which backward
        # uses right after forward with nothing gathered in between (reuse distance 0, within the limit)
        assert e["stage3_reuse0"] == {"reduce_scatter_tensor": full,
                                      "all_gather_into_tensor": 2 * full - LAST_UNIT_BYTES,
                                      "all_reduce": NORM_BYTES}  # fmt: skip
        # DeepSpeed's default reuse distance keeps a model this small gathered from forward to backward: 2Ψ
        assert e["stage3_default"] == {"reduce_scatter_tensor": full, "all_gather_into_tensor": full,
                                       "all_reduce": NORM_BYTES}  # fmt: skip
        user = r["user"]
        assert sum(v for k, v in user.items() if k.startswith("my_all_reduce | [Caller Func: _cases]")) == 40
        assert user["broadcast | [Caller Func: _cases]"] == 40
        assert user["all_gather | [Caller Func: _cases]"] == 80
        assert user["barrier | [Caller Func: _cases]"] == 0
        assert r["only"] == {"broadcast": 40}
        assert r["off"] and r["sum"] == [8.0] * 10  # three all-reduces of 2 ranks all ran, logged or not
    summary = ranks[0]["summary"]
    for column in ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)",
                   "tput_avg (Gbps)", "busbw_avg (Gbps)", "Total straggler(ms)"):  # fmt: skip
        assert column in summary
    assert "40 B" in summary and "80 B" in summary
