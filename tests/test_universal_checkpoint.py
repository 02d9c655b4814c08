"""Universal checkpoints (DeepSpeed's `ds_to_universal` layout, `"checkpoint": {"load_universal": true}`).

One run of tests/universal_common.py's model at 2 ranks, ZeRO-2, saves at step SAVE_AT and goes on to STEPS (the
uninterrupted run); `ds_to_universal` converts its checkpoint; runs at 1, 2 and 4 ranks and other stages load
the universal folder and finish the run. tests/fixtures/ds_universal/ is a universal folder DeepSpeed 0.19.8
wrote itself (tests/fixtures/ds_universal_script.py) with its own uninterrupted run's final parameters: loading
it must land on them too; tests/fixtures/ds_universal_zero3/ is DeepSpeed's conversion of a ZeRO-3 run (bare flat
tensors, no step.pt), likewise. Damaged universal folders are refused on every rank, naming the file, with the live
model unchanged. Live DeepSpeed loading our output: tests/integrations/test_deepspeed_universal.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from universal_common import SAVE_AT, STEPS, full_params, save_and_convert, shardspeed_engine, train

from harness import error_text, run_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "ds_universal"
FIXTURE_ZERO3 = (
    Path(__file__).parent / "fixtures" / "ds_universal_zero3"
)  # DeepSpeed's conversion of a ZeRO-3 run
# (world size, [(label, folder key, stage)]) of the resumed runs.
LOADS = {
    1: [("ours 2/s2 -> 1/s0", "ours", 0), ("deepspeed 2/s2 -> 1/s3", "deepspeed", 3)],
    2: [
        ("ours 2/s2 -> 2/s1", "ours", 1),
        ("deepspeed 2/s2 -> 2/s2", "deepspeed", 2),
        ("deepspeed 2/s3 -> 2/s1", "deepspeed_zero3", 1),  # flat tensors, no step.pt: DeepSpeed's ZeRO-3 form
    ],
    4: [("ours 2/s2 -> 4/s3", "ours", 3)],
}


def _resume(folders: dict, world: int, damaged: dict) -> dict:
    rank, out = int(os.environ["RANK"]), {}
    if world == 2:  # the same processes first make the run and the folder the others load
        out["uninterrupted"] = save_and_convert(folders["ours"])["final"]
    for label, key, stage in LOADS.get(world, []):
        engine = shardspeed_engine(
            world, stage, seed=123
        )  # other initial values: everything must come from the folder
        engine.load_checkpoint(folders[key])
        steps = engine.global_steps
        train(engine, range(SAVE_AT, STEPS), rank, world)
        # lr: the schedule went on from the saved step
        out[label] = {"steps": steps, "lr": engine.get_lr(), "params": full_params(engine)}
        engine.destroy()
    for label, folder in damaged.items():
        engine = shardspeed_engine(world, 2, seed=123)
        before = full_params(engine)
        error = error_text(lambda engine=engine, folder=folder: engine.load_checkpoint(folder))
        unchanged = all(torch.equal(before[n], v) for n, v in full_params(engine).items())
        out[label] = {"error": error, "unchanged": unchanged, "steps": engine.global_steps}
        engine.destroy()
    return out


def _damage(root: Path) -> dict[str, str]:
    """Copies of DeepSpeed's universal folder, each damaged one way; {label: folder}."""
    cases = {}

    def copy(label: str) -> Path:
        target = root / label
        shutil.copytree(FIXTURE, target)
        cases[label] = str(target)
        return target / f"global_step{SAVE_AT}_universal" / "zero"

    shutil.rmtree(copy("missing parameter") / "norm.bias")
    (copy("missing state file") / "inner.weight" / "exp_avg.pt").unlink()
    torch.save(
        {"param": torch.zeros(3, 9), "cat_dim": 0}, copy("wrong shape") / "outer.weight" / "exp_avg_sq.pt"
    )
    torch.save(_RunsCode(str(root / "ran")), copy("pickled code") / "inner.bias" / "fp32.pt")
    (Path(copy("no latest_universal")).parents[1] / "latest_universal").unlink()
    return cases


class _RunsCode:
    """Pickles to a call of `open` (a file write): a weights-only load must refuse it without running it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal")
    folders = {"ours": str(root / "ours"), "deepspeed": str(FIXTURE), "deepspeed_zero3": str(FIXTURE_ZERO3)}
    damaged = _damage(root / "damaged")
    results = {
        world: run_ranks(_resume, world, folders, world, damaged if world == 2 else {}) for world in (2, 1, 4)
    }
    return {"reference": results[2][0]["uninterrupted"], "results": results, "root": root}


def _case(runs, label: str) -> list[dict]:
    world = next(w for w, loads in LOADS.items() if label in [c[0] for c in loads])
    return [ranks[label] for ranks in runs["results"][world]]


@pytest.mark.parametrize("label", [c[0] for loads in LOADS.values() for c in loads])
def test_resume_from_universal_matches_uninterrupted_run(runs, label):
    if label.startswith("ours"):
        reference = runs["reference"]
    else:
        fixture = FIXTURE_ZERO3 if "2/s3 ->" in label else FIXTURE
        reference = torch.load(fixture / "reference.pt", weights_only=True)["params"]  # DeepSpeed's own run
    for rank, got in enumerate(_case(runs, label)):
        assert got["steps"] == SAVE_AT and got["lr"] == [0.01]
        diff = max((got["params"][n] - reference[n]).abs().max().item() for n in reference)
        print(f"{label} rank {rank}: max |param - uninterrupted| = {diff:.2e}")
        assert diff <= 1e-6, (label, rank, diff)


def test_written_layout_is_deepspeeds(runs):
    folder = runs["root"] / "ours" / f"global_step{SAVE_AT}_universal"
    assert (runs["root"] / "ours" / "latest_universal").read_text() == folder.name
    names = ["inner.weight", "inner.bias", "norm.weight", "norm.bias", "outer.weight"]
    assert sorted(p.name for p in (folder / "zero").iterdir()) == sorted([*names, "optimizer_state.pt"])
    for name, shape in zip(names, [(10, 6), (10,), (10,), (10,), (3, 10)]):
        files = sorted(p.name for p in (folder / "zero" / name).iterdir())
        assert files == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"], (name, files)
        for stem in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(folder / "zero" / name / f"{stem}.pt", weights_only=True)
            assert set(saved) == {"param", "cat_dim"} and saved["cat_dim"] == 0
            assert saved["param"].shape == shape and saved["param"].dtype == torch.float32
        assert torch.equal(
            torch.load(folder / "zero" / name / "step.pt", weights_only=True), torch.tensor(3.0)
        )
    optim = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=True)
    group = optim["param_groups"][0]
    assert group["params"] == [0, 1, 2, 3, 4] and group["betas"] == (0.9, 0.99)
    assert optim["optimizer_state_dict"]["state"][0]["step"] == 3 and optim["ds_version"] == "0.19.8"
    for states in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        model = torch.load(folder / states, weights_only=True)
        assert (model["global_steps"], model["dp_world_size"], model["mp_world_size"]) == (SAVE_AT, 2, 1)
        assert model["universal_checkpoint_info"] == {"universal_checkpoint_version": 0.4}


EXPECTED_ERRORS = {
    "missing parameter": ["zero/norm.bias/fp32.pt", "missing parameter"],
    "missing state file": ["zero/inner.weight", "exp_avg.pt"],
    "wrong shape": ["zero/outer.weight/exp_avg_sq.pt", "(3, 9)", "expected (3, 10)"],
    "pickled code": ["zero/inner.bias/fp32.pt", "could not be read"],
    "no latest_universal": ["latest_universal does not exist"],
}


@pytest.mark.parametrize("label", list(EXPECTED_ERRORS))
def test_damaged_universal_folder_is_refused_on_every_rank(runs, label):
    for rank, got in enumerate(ranks[label] for ranks in runs["results"][2]):
        assert got["error"].startswith("CheckpointError"), (rank, got["error"])
        for fragment in EXPECTED_ERRORS[label]:
            assert fragment in got["error"], (rank, fragment, got["error"])
        assert got["unchanged"] and got["steps"] == 0, (rank, label)  # nothing half-loaded
    assert not (runs["root"] / "damaged" / "ran").exists()  # the pickled call never ran


def test_command_refuses_what_it_cannot_honour(runs, capsys):
    from shardspeed.checkpoint.files import CheckpointError
    from shardspeed.checkpoint.to_universal import main

    source = str(runs["root"] / "ours" / f"global_step{SAVE_AT}")
    out = str(runs["root"] / "cli" / "out")
    with pytest.raises(SystemExit, match="--keep_temp_folder is not supported"):
        main(
            ["--input_folder", source, "--output_folder", out, "--keep_temp_folder", "--inject_missing_state"]
        )
    with pytest.raises(CheckpointError, match="pass --inject_missing_state"):
        main(["--input_folder", source, "--output_folder", out])
    with pytest.raises(SystemExit):
        main(["--input_folder", source, "--output_folder", out, "--merge_all"])
    assert "unrecognized arguments: --merge_all" in capsys.readouterr().err
    assert not Path(out).exists() and not (Path(out).parent / "latest_universal").exists()  # nothing written


def test_deepspeed_checkpoint_maps_onto_our_files(runs, tmp_path):
    from shardspeed.compat.mirrors.deepspeed_checkpoint import DeepSpeedCheckpoint
    from shardspeed.compat.not_offered import NotOfferedError

    source = runs["root"] / "ours" / f"global_step{SAVE_AT}"
    folder = tmp_path / "tag"
    shutil.copytree(source, folder)
    model = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)
    model.update(iteration=SAVE_AT, args={"num_layers": 2})  # what Megatron keeps in client state
    torch.save(model, folder / "mp_rank_00_model_states.pt")
    layers = {1: "embed", 2: "block0", 3: "block1", 4: "norm"}  # pipeline layer files, as Megatron names them
    for index, role in layers.items():
        torch.save(
            {"weight": torch.full((2,), float(index)), "role": role},
            folder / f"layer_{index:02d}-model_00-model_states.pt",
        )

    checkpoint = DeepSpeedCheckpoint(str(folder))
    assert (checkpoint.tp_degree, checkpoint.pp_degree, checkpoint.dp_degree, checkpoint.world_size) == (
        1,
        1,
        2,
        2,
    )
    assert checkpoint.get_iteration() == SAVE_AT and checkpoint.get_args() == {"num_layers": 2}
    assert checkpoint.get_embedding_state(0)["role"] == "embed"
    assert checkpoint.get_final_norm_state(0)["role"] == "norm"
    assert [sd["role"] for sd in checkpoint.get_transformer_state(0, 0)] == ["block0", "block1"]
    assert [Path(f).name for f in checkpoint.get_zero_files(0, 0, 1)] == [
        "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    ]
    assert checkpoint.get_2d_parallel_state(0, 0)["global_steps"] == SAVE_AT
    two_stages = DeepSpeedCheckpoint(str(folder), pp_degree=2)  # the transformer layers spread over 2 stages
    assert two_stages.get_pp_transformer_map(1) == ["layer_03"] and two_stages.is_change_pp_degree()
    with pytest.raises(
        NotOfferedError, match="get_zero_checkpoint_state returns DeepSpeed's ZeRO partition layout"
    ):
        checkpoint.get_zero_checkpoint_state(0, 0, 0)
    with pytest.raises(NotOfferedError, match="tp_degree=2"):
        DeepSpeedCheckpoint(str(folder), tp_degree=2)
