"""Checks a checkpoint passes before a load changes anything, agreed by every rank.

`open_checkpoint` finds the checkpoint (`latest` or an explicit tag), reads its model-states file and runs
`check_consistent` on it — on every rank, before the model, optimizer or counters are touched — then all
ranks exchange their verdicts (checkpoint/agree.py). Either every rank goes on to load, or every rank
raises the same error (naming the rank that found the problem, the file and what is wrong with it: a
`CheckpointError`, or the `ValueError`/`OSError` a bad argument or an unreadable folder gave), or every
rank reports that there is no checkpoint (a missing or empty folder, as DeepSpeed: `(None, None)`). A problem only one rank can see (its own partition file) thus
never leaves the others waiting in a collective, nor half of the job loaded.

What is checked: every file the load will read exists, is a file, is not empty, is not truncated and
unpickles safely; the world size and ZeRO stage the model-states file records agree with the files present
(partition files of exactly ranks 0..N-1, RNG files of exactly N ranks, no partition files at stage 0) and
with what each partition file says of itself; parameter names and shapes match the model. A tensor whose
bytes were altered in place (same size, valid archive) is not detected: checkpoints carry no checksums.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from shardspeed.checkpoint import files
from shardspeed.checkpoint.agree import agree
from shardspeed.checkpoint.deepspeed_format import read_model_states
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.comm.collectives import all_gather_strings
from shardspeed.utils.logging import logger

__all__ = ["check_consistent", "open_checkpoint"]


def _partition_pattern(mp_rank: int) -> re.Pattern:
    return re.compile(rf"zero_pp_rank_(\d+)_mp_rank_{mp_rank:02d}_optim_states\.pt")


_RNG = re.compile(r"rng_states_rank_(\d+)\.pt")


def open_checkpoint(placement, load_dir, tag, check: Callable[[Path, dict], None], universal: bool = False):
    """`(path, model_states)` of the checkpoint to load, or None when there is none (every rank agrees).

    `placement` (checkpoint/parts.py) says which model-states file is this rank's and where its collectives
    run. `check(path, model_states)` runs the consistency checks on this rank; any error it, the arguments or the
    reading raise on any rank is raised on every rank. `universal`: a universal folder, found through
    `latest_universal` (checkpoint/universal_folder.py); there is always one, or the load fails."""

    def find_and_check():
        if load_dir is None or (isinstance(load_dir, str) and not load_dir.strip()):
            raise ValueError(f"load_checkpoint: load_dir must name a folder, got {load_dir!r}")
        if Path(load_dir).exists() and not Path(load_dir).is_dir():
            raise NotADirectoryError(f"load_checkpoint: {load_dir} is a file, not a checkpoint folder")
        opened = (
            _find_universal(Path(load_dir), tag)
            if universal
            else _find(Path(load_dir), tag, placement.mp_rank)
        )
        if opened is not None:
            check(*opened)
        return opened

    opened = agree("load_checkpoint", find_and_check, placement.device)
    found = all_gather_strings("1" if opened is not None else "", placement.device)
    if any(found) and not all(found):
        raise CheckpointError(
            f"ranks disagree on whether there is a checkpoint in {load_dir} (rank {found.index('')} finds none, "
            f"rank {found.index('1')} finds one): is the folder on storage every rank sees?"
        )
    return opened


def _find(load_dir: Path, tag, mp_rank: int = 0) -> tuple[Path, dict] | None:
    if tag is None:
        tag = files.read_latest(load_dir)
        if tag is None:
            logger.warning(f"no checkpoint to load: {load_dir / files.LATEST} does not exist")
            return None
        path = files.tag_folder(load_dir, tag)
        if not path.is_dir():
            staged = files.staging_dir(load_dir, tag)
            note = (
                f" (a save of it was interrupted: {staged.name} holds a partial copy)"
                if staged.exists()
                else ""
            )
            raise CheckpointError(
                f"{load_dir / files.LATEST} names checkpoint {tag!r}, but {load_dir / tag} does not exist{note}"
            )
    else:
        path = files.tag_folder(load_dir, str(tag))
        if not path.is_dir():  # a mistyped tag must not silently start the run afresh
            present = sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
            where = (
                f"tags in {load_dir}: {present}" if load_dir.is_dir() else f"{load_dir} does not exist either"
            )
            raise CheckpointError(f"checkpoint {load_dir / str(tag)} does not exist ({where})")
    if path.name != str(tag):
        logger.warning(
            f"loading {path}: the previous copy of tag {tag!r}, as a re-save of it was interrupted"
        )
    # this tensor rank's file (DeepSpeed's are seen through shardspeed's entries: deepspeed_format)
    return path, read_model_states(path, mp_rank)


def _find_universal(load_dir: Path, tag) -> tuple[Path, dict]:
    from shardspeed.checkpoint.universal_folder import model_states_file, read_latest_universal

    if not load_dir.is_dir():
        raise CheckpointError(f"load_universal: checkpoint folder {load_dir} does not exist")
    path = load_dir / str(tag if tag is not None else read_latest_universal(load_dir))
    if not path.is_dir():
        raise CheckpointError(f"universal checkpoint {path} does not exist")
    return path, files.read_checkpoint(model_states_file(path))


def _indices(path: Path, pattern: re.Pattern) -> list[int]:
    return sorted(int(m.group(1)) for p in path.iterdir() if (m := pattern.fullmatch(p.name)))


def _recorded(state: dict, key: str, valid: Callable[[object], bool], path: Path):
    value = state.get(key)
    if not valid(value):
        raise CheckpointError(
            f"{path / files.model_states_name()} records {key} = {value!r}, which is not valid"
        )
    return value


def check_consistent(placement, path: Path, state: dict, partitions_needed: bool) -> list[int]:
    """Raise a CheckpointError if the checkpoint at `path` is incomplete or contradicts itself.

    Returns the data-parallel ranks whose partition files this rank checked in full (each partition file
    is checked by one rank: this one checks those `r` with `r % world == dp_rank`)."""
    model_file = path / files.model_states_name()
    stage = _recorded(state, "zero_stage", lambda v: v in (0, 1, 2, 3), path)
    world = _recorded(state, "dp_world_size", lambda v: isinstance(v, int) and v > 0, path)
    mp_world = state.get("mp_world_size", 1)
    if not isinstance(state.get("param_shapes"), dict) or not isinstance(state.get("module"), dict):
        raise CheckpointError(
            f"{model_file} has no 'param_shapes'/'module' entries: not a shardspeed checkpoint"
        )

    rng_ranks = _indices(path, _RNG)
    if rng_ranks and rng_ranks != list(range(world * mp_world)):
        raise CheckpointError(
            f"checkpoint {path} records a data-parallel world size of {world} ({model_file.name}), but holds "
            f"RNG files of ranks {rng_ranks}: the recorded world size is wrong or files are missing"
        )
    own_rng = path / files.rng_states_name(placement.global_rank)
    if own_rng.exists():
        files.read_checkpoint(own_rng)

    present = _indices(path, _partition_pattern(state.get("mp_rank", 0)))
    if stage == 0 and present:
        raise CheckpointError(
            f"checkpoint {path} records ZeRO stage 0 ({model_file.name}), but holds ZeRO partition files of "
            f"ranks {present}: the recorded stage is wrong"
        )
    expected = list(range(world)) if stage > 0 and state.get("zero_partitions", world) else []
    extra = [r for r in present if r not in expected]
    if extra:
        raise CheckpointError(
            f"checkpoint {path} records {world} data-parallel rank(s) at ZeRO stage {stage} ({model_file.name}), "
            f"but holds partition files of ranks {extra} too: the recorded world size is wrong"
        )
    if not (partitions_needed and expected):
        return []
    missing = [files.zero_optim_states_name(r) for r in expected if r not in present]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it records {world} data-parallel rank(s) at ZeRO stage {stage}, "
            f"but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
        )
    from shardspeed.checkpoint.universal import CheckpointReader

    reader = CheckpointReader(path, model_states=state, mp_rank=state.get("mp_rank", 0))
    mine = [r for r in expected if r % placement.dp_world_size == placement.dp_rank]
    for rank in mine:
        reader.check_rank_file(rank)
    return mine
