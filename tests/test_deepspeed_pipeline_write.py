"""`shardspeed-to-deepspeed` on a shardspeed pipeline checkpoint: DeepSpeed 0.19.8's pipeline layout.

shardspeed's PipelineEngine trains tests/deepspeed_interop/pipe_script.py (2 ranks as 2 stages, ZeRO-1, fp32),
saves after 3 steps and trains 3 more. The save is written in DeepSpeed's layout at ZeRO stage 1 and 0; each
written folder must have the files, entries, parameter shapes and partition sizes of the one DeepSpeed itself
wrote for the same model (the fixture pipe-s1-fp32, and pipe-s0-fp32 for stage 0), and must resume (read back as
a DeepSpeed checkpoint) within 1e-6 of shardspeed's uninterrupted run. DeepSpeed resuming from them, live:
tests/integrations/test_deepspeed_pipeline_checkpoints.py. What DeepSpeed's pipelines cannot load is refused.
"""

import shutil
from pathlib import Path

import pytest
import torch

from harness import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_interop" / "fixtures"
TOLERANCE = 1e-6


def _save_convert_resume(tmp: str) -> dict:
    """In every rank: train, save and go on; rank 0 writes the save in DeepSpeed's layout at ZeRO 1 and 0; then
    resume from each written folder (one process group: a spawn costs more than these steps)."""
    import torch.distributed as dist
    from deepspeed_interop.pipe_script import run

    import shardspeed
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint

    shardspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    expected = run(shardspeed, world, 2, 1, f"{tmp}/w-save", save=f"{tmp}/ours")
    if dist.get_rank() == 0:
        for zero in (1, 0):
            write_deepspeed_checkpoint(f"{tmp}/ours", f"{tmp}/ds-s{zero}", zero_stage=zero)
    dist.barrier()
    resumed = {
        zero: run(shardspeed, world, 2, zero, f"{tmp}/w-{zero}", load=f"{tmp}/ds-s{zero}") for zero in (1, 0)
    }
    return {"expected": expected, "resumed": resumed}


def _content(path: Path) -> dict:
    from shardspeed.checkpoint.deepspeed_format import pickled

    return pickled.load(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list]:
    tmp = tmp_path_factory.mktemp("pipe-write")
    return tmp, run_ranks(_save_convert_resume, 2, str(tmp), timeout=300)


@pytest.mark.parametrize("zero", [1, 0])
def test_written_layout_is_deepspeeds(written, zero):
    tmp, _ = written
    ours, theirs = tmp / f"ds-s{zero}" / "global_step3", FIXTURES / f"pipe-s{zero}-fp32" / "global_step3"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert (tmp / f"ds-s{zero}" / "latest").read_text() == "global_step3"
    for stage in (0, 1):
        name = f"mp_rank_{stage:02d}_model_states.pt"
        mine, ref = _content(ours / name), _content(theirs / name)
        assert set(ref) <= set(mine), sorted(set(ref) - set(mine))
        for key in ("module", "param_shapes", "mp_world_size", "dp_world_size", "checkpoint_parallel_dimensions",
                    "global_steps", "global_samples", "buffer_names"):  # fmt: skip
            assert mine[key] == ref[key], (name, key, mine[key], ref[key])
        if zero == 0:  # torch's optimizer state, by index in the stage's parameter order
            assert [tuple(v["exp_avg"].shape) for _, v in sorted(mine["optimizer"]["state"].items())] == [
                tuple(v["exp_avg"].shape) for _, v in sorted(ref["optimizer"]["state"].items())
            ]
        else:
            part = f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt"
            a, b = (
                _content(ours / part)["optimizer_state_dict"],
                _content(theirs / part)["optimizer_state_dict"],
            )
            assert [t.shape for t in a["single_partition_of_fp32_groups"]] == [
                t.shape for t in b["single_partition_of_fp32_groups"]
            ]
            assert a["partition_count"] == b["partition_count"] and a["zero_stage"] == b["zero_stage"]


@pytest.mark.parametrize("zero", [1, 0])
def test_written_checkpoint_resumes_as_the_uninterrupted_run(written, zero):
    _, results = written
    expected, got = results[0]["expected"], results[0]["resumed"][zero]
    loss = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
    weights = max((got["weights"][n] - w).abs().max().item() for n, w in expected["weights"].items())
    assert loss <= TOLERANCE and weights <= TOLERANCE, (loss, weights)
    assert got["counters"] == expected["counters"]


def test_what_deepspeeds_pipelines_cannot_load_is_refused(written, tmp_path):
    from shardspeed.checkpoint.deepspeed_format import pickled
    from shardspeed.checkpoint.deepspeed_format.write import write_deepspeed_checkpoint
    from shardspeed.checkpoint.files import CheckpointError

    source = written[0] / "ours"
    with pytest.raises(CheckpointError, match="runs ZeRO stage 0 or 1"):
        write_deepspeed_checkpoint(source, tmp_path / "s2", zero_stage=2)
    bf16 = tmp_path / "bf16"
    shutil.copytree(source, bf16)
    for stage in (0, 1):
        path = bf16 / "global_step3" / f"mp_rank_{stage:02d}_model_states.pt"
        content = pickled.load(path)
        content["ds_config"]["bf16"] = {"enabled": True}
        torch.save(content, path)
    with pytest.raises(CheckpointError, match="BF16_Optimizer"):
        write_deepspeed_checkpoint(bf16, tmp_path / "bf16-s0", zero_stage=0)
    with pytest.raises(CheckpointError, match="is a DeepSpeed pipeline checkpoint"):
        write_deepspeed_checkpoint(FIXTURES / "pipe-s1-fp32", tmp_path / "again")
    assert not (tmp_path / "s2").exists() and not (tmp_path / "bf16-s0").exists()
