"""Tampered checkpoints are refused on every rank with a CheckpointError naming the file and the fault,
and a refused load leaves the live model, optimizer and counters exactly as they were."""

import copy
import shutil
from pathlib import Path

import torch

from common import base_config, full_params, train_engine
from harness import run_ranks
from models import TinyGPT, token_batches

STAGE2 = base_config(zero_optimization={"stage": 2, "reduce_bucket_size": 3000})
PARTITION1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


class RunsCode:
    """Unpickling this runs a command that leaves a marker file (a safe load must refuse it)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_model_states(tag: Path, **changes) -> None:
    state = torch.load(tag / MODEL, weights_only=True)
    for key, change in changes.items():
        state[key] = change(state[key]) if callable(change) else change
    torch.save(state, tag / MODEL)


def _rename_param(shapes: dict) -> dict:
    return {("blocks.0.mlpx.0.weight" if n == "blocks.0.mlp.0.weight" else n): s for n, s in shapes.items()}


def _reshape_param(shapes: dict) -> dict:
    return {**shapes, "ln_f.weight": (33,)}


def _tamperings(marker: str) -> dict:
    """name -> (what to do to the tag folder `t` of a copy of the good checkpoint, fragments of the error)."""

    def latest_gone(t: Path):
        (t.parent / "latest").write_text("gone")

    def code_pickle(t: Path):
        torch.save({"optimizer_state_dict": RunsCode(marker)}, t / PARTITION1)

    def world_one(t: Path):  # RNG files removed too, so that only the partitions contradict it
        for r in (0, 1):
            (t / f"rng_states_rank_{r}.pt").unlink()
        _edit_model_states(t, dp_world_size=1)

    def folder(t: Path):
        (t / MODEL).unlink()
        (t / MODEL).mkdir()

    return {
        "truncated partition": (lambda t: _truncate(t / PARTITION1), [PARTITION1, "is truncated"]),
        "truncated model states": (lambda t: _truncate(t / MODEL), [MODEL, "is truncated"]),
        "partition missing": (lambda t: (t / PARTITION1).unlink(), [PARTITION1, "is missing", "incomplete"]),
        "latest names a missing tag": (latest_gone, ["latest names checkpoint 'gone'", "does not exist"]),
        "parameter renamed": (
            lambda t: _edit_model_states(t, param_shapes=_rename_param),
            ["does not match the model", "'blocks.0.mlp.0.weight'", "'blocks.0.mlpx.0.weight'"],
        ),
        "parameter reshaped": (
            lambda t: _edit_model_states(t, param_shapes=_reshape_param),
            ["different model", "'ln_f.weight': checkpoint (33,), model (32,)"],
        ),
        "world size recorded as 4": (
            lambda t: _edit_model_states(t, dp_world_size=4),
            ["data-parallel world size of 4", "RNG files of ranks [0, 1]"],
        ),
        "world size recorded as 1": (
            world_one,
            ["records 1 data-parallel rank(s) at ZeRO stage 2", "partition files of ranks [1]"],
        ),
        "stage recorded as 0": (
            lambda t: _edit_model_states(t, zero_stage=0),
            ["records ZeRO stage 0", "partition files of ranks [0, 1]"],
        ),
        "stage recorded as 3": (
            lambda t: _edit_model_states(t, zero_stage=3),
            ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "ZeRO stage 2, the model-states file says 3"],
        ),
        "stage recorded as 7": (
            lambda t: _edit_model_states(t, zero_stage=7),
            [MODEL, "records zero_stage = 7"],
        ),
        "code-running pickle": (code_pickle, [PARTITION1, "safe load refuses"]),
        "empty RNG file": (
            lambda t: (t / "rng_states_rank_0.pt").write_bytes(b""),
            ["rng_states_rank_0.pt", "is empty (0 bytes)"],
        ),
        "folder for a file": (folder, [MODEL, "is a folder"]),
        "not a checkpoint": (
            lambda t: (t / PARTITION1).write_text("hello"),
            [PARTITION1, "is not a torch checkpoint"],
        ),
    }


def _live_state(engine) -> dict:
    optimizer = engine.optimizer.state_dict()
    return {
        "params": full_params(engine),
        "masters": [m.clone() for m in optimizer["fp32_shards"]],
        "optimizer": [{k: v.clone() for k, v in s.items()} for s in optimizer["optimizer_states"]],
        "steps": (engine.global_steps, engine.global_samples, engine.micro_steps),
        "lr": engine.lr_scheduler.get_last_lr(),
        "rng": torch.get_rng_state(),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        and all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
        and all(torch.equal(x[k], y[k]) for x, y in zip(a["optimizer"], b["optimizer"]) for k in x)
        and a["steps"] == b["steps"]
        and a["lr"] == b["lr"]
        and torch.equal(a["rng"], b["rng"])
    )


def _tampered_loads(root: str, marker: str) -> dict:
    import torch.distributed as dist

    import shardspeed

    torch.manual_seed(0)
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(STAGE2))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = token_batches(4, engine.train_batch_size())
    train_engine(engine, data, range(2), rank, world)
    engine.save_checkpoint(f"{root}/good", tag="t")
    train_engine(engine, data, range(2, 4), rank, world)  # the live state now differs from the checkpoint
    before = _live_state(engine)

    results = {}
    for name, (tamper, _) in _tamperings(marker).items():
        case = Path(root) / name.replace(" ", "_")
        if rank == 0:
            shutil.copytree(Path(root) / "good", case)
            tamper(case / "t")
        dist.barrier()
        try:
            engine.load_checkpoint(str(case))
            results[name] = "loaded"
        except shardspeed.CheckpointError as err:
            results[name] = str(err)
        results[name + " unchanged"] = _same(before, _live_state(engine))

    # An explicit tag that does not exist: refused too (a mistyped tag must not start the run afresh).
    try:
        engine.load_checkpoint(f"{root}/good", tag="nope")
        results["missing explicit tag"] = "loaded"
    except shardspeed.CheckpointError as err:
        results["missing explicit tag"] = str(err)
    results["missing explicit tag unchanged"] = _same(before, _live_state(engine))

    # The good checkpoint still loads after all those refusals, and does change the state.
    path, _ = engine.load_checkpoint(f"{root}/good")
    results["good loads"] = path.endswith("good/t") and not _same(before, _live_state(engine))
    return results, _interrupted_saves(engine, f"{root}/interrupted")


def test_tampered_and_interrupted_checkpoints(tmp_path):
    marker = tmp_path / "code-ran"
    both = run_ranks(_tampered_loads, 2, str(tmp_path), str(marker))
    results = [tampered for tampered, _ in both]
    for rank, res in enumerate(results):
        for name, (_, fragments) in _tamperings(str(marker)).items():
            message = res[name]
            assert message != "loaded", f"rank {rank}: {name} was loaded"
            for fragment in fragments:
                assert fragment in message, f"rank {rank}, {name}: {fragment!r} not in {message!r}"
            assert res[name + " unchanged"], f"rank {rank}: refusing {name} changed the live state"
        assert (
            "good/nope does not exist (tags in" in res["missing explicit tag"]
            and "'t'" in res["missing explicit tag"]
        )
        assert res["missing explicit tag unchanged"]
        assert res["good loads"]
    # A fault only rank 1 reads first is reported on rank 0 too, naming the rank that found it: the same
    # error on every rank.
    assert results[0]["code-running pickle"].startswith("load_checkpoint failed on rank 1: ")
    assert results[0]["code-running pickle"] == results[1]["code-running pickle"]
    assert not marker.exists()

    # Interrupted saves: the old copy of a re-saved tag, left aside, loads; `latest` naming a tag whose save
    # never finished is refused saying so.
    for _, res in both:
        assert res["aside loads"]
        assert res["after resave"] == ["latest", "t", "zero_to_fp32.py"]  # ZeRO: the recovery script beside
        assert (
            "names checkpoint 'u'" in res["unfinished"]
            and ".u.incomplete holds a partial copy" in res["unfinished"]
        )


def _interrupted_saves(engine, root: str) -> dict:
    """The states a job killed mid-save leaves behind load as the previous checkpoint."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed.checkpoint import files

    rank, world = dist.get_rank(), dist.get_world_size()
    data = token_batches(4, engine.train_batch_size())
    engine.save_checkpoint(root, tag="t")
    saved = full_params(engine)
    train_engine(engine, data, range(1, 2), rank, world)
    results = {}

    # Killed while re-saving tag "t", between moving the old copy aside and renaming the new one in.
    if rank == 0:
        (Path(root) / "t").rename(files.replaced_dir(Path(root), "t"))
        shutil.copytree(files.replaced_dir(Path(root), "t"), files.staging_dir(Path(root), "t"))
    dist.barrier()
    path, _ = engine.load_checkpoint(root)
    loaded = full_params(engine)
    results["aside loads"] = path.endswith(".t.replaced") and all(
        torch.equal(saved[k], loaded[k]) for k in saved
    )

    # The next save of "t" publishes normally and drops both leftovers.
    engine.save_checkpoint(root, tag="t")
    results["after resave"] = sorted(p.name for p in Path(root).iterdir())
    dist.barrier()

    # `latest` naming a tag whose save never finished: the error says so.
    if rank == 0:
        files.staging_dir(Path(root), "u").mkdir()
        (Path(root) / "latest").write_text("u")
    dist.barrier()
    try:
        engine.load_checkpoint(root)
    except shardspeed.CheckpointError as err:
        results["unfinished"] = str(err)
    return results
