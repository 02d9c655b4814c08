"""`shardspeed-to-deepspeed` writes shardspeed's checkpoints of models with MoE layers in DeepSpeed 0.19.8's MoE
layout (checkpoint/deepspeed_format/write_moe.py).

Without DeepSpeed at hand: shardspeed trains tests/deepspeed_interop/moe_script.py for 3 steps at 2 ranks (ep 2,
ZeRO-2 and ZeRO-0) and saves; the written folder must hold the files DeepSpeed itself wrote for the same run
(the fixtures moe-ep2-s{2,0}, made by DeepSpeed with the same script and seed) with the same entries, group
layout and values (fp32, within 1e-6: the two libraries' 3 steps agree to 3e-8); and shardspeed resuming from the
written folder (through its reader of DeepSpeed's MoE checkpoints) continues as its own run that never stopped.
tests/integrations/test_deepspeed_moe_checkpoints.py has DeepSpeed itself resume what is written.
"""

from pathlib import Path

import pytest
import torch

from harness import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_interop" / "fixtures"
TOLERANCE = 1e-6
# What DeepSpeed's files hold that it reads back (the rest is bookkeeping its load does not use).
MODEL_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
              "lr_scheduler", "global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
              "num_experts", "ds_autoep_layers", "epoch"]  # fmt: skip
ZERO12_KEYS = ["single_partition_of_fp32_groups", "base_optimizer_state", "group_paddings", "partition_count",
               "param_alignment_paddings", "clip_grad"]  # fmt: skip


def _train_and_save(root: str) -> dict:
    import torch.distributed as dist
    from deepspeed_interop.moe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    return {stage: run(shardspeed, world, 2, stage, save=f"{root}/ss-s{stage}") for stage in (2, 0)}


def _resume(root: str) -> dict:
    import torch.distributed as dist
    from deepspeed_interop.moe_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    return {stage: run(shardspeed, world, 2, stage, load=f"{root}/ds-s{stage}") for stage in (2, 0)}


def _close(a, b, where: str) -> list[str]:
    """Where two nested structures differ: tensors in dtype, shape or by more than TOLERANCE, the rest by value
    (DeepSpeed's tuples and lists, OrderedDicts and dicts count as the same)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape):
            return [where]
        return [] if a.numel() == 0 or (a.float() - b.float()).abs().max().item() <= TOLERANCE else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _close(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _close(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _without_fused(groups: list) -> list:
    """torch's `fused` flag of Adam is the optimizer each library built (None in DeepSpeed's), not the state."""
    return [{k: v for k, v in g.items() if k != "fused"} for g in groups]


def _comparable(content: dict, name: str) -> dict:
    if "model_states" not in name or name.startswith("layer_"):
        if name.startswith("layer_"):
            return content
        inner = content["optimizer"] if "optimizer" in content else content["optimizer_state_dict"]
        if "optimizer" in content:
            return {**inner, "param_groups": _without_fused(inner["param_groups"])}
        osd = {k: inner[k] for k in ZERO12_KEYS}
        base = osd["base_optimizer_state"]
        osd["base_optimizer_state"] = {**base, "param_groups": _without_fused(base["param_groups"])}
        return osd
    out = {k: content.get(k) for k in MODEL_KEYS}
    if out["optimizer"] is not None:
        out["optimizer"] = {
            **out["optimizer"],
            "param_groups": _without_fused(out["optimizer"]["param_groups"]),
        }
    return out


def test_shardspeed_moe_checkpoint_written_as_deepspeed_writes_it(tmp_path):
    from shardspeed.checkpoint.deepspeed_format import pickled
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint
    from shardspeed.checkpoint.files import CheckpointError

    uninterrupted = run_ranks(_train_and_save, 2, str(tmp_path), timeout=600)[0]
    for stage in (2, 0):
        written = write_deepspeed_checkpoint(tmp_path / f"ss-s{stage}", tmp_path / f"ds-s{stage}")
        original = FIXTURES / f"moe-ep2-s{stage}" / "global_step3"
        names = sorted(p.name for p in original.iterdir())
        assert sorted(p.name for p in written.iterdir()) == names
        differences = []
        for name in names:
            theirs, ours = pickled.load(original / name), pickled.load(written / name)
            differences += _close(_comparable(ours, name), _comparable(theirs, name), f"s{stage}/{name}")
        assert differences == [], differences[:10]
    for stage, resumed in run_ranks(_resume, 2, str(tmp_path), timeout=600)[0].items():
        expected = uninterrupted[stage]
        assert resumed["counters"] == expected["counters"]
        assert max(abs(a - b) for a, b in zip(resumed["losses"], expected["losses"])) <= TOLERANCE
        assert (
            max((resumed["weights"][n] - w).abs().max().item() for n, w in expected["weights"].items())
            <= TOLERANCE
        )
    with pytest.raises(CheckpointError, match="ZeRO stage 3"):
        write_deepspeed_checkpoint(tmp_path / "ss-s2", tmp_path / "ds-s3", zero_stage=3)
    with pytest.raises(CheckpointError, match="not a multiple of the ep size"):
        write_deepspeed_checkpoint(tmp_path / "ss-s2", tmp_path / "ds-w3", world_size=3)
