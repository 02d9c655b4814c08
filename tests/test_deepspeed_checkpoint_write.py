"""`shardspeed-to-deepspeed` (checkpoint/deepspeed_format/write.py) writes DeepSpeed 0.19.8's layout.

Without DeepSpeed at hand, two checks: rewriting a checkpoint DeepSpeed itself wrote (the fixtures of
tests/deepspeed_interop) at its own world size and stage gives DeepSpeed's tensors element for element; and what
is written at another world size or stage, or from a shardspeed checkpoint, reads back by name to the same
values. tests/integrations/test_deepspeed_checkpoints.py has DeepSpeed itself load what is written.
"""

import re
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.deepspeed_format import DeepSpeedCheckpointReader, pickled
from shardspeed.checkpoint.deepspeed_format.layout import Zero3Layout
from shardspeed.checkpoint.deepspeed_format.write import main, write_deepspeed_checkpoint
from shardspeed.checkpoint.readers import open_checkpoint

from harness import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_interop" / "fixtures"
ALL = [f"s{stage}-{dtype}" for dtype in ("fp32", "bf16") for stage in range(4)]


def _equal(a, b, where: str) -> list[str]:
    """Where two nested structures of tensors and plain values differ."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _zero_padding(flat_groups: list, tag_dir: Path, rank: int) -> None:
    """DeepSpeed leaves the end padding of a ZeRO-3 partition uninitialised: zero it, as the rewrite does."""
    shapes = pickled.load(tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")["param_shapes"]
    layout = Zero3Layout([list(g.items()) for g in shapes], 2)
    for s, group in enumerate(shapes):
        for name in group:
            place, chunk = layout.places[name], layout.chunk(layout.places[name].numel)
            held = sum(hi - lo for lo, hi, _ in layout.held_by(name, rank))
            flat_groups[s].data[place.offset + held : place.offset + chunk] = 0


# What DeepSpeed's own files hold that the rewrite must reproduce (the rest is bookkeeping it does not read).
MODEL_KEYS = ["module", "buffer_names", "param_shapes", "shared_params", "lr_scheduler", "global_steps",
              "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "epoch"]  # fmt: skip
ZERO12_KEYS = ["single_partition_of_fp32_groups", "base_optimizer_state", "group_paddings", "partition_count"]
ZERO3_KEYS = ["fp32_flat_groups", "optimizer_state_dict", "partition_count"]


@pytest.mark.parametrize("fixture", ALL)
def test_rewriting_deepspeed_checkpoint_gives_deepspeed_tensors(tmp_path, fixture):
    written = write_deepspeed_checkpoint(FIXTURES / fixture, tmp_path)
    original = FIXTURES / fixture / "global_step3"
    names = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in written.iterdir()) == names
    differences = []
    for name in names:
        theirs, ours = pickled.load(original / name), pickled.load(written / name)
        if "model_states" in name:
            keys = MODEL_KEYS + (["optimizer"] if fixture.startswith("s0") else [])
            differences += _equal({k: ours.get(k) for k in keys}, {k: theirs.get(k) for k in keys}, name)
        else:
            keys = ZERO3_KEYS if fixture.startswith("s3") else ZERO12_KEYS
            ours, theirs = ours["optimizer_state_dict"], theirs["optimizer_state_dict"]
            if fixture.startswith("s3"):
                _zero_padding(
                    theirs["fp32_flat_groups"], original, int(re.search(r"pp_rank_(\d+)", name).group(1))
                )
            differences += _equal({k: ours[k] for k in keys}, {k: theirs[k] for k in keys}, name)
    assert differences == []


def _same_by_name(a, b) -> list[str]:
    out = []
    for name in a.param_names():
        if not torch.equal(a.fp32(name), b.fp32(name)):
            out.append(f"{name}: fp32")
        sa, sb = a.optimizer_state(name), b.optimizer_state(name)
        out += [
            f"{name}: {k}" for k in sa if not torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb.get(k)))
        ]
    return out


@pytest.mark.parametrize("world, stage", [(1, 1), (4, 3), (3, 2), (2, 0)])
def test_written_at_another_world_size_and_stage_reads_back(tmp_path, world, stage):
    source = open_checkpoint(FIXTURES / "s2-fp32")
    main([str(FIXTURES / "s2-fp32"), str(tmp_path), "--world-size", str(world), "--zero-stage", str(stage)])
    written = open_checkpoint(tmp_path)
    assert isinstance(written, DeepSpeedCheckpointReader)
    assert (written.world_size, written.zero_stage) == (world, stage)
    assert _same_by_name(source, written) == []
    assert written.param_groups() == source.param_groups()


def _save_shardspeed(folder: str) -> None:
    from deepspeed_interop.run_script import run

    import shardspeed

    shardspeed.init_distributed(dist_backend="gloo")
    run(shardspeed, 1, 2, "bf16", save=folder)


def test_shardspeed_checkpoint_written_in_deepspeed_layout(tmp_path):
    run_ranks(_save_shardspeed, 1, str(tmp_path / "ours"))
    written = write_deepspeed_checkpoint(tmp_path / "ours", tmp_path / "ds")
    source, result = open_checkpoint(tmp_path / "ours"), open_checkpoint(tmp_path / "ds")
    assert isinstance(result, DeepSpeedCheckpointReader) and result.zero_stage == 2
    assert _same_by_name(source, result) == []
    model = pickled.load(written / "mp_rank_00_model_states.pt")
    assert model["module"]["out.weight"].dtype == torch.bfloat16  # the training dtype, as DeepSpeed saves it
    assert model["epoch"] == 7 and model["global_steps"] == 3 and model["ds_version"] == "0.19.8"
    assert (written / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
