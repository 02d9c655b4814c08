"""`engine.save_checkpoint` / `engine.load_checkpoint` with DeepSpeed's layout and semantics, over the
engine's list of checkpoint parts (checkpoint/parts.py): this module knows the steps, the parts know the state.

Layout (stage 0), compatible in names with DeepSpeed's (reference §3):

    <save_dir>/latest                          the newest tag (written last, atomically)
    <save_dir>/<tag>/mp_rank_00_model_states.pt every part's entries (module weights, optimizer wrapper state,
                                               scheduler, counters, config, ...) and client_state (written by
                                               data-parallel rank 0 of each model-parallel rank)
    <save_dir>/<tag>/rng_states_rank_<R>.pt    each rank's RNG streams (for bit-exact resume)

    <save_dir>/<tag>/zero_pp_rank_<D>_mp_rank_00_optim_states.pt
                                               ZeRO stages 1-3: data-parallel rank D's partition

Files beyond the model-states file are each part's own (`write_files`). Both calls are collective: every
rank must call them. A checkpoint saved at another data-parallel world size, ZeRO stage or bucket layout is
resharded on load by the part holding the weights; one saved by the same layout resumes bit for bit. See
docs/checkpoints.md.

A save never hangs on bad input: its steps (checking the arguments and client state, agreeing on one tag,
making the staging folder, writing every rank's files, publishing) each end in `agree` (checkpoint/agree.py),
so a step that fails on one rank raises the same error on every rank at once. Nothing is published unless
every rank wrote its files: a failed save removes its staging folder and leaves the previous checkpoint and
`latest` as they were. A load runs every part's check on every rank, agreed, before any part loads.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from shardspeed.checkpoint import files, verify
from shardspeed.checkpoint.agree import TagMismatchError, agree
from shardspeed.checkpoint.parts import (
    LoadContext,
    LoadOptions,
    Placement,
    SaveOptions,
    check_present,
    owned_keys,
)
from shardspeed.comm.collectives import all_gather_strings
from shardspeed.utils.logging import log_dist

__all__ = ["SaveSettings", "load_checkpoint", "save_checkpoint", "saving"]


@dataclass(frozen=True)
class SaveSettings:
    """What a save needs to know besides the parts: where this rank is, the tag to use when none is given,
    and `checkpoint.tag_validation` (Fail, Warn or Ignore)."""

    placement: Placement
    default_tag: str
    tag_validation: str = "Warn"


def _agree_on_place(settings: SaveSettings, save_dir: Path, tag: str) -> str:
    """The one tag every rank saves under: rank 0's (collective). Every rank must name the same folder; ranks
    that passed different tags are an error under `checkpoint.tag_validation: "Fail"`, a warning under "Warn",
    and silent under "Ignore"."""
    places = [p.split("\x1f") for p in all_gather_strings(f"{save_dir}\x1f{tag}", settings.placement.device)]
    folders, tags = [str(Path(f).resolve()) for f, _ in places], [t for _, t in places]
    if len(set(folders)) > 1:
        shown = ", ".join(f"rank {r}: {f!r}" for r, f in enumerate(folders))
        raise ValueError(
            f"save_checkpoint: save_dir differs across ranks ({shown}); every rank saves into one folder"
        )
    if len(set(tags)) == 1:
        return tag
    mode = settings.tag_validation
    message = (
        f"checkpoint tag differs across ranks ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))}); "
        "a tag must not depend on the rank"
    )
    if mode == "Fail":
        raise TagMismatchError(f"save_checkpoint: {message} (checkpoint.tag_validation is Fail)")
    if mode == "Warn":
        log_dist(f"{message}; saving every rank's files under rank 0's tag {tags[0]!r}", ranks=[0], level=30)
    return tags[0]


def _checked_arguments(settings: SaveSettings, save_dir, tag, client_state) -> tuple[Path, str]:
    """This rank's save folder and tag, after checking the arguments and that `client_state` will load."""
    if save_dir is None or (isinstance(save_dir, str) and not save_dir.strip()):
        raise ValueError(f"save_checkpoint: save_dir must name a folder, got {save_dir!r}")
    tag = str(tag) if tag is not None else settings.default_tag
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain folder name")
    if not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    files.check_loadable(client_state, "client_state")
    return Path(save_dir), tag


@contextlib.contextmanager
def saving(settings: SaveSettings, save_dir, tag, client_state, save_latest: bool):
    """Around the writes of one save (collective): yields `(save_dir, tag, staging)`, the folder every rank
    writes its files into; after the block, once every rank has written its files, rank 0 publishes them.
    Each step is agreed by every rank (`agree`): a failure anywhere raises the same error everywhere and
    removes the staging folder, publishing nothing."""
    device = settings.placement.device
    save_dir, tag = agree("save_checkpoint", lambda: _checked_arguments(settings, save_dir, tag, client_state),
                          device)  # fmt: skip
    tag = agree("save_checkpoint", lambda: _agree_on_place(settings, save_dir, tag), device)
    staging = files.staging_dir(save_dir, tag)
    leader = dist.get_rank() == 0

    def make_staging() -> None:
        if leader:
            save_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that crashed
            staging.mkdir()

    agree("save_checkpoint", make_staging, device)
    written: BaseException | None = None
    try:
        yield save_dir, tag, staging
    except Exception as err:  # agreed just below, so every rank stops here together
        written = err
    try:
        agree("save_checkpoint", written, device)  # every rank's files are written, or no rank goes on
        agree(
            "save_checkpoint",
            lambda: _publish(save_dir, tag, staging, save_latest) if leader else None,
            device,
        )
    except Exception:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def save_checkpoint(
    parts: list,
    settings: SaveSettings,
    save_dir,
    tag,
    client_state: dict,
    save_latest: bool,
    options: SaveOptions,
) -> bool:
    with saving(settings, save_dir, tag, client_state, save_latest) as (save_dir, tag, staging):
        _write_files(parts, settings.placement, staging, client_state, options)
    log_dist(f"saved checkpoint {save_dir / tag}")
    return True


def _write_files(parts: list, placement: Placement, staging: Path, client_state: dict,
                 options: SaveOptions) -> None:  # fmt: skip
    """This rank's files of the checkpoint (no agreement in here: see `saving`). The model-states file holds
    every part's entries and then the client's (which may overwrite them, as before parts existed); then
    each part writes its own files, in the list's order on every rank (some are collective)."""
    if placement.dp_rank == 0:
        state: dict = {}
        for part in parts:
            entries = part.state_dict(options)
            foreign = set(entries) - set(part.keys)
            if foreign:  # a part writes only what it declares: the keys are its on-disk contract
                raise ValueError(f"checkpoint part {part.name!r} wrote undeclared entries {sorted(foreign)}")
            state.update(entries)
        state.update(client_state)
        files.save_file(state, staging / files.model_states_name(placement.mp_rank))
    for part in parts:
        part.write_files(staging, options)


def _publish(save_dir: Path, tag: str, staging: Path, save_latest: bool) -> None:
    """Rename the finished staging folder into place, then point `latest` at it (rank 0, after every rank
    has written and fsynced its files). In this order a job killed at any moment leaves `latest` naming a
    complete checkpoint: the previous one, or this one once it is in place."""
    final = save_dir / tag
    aside = files.replaced_dir(save_dir, tag)
    files.fsync_dir(staging)
    if final.exists():
        # Re-saving a tag: two renames, as a folder cannot replace a non-empty one in one step. If the job
        # dies between them, loads find the old copy aside (files.tag_folder) until the next save of the tag.
        shutil.rmtree(aside, ignore_errors=True)
        final.rename(aside)
    staging.rename(final)
    files.fsync_dir(save_dir)
    shutil.rmtree(aside, ignore_errors=True)
    if save_latest:
        files.atomic_write_text(save_dir / files.LATEST, tag)


def load_checkpoint(parts: list, placement: Placement, load_dir, tag, options: LoadOptions):
    """`(path, client_state)`, or `(None, None)` when there is no checkpoint (collective). Every part's
    check runs on every rank first (agreed); then the parts load in order, with `load_module_only` only
    those holding the weights."""

    def check(path: Path, state: dict) -> None:
        for part in parts:
            part.check(path, state, options)
        check_present(parts, path, state, files.model_states_name(placement.mp_rank))

    opened = verify.open_checkpoint(placement, load_dir, tag, check, universal=options.universal)
    if opened is None:
        return None, None
    # From here on the live state changes: every check above has passed on every rank.
    path, state = opened
    ctx = LoadContext(path, options, state)
    for part in parts:
        if options.module_only and not part.holds_weights:
            continue
        # ctx.state, not `state`: a part may point the parts after it at another file (a pipeline stage's)
        part.load_state_dict({k: ctx.state[k] for k in part.keys if k in ctx.state}, ctx)
    if options.module_only:
        return str(path), {}
    owned = owned_keys(parts)
    client_state = {k: v for k, v in ctx.state.items() if k not in owned}
    dist.barrier()
    return str(path), client_state
