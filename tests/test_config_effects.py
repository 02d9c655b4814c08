"""Config keys whose effect no other test shows, shown here on 2 ranks (one spawn).

What the gradient keys change is what goes on the wire: the first gradient all-reduce is captured and
compared with the plain run's (`prescale_gradients` sends grad / world, `gradient_predivide_factor` f sends
grad / f, `communication_data_type` sends its dtype). The rest: `data_types.grad_accum_dtype`,
`fp16.auto_cast`, `dataloader_drop_last`, the log lines of `steps_per_print`, `memory_breakdown` and
`wall_clock_breakdown`. Keys honoured by construction (shardspeed always does what they ask, or they change
only how DeepSpeed's own implementation works) must train exactly like their defaults.
"""

from __future__ import annotations

import logging
import os

import torch
from engine_features_common import MLP, config, make_engine, params, same, train

from harness import run_ranks

# (key path, value, extra config): each must train bit for bit like the same config without it.
BY_CONSTRUCTION = [
    ("zero_optimization.contiguous_gradients", False, {"zero_optimization": {"stage": 2}}),
    ("zero_optimization.use_multi_rank_bucket_allreduce", False, {"zero_optimization": {"stage": 2}}),
    ("zero_optimization.round_robin_gradients", True, {"zero_optimization": {"stage": 2}}),
    ("zero_optimization.allgather_partitions", False, {"zero_optimization": {"stage": 1}}),
    ("zero_optimization.elastic_checkpoint", True, {"zero_optimization": {"stage": 2}}),
    ("zero_optimization.memory_efficient_linear", False, {"zero_optimization": {"stage": 3}}),
    ("zero_optimization.stage3_module_granularity_threshold", 1000, {"zero_optimization": {"stage": 3}}),
    ("bf16.immediate_grad_update", True, {"bf16": {"enabled": True}}),
    (
        "zero_force_ds_cpu_optimizer",
        False,
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    ),
    ("optimizer.legacy_fusion", True, {}),
]


class _Probe(MLP):
    """Records the dtype of the input it receives, then computes in its own dtype."""

    def forward(self, x):
        self.seen = x.dtype
        return super().forward(x.to(self.up.weight.dtype))


def _with(cfg: dict, path: str, value) -> dict:
    node = cfg
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return cfg


def _sent_gradients(overrides: dict) -> torch.Tensor:
    """The first gradient all-reduce's tensor of one boundary micro-step (stage 0, one bucket)."""
    import shardspeed.core.grad_buckets as grad_buckets

    sent = []
    real = grad_buckets.all_reduce

    def capture(tensor, *args, **kwargs):
        sent.append(tensor.clone())
        return real(tensor, *args, **kwargs)

    grad_buckets.all_reduce = capture
    try:
        engine = make_engine(config(gradient_accumulation_steps=1, **overrides))
        engine.backward(engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(engine.dp_rank))))
    finally:
        grad_buckets.all_reduce = real
    return sent[0]


def _effects(root: str) -> dict:
    from torch.utils.data import TensorDataset

    from shardspeed.utils.logging import logger

    rank, out = int(os.environ["RANK"]), {}  # the process group starts with the first engine
    plain = _sent_gradients({})
    prescale = _sent_gradients({"prescale_gradients": True})
    predivide = _sent_gradients({"gradient_predivide_factor": 4.0})
    fp16 = _sent_gradients({"communication_data_type": "fp16"})
    out["on the wire"] = (
        torch.allclose(prescale, plain / 2, rtol=0, atol=0),
        torch.allclose(predivide, plain / 4, rtol=0, atol=0),
        fp16.dtype,
        torch.equal(fp16, plain.half()),
    )

    accum = {}
    for dtype in (None, "fp32"):
        engine = make_engine(config(bf16={"enabled": True}, zero_optimization={"stage": 2},
                                    data_types={"grad_accum_dtype": dtype}))  # fmt: skip
        engine.backward(engine(torch.randn(2, 8).bfloat16()))
        accum[dtype] = {g.dtype for g in engine.optimizer.grads.flat_grads()}
    out["grad_accum_dtype"] = (accum[None], accum["fp32"])

    seen = {}
    for auto_cast in (False, True):
        engine = make_engine(config(fp16={"enabled": True, "auto_cast": auto_cast}), model=_Probe)
        engine(torch.randn(2, 8))
        seen[auto_cast] = engine.module.seen
    out["auto_cast"] = (seen[False], seen[True])

    dataset = TensorDataset(torch.randn(10, 8))  # 5 samples per rank: batches of 2, 2, 1
    lengths = []
    for drop in (False, True):
        engine = make_engine(config(dataloader_drop_last=drop))
        lengths.append(len(engine.deepspeed_io(dataset)))
    out["drop_last lengths"] = lengths

    handler = logging.Handler(logging.DEBUG)
    messages: list[str] = []
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    logs = {}
    for name, overrides in {"quiet": {}, "steps_per_print": {"steps_per_print": 1},
                            "memory_breakdown": {"memory_breakdown": True},
                            "wall_clock_breakdown": {"steps_per_print": 1, "wall_clock_breakdown": True}}.items():  # fmt: skip
        messages.clear()
        train(make_engine(config(**overrides)), steps=2)
        logs[name] = list(messages)
    logger.removeHandler(handler)
    if rank == 0:
        out["progress lines"] = sum(m.startswith("step=") for m in logs["steps_per_print"])
        out["quiet progress lines"] = sum(m.startswith("step=") for m in logs["quiet"])
        out["memory lines"] = sum(m.startswith("memory at step") for m in logs["memory_breakdown"])
        out["timed progress"] = all(
            "forward:" in m for m in logs["wall_clock_breakdown"] if m.startswith("step=")
        )

    for path, value, extra in BY_CONSTRUCTION:
        dtype = torch.bfloat16 if "bf16" in extra else None
        default = make_engine(config(**extra))
        train(default, dtype=dtype)
        changed = make_engine(_with(config(**extra), path, value))
        train(changed, dtype=dtype)
        out[path] = same(params(default), params(changed))
    return out


def test_config_keys_take_effect():
    ranks = run_ranks(_effects, 2, "", timeout=180)
    for out in ranks:
        assert out["on the wire"] == (True, True, torch.float16, True)
        assert out["grad_accum_dtype"] == ({torch.bfloat16}, {torch.float32})
        assert out["auto_cast"] == (torch.float32, torch.float16)
        assert out["drop_last lengths"] == [3, 2]
        for path, _, _ in BY_CONSTRUCTION:
            assert out[path], path
    rank0 = ranks[0]
    assert rank0["progress lines"] == 2 and rank0["quiet progress lines"] == 0
    assert rank0["memory lines"] == 2 and rank0["timed progress"]
