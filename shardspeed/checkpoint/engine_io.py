"""`engine.save_checkpoint` / `engine.load_checkpoint` with DeepSpeed's layout and semantics.

Layout (stage 0), compatible in names with DeepSpeed's (reference §3):

    <save_dir>/latest                          the newest tag (written last, atomically)
    <save_dir>/<tag>/mp_rank_00_model_states.pt module weights, optimizer wrapper state, scheduler, counters,
                                               config, client_state (written by rank 0)
    <save_dir>/<tag>/rng_states_rank_<R>.pt    each rank's RNG streams (for bit-exact resume)

    <save_dir>/<tag>/zero_pp_rank_<D>_mp_rank_00_optim_states.pt
                                               ZeRO stages 1-3: data-parallel rank D's partition

Both calls are collective: every rank must call them. A checkpoint saved at another data-parallel world
size, ZeRO stage or bucket layout is resharded on load (`_load_resharded`, via checkpoint/universal.py);
one saved by the same layout takes the fast path that resumes bit for bit. See docs/checkpoints.md.

A save never hangs on bad input: its steps (checking the arguments and client state, agreeing on one tag,
making the staging folder, writing every rank's files, publishing) each end in `agree` (checkpoint/agree.py),
so a step that fails on one rank raises the same error on every rank at once. Nothing is published unless
every rank wrote its files: a failed save removes its staging folder and leaves the previous checkpoint and
`latest` as they were.
"""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from shardspeed.checkpoint import files, verify
from shardspeed.checkpoint import tensor_parallel as tp_files
from shardspeed.checkpoint.agree import TagMismatchError, agree
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.comm.collectives import all_gather_strings
from shardspeed.utils.logging import log_dist
from shardspeed.version import __version__

# Keys the engine owns in the model-states file; everything else there is the client's state.
ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "lr_scheduler", "data_sampler", "global_steps", "global_samples",
    "skipped_steps", "micro_steps", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "shardspeed_version", "zero_stage", "zero_partitions", "param_shapes", "frozen_param_names", "shared_params",
    "num_experts", "moe_layout", "mp_rank", "tp_partitions", "compression_scheduler",
}  # fmt: skip


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _as_tuples(obj):
    return tuple(_as_tuples(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


def _agree_on_place(engine, save_dir: Path, tag: str) -> str:
    """The one tag every rank saves under: rank 0's (collective). Every rank must name the same folder; ranks
    that passed different tags are an error under `checkpoint.tag_validation: "Fail"`, a warning under "Warn",
    and silent under "Ignore"."""
    places = [p.split("\x1f") for p in all_gather_strings(f"{save_dir}\x1f{tag}", engine.device)]
    folders, tags = [str(Path(f).resolve()) for f, _ in places], [t for _, t in places]
    if len(set(folders)) > 1:
        shown = ", ".join(f"rank {r}: {f!r}" for r, f in enumerate(folders))
        raise ValueError(
            f"save_checkpoint: save_dir differs across ranks ({shown}); every rank saves into one folder"
        )
    if len(set(tags)) == 1:
        return tag
    mode = engine._config.checkpoint.tag_validation
    message = (
        f"checkpoint tag differs across ranks ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))}); "
        "a tag must not depend on the rank"
    )
    if mode == "Fail":
        raise TagMismatchError(f"save_checkpoint: {message} (checkpoint.tag_validation is Fail)")
    if mode == "Warn":
        log_dist(f"{message}; saving every rank's files under rank 0's tag {tags[0]!r}", ranks=[0], level=30)
    return tags[0]


def _checked_arguments(engine, save_dir, tag, client_state) -> tuple[Path, str]:
    """This rank's save folder and tag, after checking the arguments and that `client_state` will load."""
    if save_dir is None or (isinstance(save_dir, str) and not save_dir.strip()):
        raise ValueError(f"save_checkpoint: save_dir must name a folder, got {save_dir!r}")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a plain folder name")
    if not isinstance(client_state, dict):
        raise TypeError(f"save_checkpoint: client_state must be a dict, got {type(client_state).__name__}")
    files.check_loadable(client_state, "client_state")
    return Path(save_dir), tag


def shared_params(module) -> dict[str, str]:
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def _param_shapes(engine) -> dict[str, tuple]:
    """Every parameter's full shape, in the module's order (released stage-3 parameters are empty tensors:
    their shapes come from the units' layouts)."""
    shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    if engine.zero_optimization_stage() == 3 and engine.optimizer is not None:
        units = [u for w in _stage_wrappers(engine) for u in (*w.buckets, *w._frozen_units())]
        shapes.update({n: tuple(s) for u in units for n, s in zip(u.names, u.shapes)})
    if getattr(engine, "moe", None) is not None:  # experts are in their own files, by global index
        from shardspeed.moe.checkpoint import without_experts

        shapes = without_experts(shapes)
    return shapes


def _model_states(engine, client_state: dict, exclude_frozen: bool) -> dict:
    module_state = engine.module.state_dict()
    if engine.zero_optimization_stage() == 3:
        # Stage 3 parameters exist only as shards: they are in the per-rank partition files, not here
        # (tied aliases included: their entries would be released, empty tensors).
        params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
        module_state = {k: v for k, v in module_state.items() if k not in params}
    frozen = [n for n, p in engine.module.named_parameters() if not p.requires_grad]
    if exclude_frozen:
        for name in frozen:
            module_state.pop(name, None)
    state = {
        "module": module_state,
        "buffer_names": [n for n, _ in engine.module.named_buffers()],
        "param_shapes": _param_shapes(engine),
        "frozen_param_names": frozen,
        # Tied weights: state-dict keys that name the same tensor as an earlier parameter.
        "shared_params": shared_params(engine.module),
        # Stage 0 keeps the (replicated) optimizer state here; ZeRO stages write one file per rank.
        "optimizer": engine.optimizer.state_dict() if _replicated_optimizer(engine) else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "compression_scheduler": engine.compression.state_dict() if hasattr(engine, "compression") else None,
        "data_sampler": engine.training_dataloader.state_dict() if engine.training_dataloader else None,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "micro_steps": engine.micro_steps,
        "dp_world_size": engine.world_size,
        "mp_world_size": tp_files.mp_world_size(engine),
        "mp_rank": tp_files.mp_rank(engine),
        "tp_partitions": {n: p.as_dict() for n, p in tp_files._current_partitions(engine).items()},
        "zero_stage": engine.zero_optimization_stage(),
        # partition files written (none when there is no optimizer, or at stage 0): checked on load
        "zero_partitions": 0
        if engine.optimizer is None or _replicated_optimizer(engine)
        else engine.world_size,
        "ds_config": engine.config,
        "ds_version": __version__,
        "shardspeed_version": __version__,
    }
    if getattr(engine, "moe", None) is not None:
        from shardspeed.moe.checkpoint import moe_model_states

        state = moe_model_states(engine, state)
    state.update(client_state)
    return state


def _stage_wrappers(engine) -> list:
    """The stage wrappers: one, or one per reduction domain with MoE (moe/optimizer.py)."""
    domains = getattr(engine.optimizer, "domains", None)
    return [d.wrapper for d in domains] if domains is not None else [engine.optimizer]


@contextlib.contextmanager
def saving(engine, save_dir, tag, client_state, save_latest: bool):
    """Around the writes of one save (collective): yields `(save_dir, tag, staging)`, the folder every rank
    writes its files into; after the block, once every rank has written its files, rank 0 publishes them.
    Each step is agreed by every rank (`agree`): a failure anywhere raises the same error everywhere and
    removes the staging folder, publishing nothing."""
    device = engine.device
    save_dir, tag = agree("save_checkpoint", lambda: _checked_arguments(engine, save_dir, tag, client_state),
                          device)  # fmt: skip
    tag = agree("save_checkpoint", lambda: _agree_on_place(engine, save_dir, tag), device)
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
    engine, save_dir, tag, client_state: dict, save_latest: bool, exclude_frozen: bool
) -> bool:
    with saving(engine, save_dir, tag, client_state, save_latest) as (save_dir, tag, staging):
        _write_files(engine, staging, client_state, exclude_frozen)
    log_dist(f"saved checkpoint {save_dir / tag}")
    return True


def _write_files(engine, staging: Path, client_state: dict, exclude_frozen: bool) -> None:
    """This rank's files of the checkpoint (no collective in here: see `saving`)."""
    rank = dist.get_rank()
    if engine.dp_rank == 0:
        files.save_file(
            _model_states(engine, client_state, exclude_frozen),
            staging / files.model_states_name(tp_files.mp_rank(engine)),
        )
    if getattr(engine, "moe", None) is not None:  # expert files, per-rank optimizer state (collective)
        from shardspeed.moe.checkpoint import save_moe

        save_moe(engine, staging)
    elif engine.optimizer is not None and not _replicated_optimizer(engine):
        partition = {"optimizer_state_dict": engine.optimizer.state_dict(), "ds_config": engine.config,
                     "ds_version": __version__}  # fmt: skip
        files.save_file(
            partition, staging / files.zero_optim_states_name(engine.dp_rank, tp_files.mp_rank(engine))
        )
    files.save_file(_rng_state(), staging / files.rng_states_name(rank))


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


def load_checkpoint(engine, load_dir, tag, strict, load_optimizer_states, load_scheduler_states, module_only):
    load_optimizer = load_optimizer_states and not module_only

    def check(path: Path, state: dict) -> None:
        saved_stage = state.get("zero_stage")
        reshard = saved_stage in (0, 1, 2, 3) and _needs_reshard(engine, state, path)
        partitions_needed = saved_stage == 3 or load_optimizer or reshard
        if not isinstance(state.get("param_shapes"), dict) or not isinstance(state.get("module"), dict):
            raise CheckpointError(f"{path / files.model_states_name()} is not a shardspeed model-states file")
        _check_names_and_shapes(engine, state, strict, path)
        verify.check_consistent(engine, path, state, partitions_needed)

    opened = verify.open_checkpoint(engine, load_dir, tag, check)
    if opened is None:
        return None, None
    # From here on the live model and optimizer are changed: every check above has passed on every rank.
    path, state = opened
    moe_reshard = _load_moe(engine, path, state, strict, load_optimizer)
    reshard = moe_reshard if moe_reshard is not None else _needs_reshard(engine, state, path)
    if moe_reshard is not None:
        if module_only:
            return str(path), {}
    elif reshard:
        _load_resharded(engine, state, path, strict, load_optimizer_states and not module_only)
        if module_only:
            return str(path), {}
    elif engine.zero_optimization_stage() == 3:
        _load_stage3(engine, state, path, load_optimizer_states and not module_only)
        if module_only:
            return str(path), {}
    else:
        _load_module(engine, state, strict, path)
        if module_only:
            if engine.optimizer is not None:
                engine.optimizer.refresh_masters_from_module()
            return str(path), {}
        _load_optimizer(engine, state, load_optimizer_states, path)
    _load_progress(engine, state, load_scheduler_states, realign=reshard)
    _load_rng(path)
    client_state = {k: v for k, v in state.items() if k not in ENGINE_KEYS}
    dist.barrier()
    return str(path), client_state


def _load_progress(engine, state: dict, load_scheduler_states: bool, realign: bool) -> None:
    """Scheduler, data sampler and counters."""
    if load_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if load_scheduler_states and hasattr(engine, "compression"):
        engine.compression.load_state_dict(state.get("compression_scheduler"))
    if engine.training_dataloader is not None and state.get("data_sampler"):
        engine.training_dataloader.load_state_dict(state["data_sampler"])
    engine.global_steps = state["global_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = state["skipped_steps"]
    gas = engine.gradient_accumulation_steps()
    engine.micro_steps = state.get("micro_steps", engine.global_steps * gas)
    if realign and engine.micro_steps % gas:
        # Resharded with another accumulation count (the same global batch over another world size): start
        # the next accumulation window at its beginning, as the saved run would have.
        engine.micro_steps = engine.global_steps * gas


def _load_moe(engine, path: Path, state: dict, strict: bool, load_optimizer: bool) -> bool | None:
    """Models with MoE layers load through moe/checkpoint.py (None for others); True if resharded."""
    if getattr(engine, "moe", None) is None:
        return None
    from shardspeed.moe.checkpoint import load_moe

    return load_moe(engine, path, state, strict, load_optimizer)


def _needs_reshard(engine, state: dict, path: Path) -> bool:
    """True when the checkpoint's partitioning differs from this engine's: another data-parallel world
    size, ZeRO stage, or (stages 1-3) bucket layout, e.g. after changing reduce_bucket_size."""
    if getattr(engine, "moe", None) is not None:
        from shardspeed.moe.checkpoint import moe_layout

        return state.get("moe_layout") != moe_layout(engine)
    saved_stage, stage = state.get("zero_stage", 0), engine.zero_optimization_stage()
    if engine.optimizer is None:  # nothing partitioned here: only stage-3 parameters need assembling
        return saved_stage == 3 or stage == 3
    if state.get("dp_world_size", 1) != engine.world_size or saved_stage != stage:
        return True
    if tp_files.needs_tp_reshard(state, engine):
        return True
    if stage == 0:
        return False
    partition = path / files.zero_optim_states_name(engine.dp_rank, tp_files.mp_rank(engine))
    if not partition.is_file():
        return False  # the same-layout path reports the missing file
    try:
        saved = torch.load(partition, map_location="cpu", weights_only=True, mmap=True)[
            "optimizer_state_dict"
        ]
    except Exception:
        return False  # ditto for a corrupt one
    ours = [b.layout() for b in engine.optimizer.buckets]
    frozen = [u.layout() for u in engine.optimizer._frozen_units()]
    return saved.get("buckets") != ours or saved.get("frozen_buckets", []) != frozen


def _load_resharded(engine, state: dict, path: Path, strict: bool, load_optimizer_states: bool) -> None:
    """Load a checkpoint of any stage and world size: every rank assembles its own shards by name."""
    from shardspeed.checkpoint.universal import CheckpointReader

    if tp_files.needs_tp_reshard(state, engine):  # another tensor degree: merge and re-split by name
        reader = tp_files.TensorParallelReader(path, state, engine)
    else:
        reader = CheckpointReader(path, model_states=state, mp_rank=state.get("mp_rank", 0))
    log_dist(
        f"resharding checkpoint {path}: saved at ZeRO stage {reader.zero_stage} by {reader.world_size} "
        f"data-parallel ranks, loading at stage {engine.zero_optimization_stage()} on {engine.world_size}",
        ranks=[0],
    )
    _check_same_model(engine, reader, strict, path)
    restored: set[str] = set()
    with torch.no_grad():
        if engine.optimizer is not None:
            restored = engine.optimizer.load_universal(reader, load_optimizer_states)
        # Parameters outside the optimizer wrapper (frozen ones at stages 0-2, or no optimizer at all).
        for name, param in engine.module.named_parameters():
            if name not in restored and reader.has_value(name):
                param.data.copy_(reader.fp32(name))
    missing, unexpected = engine.module.load_state_dict(reader.buffers(), strict=False)
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    missing = [k for k in missing if k not in params]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path} buffers do not match the model: missing {missing}, unexpected {unexpected}"
        )


def _check_same_model(engine, reader, strict: bool, path: Path) -> None:
    ours = _param_shapes(engine)
    saved = reader.param_shapes()
    mismatched = [
        f"{name!r}: checkpoint {tuple(saved[name])}, model {shape}"
        for name, shape in ours.items()
        if name in saved and tuple(saved[name]) != shape
    ]
    if mismatched:
        shown = "; ".join(mismatched[:6]) + (
            f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else ""
        )
        raise CheckpointError(
            f"checkpoint {path} was saved from a different model: {len(mismatched)} parameter shapes differ ({shown})"
        )
    missing = [n for n in ours if not reader.has_value(n)]
    unexpected = [n for n in saved if n not in ours]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing parameters {missing[:6]}, unexpected "
            f"{unexpected[:6]} (load_module_strict=False loads the rest)"
        )


def _check_names_and_shapes(engine, state: dict, strict: bool, path: Path) -> None:
    """The checkpoint's parameters against the model's, from the recorded shapes (nothing loaded yet)."""
    ours = _param_shapes(engine)
    saved = tp_files.translate_shapes(state, engine)  # at this engine's tensor degree
    mismatched = [
        f"{name!r}: checkpoint {saved[name]}, model {shape}"
        for name, shape in ours.items()
        if name in saved and saved[name] != shape
    ]
    if mismatched:
        shown = "; ".join(mismatched[:6]) + (
            f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else ""
        )
        raise CheckpointError(
            f"checkpoint {path} was saved from a different model: {len(mismatched)} parameter shapes differ ({shown})"
        )
    if not strict:
        return
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    aliases = set(state.get("shared_params", {}))
    buffers_ours = set(engine.module.state_dict()) - params
    buffers_saved = set(state["module"]) - set(saved) - aliases
    missing = [n for n in ours if n not in saved] + sorted(buffers_ours - buffers_saved)
    unexpected = [n for n in saved if n not in ours] + sorted(buffers_saved - buffers_ours)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {missing[:6]}, unexpected {unexpected[:6]} "
            "(load_module_strict=False loads the rest)"
        )


def _load_module(engine, state: dict, strict: bool, path: Path) -> None:
    if "module" not in state:
        raise CheckpointError(
            f"{path / files.model_states_name()} has no 'module' entry: not a model checkpoint"
        )
    ours = dict(engine.module.named_parameters())
    mismatched = [
        f"{name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(ours[name].shape)}"
        for name, tensor in state["module"].items()
        if name in ours and tuple(tensor.shape) != tuple(ours[name].shape)
    ]
    if mismatched:
        shown = "; ".join(mismatched[:6]) + (
            f"; and {len(mismatched) - 6} more" if len(mismatched) > 6 else ""
        )
        raise CheckpointError(
            f"checkpoint {path} was saved from a different model: {len(mismatched)} parameter shapes differ ({shown})"
        )
    try:
        engine.module.load_state_dict(state["module"], strict=strict)
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {path} does not match the model: {err}") from err


def _load_stage3(engine, state: dict, path: Path, load_optimizer_states: bool) -> None:
    """Stage 3: buffers from the model file, parameters (and optimizer state) from this rank's shards."""
    if state.get("zero_stage") != 3:
        raise CheckpointError(f"checkpoint {path} was saved at ZeRO stage {state.get('zero_stage')}, not 3")
    missing, unexpected = engine.module.load_state_dict(state["module"], strict=False)
    params = {n for n, _ in engine.module.named_parameters(remove_duplicate=False)}
    if unexpected or [k for k in missing if k not in params]:
        raise CheckpointError(f"checkpoint {path} buffers do not match the model: {missing + unexpected}")
    saved = _optimizer_partition(engine, path)
    try:
        engine.optimizer.load_state_dict(saved, load_optimizer_states=load_optimizer_states)
    except (KeyError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"ZeRO-3 partition in {path} does not match this engine: {err}") from err


def _optimizer_partition(engine, path: Path) -> dict:
    """This rank's ZeRO optimizer partition, memory-mapped: the optimizer copies it sub-group by sub-group,
    so a partition larger than memory (NVMe offload) is read as it is copied."""
    partition = path / files.zero_optim_states_name(engine.dp_rank, tp_files.mp_rank(engine))
    return files.read_checkpoint(partition, mmap=True)["optimizer_state_dict"]


def _replicated_optimizer(engine) -> bool:
    return engine.optimizer is not None and engine.optimizer.zero_stage == 0


def _load_optimizer(engine, state: dict, load_optimizer_states: bool, path: Path) -> None:
    optimizer = engine.optimizer
    if optimizer is None:
        return
    if optimizer.zero_stage == 0 or not load_optimizer_states:
        saved = state.get("optimizer")
    else:
        saved = _optimizer_partition(engine, path)
    if not load_optimizer_states or saved is None:
        if hasattr(optimizer, "refresh_masters_from_module"):
            optimizer.refresh_masters_from_module()
        return
    if saved.get("zero_stage", 0) != optimizer.zero_stage:
        raise CheckpointError(
            f"checkpoint {path} holds ZeRO stage {saved.get('zero_stage')} optimizer state but this engine "
            f"runs stage {optimizer.zero_stage}"
        )
    try:
        optimizer.load_state_dict(saved)
    except (KeyError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"optimizer state in {path} does not match this optimizer: {err}") from err


def _load_rng(path: Path) -> None:
    rng_file = path / files.rng_states_name(dist.get_rank())
    if rng_file.is_file():
        _set_rng_state(files.load_file(rng_file))
    else:
        log_dist(f"{rng_file.name} not in checkpoint (saved at another world size): RNG streams not restored")
