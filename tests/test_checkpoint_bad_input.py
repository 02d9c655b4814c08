"""Bad input to save_checkpoint / load_checkpoint never hangs: every rank gets the same error within seconds.

Each case once hung (a rank raised alone while the others waited in a barrier) or crashed unhelpfully:
different tags per rank, `save_dir=""` / `None`, a client state only one rank cannot save, a write that fails
on one rank, load folders that are missing, empty, a file, or named differently per rank. The harness
bounds the run well below the process group's timeout, so a hang fails the test instead of stalling it.
A failed save leaves the previous checkpoint and `latest` as they were (and no staging folder behind).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from common import base_config
from harness import run_ranks
from models import TinyGPT, token_batches

HANG_BOUND_S = 90  # well below the harness's process-group timeout (2 minutes): a hang fails here


def _engine(tag_validation: str):
    import shardspeed

    torch.manual_seed(0)
    config = base_config(zero_optimization={"stage": 1}, checkpoint={"tag_validation": tag_validation})
    engine, *_ = shardspeed.initialize(model=TinyGPT(), config=copy.deepcopy(config))
    data = token_batches(1, engine.train_batch_size())[0]
    rank, micro = engine.dp_rank, engine.train_micro_batch_size_per_gpu()
    for index in range(engine.gradient_accumulation_steps()):
        start = (index * engine.world_size + rank) * micro
        engine.backward(engine(data[start : start + micro]))
        engine.step()
    return engine


def _outcome(call) -> str:
    """'ok: <result>' or '<ExceptionType>: <message>' (the same string on every rank when they agree)."""
    try:
        return f"ok: {call()}"
    except Exception as err:  # the point is which type and message each rank got
        return f"{type(err).__name__}: {err}"


def _bad_saves(root: str) -> dict:
    import torch.distributed as dist

    from shardspeed.checkpoint import files

    warn, fail, ignore = _engine("Warn"), _engine("Fail"), _engine("Ignore")
    rank, out = dist.get_rank(), {}
    warn.save_checkpoint(f"{root}/keep", tag="good")  # what every failed save below must leave intact

    out["empty save_dir"] = _outcome(lambda: warn.save_checkpoint(""))
    out["None save_dir"] = _outcome(lambda: warn.save_checkpoint(None))
    out["tags differ, Fail"] = _outcome(lambda: fail.save_checkpoint(f"{root}/fail", tag=f"tag-{rank}"))
    out["tags differ, Warn"] = _outcome(lambda: warn.save_checkpoint(f"{root}/warn", tag=f"tag-{rank}"))
    out["tags differ, Ignore"] = _outcome(lambda: ignore.save_checkpoint(f"{root}/ignore", tag=f"tag-{rank}"))
    bad_state = (
        {"step": 3} if rank == 0 else {"step": 3, "hook": lambda: None}
    )  # only rank 1's cannot be saved
    out["client_state on one rank"] = _outcome(
        lambda: warn.save_checkpoint(f"{root}/keep", tag="bad-state", client_state=bad_state)
    )

    real_save = files.save_file

    def unwritable_on_rank_1(obj, path: Path) -> None:
        if rank == 1:
            raise PermissionError(13, "Permission denied", str(path))
        real_save(obj, path)

    files.save_file = unwritable_on_rank_1
    try:
        out["write fails on one rank"] = _outcome(
            lambda: warn.save_checkpoint(f"{root}/keep", tag="unwritable")
        )
    finally:
        files.save_file = real_save
    out["save_dir differs per rank"] = _outcome(lambda: warn.save_checkpoint(f"{root}/own-{rank}", tag="t"))

    keep = Path(root) / "keep"
    out["keep after failures"] = sorted(p.name for p in keep.iterdir())
    out["latest after failures"] = (keep / "latest").read_text()
    out["keep loads"] = _outcome(lambda: warn.load_checkpoint(str(keep))[0])
    out["warn saved"] = sorted(p.name for p in (Path(root) / "warn").iterdir())
    out["warn loads"] = _outcome(lambda: warn.load_checkpoint(f"{root}/warn")[0])
    return out


def _bad_loads(root: str) -> dict:
    import torch.distributed as dist

    engine = _engine("Warn")
    rank = dist.get_rank()
    Path(root, "empty").mkdir(exist_ok=True)
    Path(root, "a_file").write_text("not a folder")
    return {
        "missing folder": _outcome(lambda: engine.load_checkpoint(f"{root}/missing")),
        "empty folder": _outcome(lambda: engine.load_checkpoint(f"{root}/empty")),
        "empty load_dir": _outcome(lambda: engine.load_checkpoint("")),
        "None on one rank": _outcome(lambda: engine.load_checkpoint(None if rank == 1 else f"{root}/empty")),
        "a file": _outcome(lambda: engine.load_checkpoint(f"{root}/a_file")),
        "missing tag": _outcome(lambda: engine.load_checkpoint(f"{root}/empty", tag="nope")),
    }


def test_bad_saves_fail_the_same_way_on_every_rank_and_keep_the_previous_checkpoint(tmp_path):
    ranks = run_ranks(_bad_saves, 2, str(tmp_path), timeout=HANG_BOUND_S)
    for key in ranks[0]:
        if key not in ("keep loads", "warn loads"):  # paths are the same; the rest must be identical too
            assert ranks[0][key] == ranks[1][key], (key, ranks[0][key], ranks[1][key])
    out = ranks[0]
    assert out["empty save_dir"].startswith("ValueError: ") and "save_dir must name a folder, got ''" in out[
        "empty save_dir"]  # fmt: skip
    assert out["None save_dir"].startswith("ValueError: ") and "got None" in out["None save_dir"]
    fail = out["tags differ, Fail"]
    assert fail.startswith("TagMismatchError: ") and "rank 0: 'tag-0', rank 1: 'tag-1'" in fail
    assert out["tags differ, Warn"] == "ok: True" and out["tags differ, Ignore"] == "ok: True"
    # rank 0's tag, one consistent checkpoint (and, at ZeRO stage 1, the recovery script beside it)
    assert out["warn saved"] == ["latest", "tag-0", "zero_to_fp32.py"]
    assert out["warn loads"].endswith("/warn/tag-0")
    client = out["client_state on one rank"]
    assert client.startswith("TypeError: ") and "failed on rank 1" in client and "client_state" in client
    write = out["write fails on one rank"]
    assert (
        write.startswith("PermissionError: ") and "failed on rank 1" in write and "Permission denied" in write
    )
    differs = out["save_dir differs per rank"]
    assert (
        differs.startswith("ValueError: ")
        and "save_dir differs across ranks" in differs
        and "own-1" in differs
    )
    # Nothing of the failed saves is left, nothing earlier is lost.
    assert out["keep after failures"] == ["good", "latest", "zero_to_fp32.py"]
    assert out["latest after failures"] == "good"
    assert out["keep loads"].endswith("/keep/good")


def test_bad_loads_fail_the_same_way_on_every_rank(tmp_path):
    ranks = run_ranks(_bad_loads, 2, str(tmp_path), timeout=HANG_BOUND_S)
    assert ranks[0] == ranks[1]
    out = ranks[0]
    # A missing or empty folder holds no checkpoint: (None, None), as DeepSpeed returns.
    assert out["missing folder"] == "ok: (None, None)" and out["empty folder"] == "ok: (None, None)"
    assert (
        out["empty load_dir"].startswith("ValueError: ")
        and "load_dir must name a folder" in out["empty load_dir"]
    )
    none = out["None on one rank"]
    assert none.startswith("ValueError: ") and "failed on rank 1" in none and "got None" in none
    assert out["a file"].startswith("NotADirectoryError: ") and "a_file is a file" in out["a file"]
    assert (
        out["missing tag"].startswith("CheckpointError: ")
        and "empty/nope does not exist" in out["missing tag"]
    )
