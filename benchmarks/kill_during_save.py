"""Kill a training job at random moments around `save_checkpoint`, then check what a fresh job loads.

Each trial starts a 2-rank job (each rank its own process group) that trains a small model and saves after
every step, rotating over tags so that tags are re-saved (the replace path) as well as created.
Before each save every rank records the state it is about to save (`records/<global step>.rank<R>.pt`);
after each save returns, rank 0 appends the step to `done`. Once the first save is done the driver waits a
random time and SIGKILLs every rank's process group at once. A fresh job of the same configuration then
calls `load_checkpoint` on the folder, and the trial is graded:

- `ok`: the loaded state (parameters, fp32 masters, optimizer state, counters) equals, bit for bit, the
  state recorded for the step it claims, on every rank, and that step is not older than the last save that
  returned before the kill (nothing completed is lost);
- `absent`: no checkpoint, only acceptable when no save had returned;
- anything else (a CheckpointError, a mismatch, an older step) counts as corrupt.

    python benchmarks/kill_during_save.py --trials 6          # 6 random trials per configuration (30)
    python benchmarks/kill_during_save.py --trials 0 --points # each fixed point inside a save (POINTS)

Prints one line per trial and a summary; exits 1 if any trial is corrupt. tests/test_kill_during_save.py
runs a small subset.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1, "reduce_bucket_size": 4000},
    "stage2": {"stage": 2, "reduce_bucket_size": 4000},
    "stage3": {"stage": 3, "reduce_bucket_size": 4000, "stage3_param_persistence_threshold": 64},
    "stage3-nvme": {"stage": 3, "reduce_bucket_size": 4000, "offload_optimizer": {"device": "nvme"}},
}
# The tag of each save, in turn: new tags, a re-save of the tag `latest` names (3rd) and of an older one.
TAGS = ("slot0", "slot1", "slot1", "slot2")
WORLD = 2


def make_config(name: str, trial_dir: Path) -> dict:
    zero = json.loads(json.dumps(CONFIGS[name]))
    if "offload_optimizer" in zero:
        zero["offload_optimizer"]["nvme_path"] = str(trial_dir / "nvme")
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 32)
    )


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 32, generator=torch.Generator().manual_seed(step * 1000 + rank))


def fingerprint(engine) -> list[torch.Tensor]:
    """Everything a checkpoint restores, as a flat list of tensors: parameters (gathered at stage 3),
    this rank's optimizer state (masters and moments) and the counters."""
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        out = [p.detach().float().clone() for p in engine.module.parameters()]
    _collect(engine.optimizer.state_dict(), out)
    out.append(torch.tensor([engine.global_steps, engine.global_samples, engine.micro_steps]))
    return out


def _collect(obj, out: list) -> None:
    if torch.is_tensor(obj):
        out.append(obj.detach().clone())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _collect(obj[key], out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect(value, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out.append(torch.tensor(float(obj), dtype=torch.float64))


def _write_atomically(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# Fixed moments inside a save (`--points`): rank 0 stops there during the 3rd save (a re-save of the tag
# `latest` names) and the driver kills the job as soon as it has.
POINTS = {
    "partition": "rank 0's partition file (stage 0: its model-states file) half written, rank 1's complete",
    "published": "the new tag folder in place, `latest` not yet rewritten",
    "aside": "the old copy of the re-saved tag moved aside, the new one not yet renamed into place",
}
STOP_AT_SAVE = 3


def _stop(trial_dir: Path) -> None:
    """Tell the driver this rank stopped where it was asked to, and wait for the SIGKILL."""
    (trial_dir / "stopped").write_text("")
    while True:
        time.sleep(1)


def install_stop(point: str, trial_dir: Path, saves: list[int], stage: int) -> None:
    """Patch the checkpoint writer of this process (rank 0) to stop at `point` during save STOP_AT_SAVE."""
    from shardspeed.checkpoint import files

    def armed() -> bool:
        return saves[0] == STOP_AT_SAVE

    if point == "partition":
        real_replace = os.replace

        def replace(src, dst):
            if armed() and ("zero_pp_rank_0" if stage else "mp_rank_00_model_states") in str(dst):
                Path(src).write_bytes(Path(src).read_bytes()[: Path(src).stat().st_size // 2])
                _stop(trial_dir)
            real_replace(src, dst)

        files.os.replace = replace  # the module's `os`, i.e. the process-wide one: patched for save_file
    elif point == "published":
        real_write = files.atomic_write_text

        def write(path, text):
            if armed():
                _stop(trial_dir)
            real_write(path, text)

        files.atomic_write_text = write
    elif point == "aside":
        real_rename = Path.rename

        def rename(self, target):
            result = real_rename(self, target)
            if armed() and str(target).endswith(".replaced"):
                _stop(trial_dir)
            return result

        Path.rename = rename  # engine_io publishes with Path.rename
    else:
        raise ValueError(f"unknown stop point {point!r}; known: {', '.join(POINTS)}")


def worker(name: str, trial_dir: Path, point: str | None = None) -> None:
    """One rank of the job that is killed: train and save, forever."""
    import torch.distributed as dist

    import shardspeed

    torch.set_num_threads(1)
    engine, *_ = shardspeed.initialize(model=make_model(), config=make_config(name, trial_dir))
    rank = dist.get_rank()
    records = trial_dir / "records"
    records.mkdir(exist_ok=True)
    saves = [0]
    if point is not None and rank == 0:
        install_stop(point, trial_dir, saves, CONFIGS[name]["stage"])
    for step in range(10**6):
        loss = engine(_batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        _write_atomically(fingerprint(engine), records / f"{engine.global_steps}.rank{rank}.pt")
        dist.barrier()  # every record is in place before any file of this step's checkpoint is
        saves[0] += 1
        engine.save_checkpoint(trial_dir / "ckpt", tag=TAGS[step % len(TAGS)])
        if rank == 0:
            with open(trial_dir / "done", "a") as f:
                f.write(f"{engine.global_steps}\n")
                f.flush()
                os.fsync(f.fileno())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, port: int) -> dict:
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip


def kill_trial(
    name: str, trial_dir: Path, delay: float, point: str | None = None, start_timeout: float = 120.0
):
    """Start the job, wait for its first completed save, wait `delay` s more (or, with `point`, until rank 0
    has stopped there), then SIGKILL every rank's process group."""
    trial_dir.mkdir(parents=True)
    port = _free_port()
    with open(trial_dir / "job.log", "w") as log:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", name, str(trial_dir), point or ""],
                env=_rank_env(rank, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the rank and any child it starts
            )
            for rank in range(WORLD)
        ]
        try:
            deadline = time.monotonic() + start_timeout
            while not (trial_dir / ("stopped" if point else "done")).exists():
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"job of trial {trial_dir} failed to start; see {trial_dir / 'job.log'}"
                    )
                time.sleep(0.02)
            time.sleep(0.0 if point else delay)
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait()


def leftovers(trial_dir: Path) -> dict:
    """What the kill left: a staging folder or an aside copy means it landed inside a save."""
    ckpt = trial_dir / "ckpt"
    hidden = [p.name for p in ckpt.iterdir() if p.name.startswith(".")] if ckpt.exists() else []
    swap = trial_dir / "nvme"
    return {
        "inside_save": any(h.endswith((".incomplete", ".replaced")) or ".tmp" in h for h in hidden),
        "hidden": sorted(hidden),
        "swap_folders": len(list(swap.iterdir())) if swap.exists() else 0,
    }


def verify_trials(trials: list[tuple[str, str]]) -> list[str]:
    """In a fresh job (every rank): load each trial's checkpoint and grade it (see the module docstring)."""
    import torch.distributed as dist

    import shardspeed

    verdicts = []
    for name, trial in trials:
        trial_dir = Path(trial)
        engine, *_ = shardspeed.initialize(model=make_model(), config=make_config(name, trial_dir / "verify"))
        rank = dist.get_rank()
        done = (trial_dir / "done").read_text().split()
        last_done = int(done[-1]) if done else 0
        try:
            path, _ = engine.load_checkpoint(trial_dir / "ckpt")
        except Exception as err:  # any failure to load is what this counts
            verdicts.append(f"corrupt: load raised {type(err).__name__}: {err}")
            engine.destroy()
            continue
        if path is None:
            verdicts.append(
                "absent" if last_done == 0 else f"corrupt: nothing loaded, step {last_done} was saved"
            )
            engine.destroy()
            continue
        got = fingerprint(engine)
        record = trial_dir / "records" / f"{engine.global_steps}.rank{rank}.pt"
        want = torch.load(record, weights_only=True) if record.exists() else None
        if want is None or len(want) != len(got) or not all(torch.equal(a, b) for a, b in zip(want, got)):
            verdicts.append(f"corrupt: state loaded from {path} differs from the state saved at its step")
        elif engine.global_steps < last_done:
            verdicts.append(
                f"corrupt: loaded step {engine.global_steps}, but step {last_done} had been saved"
            )
        else:
            verdicts.append(
                f"ok: step {engine.global_steps} ({Path(path).name}), last returned save {last_done}"
            )
        engine.destroy()
    return verdicts


def plan_trials(
    configs: list[str], trials_per_config: int, max_delay: float, seed: int, points: bool
) -> list:
    """(config, kill delay, stop point) of every trial: random delays, and each fixed point per config."""
    rng = random.Random(seed)
    plan = [(name, rng.uniform(0.0, max_delay), None) for name in configs for _ in range(trials_per_config)]
    if points:
        plan += [(name, 0.0, point) for name in configs for point in POINTS]
    return plan


def run(plan: list, root: Path) -> list[dict]:
    """All the trials, then one fresh verification job; one result dict per trial."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from harness import run_ranks

    trials = []
    for index, (name, delay, point) in enumerate(plan):
        trial_dir = root / f"{index:03d}-{name}-{point or 'random'}"
        kill_trial(name, trial_dir, delay, point)
        trials.append((name, str(trial_dir)))
    per_rank = run_ranks(verify_trials, WORLD, trials, timeout=600)
    results = []
    for i, ((name, delay, point), (_, trial)) in enumerate(zip(plan, trials)):
        verdicts = [per_rank[r][i] for r in range(WORLD)]
        ok = all(v.startswith(("ok", "absent")) for v in verdicts)
        when = point or f"{delay:.3f}s"
        left = leftovers(Path(trial))
        left["inside_save"] = left["inside_save"] or point is not None
        results.append({"config": name, "when": when, "ok": ok, "verdicts": verdicts, **left})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "TRIAL_DIR", "POINT"), help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=6, help="trials per configuration")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--max-delay", type=float, default=1.0, help="kill up to this many s after the 1st save"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--points", action="store_true", help="also kill at each fixed point inside a save")
    parser.add_argument(
        "--root", type=Path, default=None, help="where trials are written (default: a temp dir)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.worker[2] or None)
        return 0
    root = args.root or Path(tempfile.mkdtemp(prefix="kill-during-save-"))
    started = time.monotonic()
    plan = plan_trials(args.configs, args.trials, args.max_delay, args.seed, args.points)
    results = run(plan, root)
    for r in results:
        print(f"{r['config']:12s} kill at {r['when']:9s} inside_save={r['inside_save']!s:5s} "
              f"swap_folders_left={r['swap_folders']} {'OK ' if r['ok'] else 'BAD'} {r['verdicts'][0]}")  # fmt: skip
    corrupt = sum(not r["ok"] for r in results)
    inside = sum(r["inside_save"] for r in results)
    print(f"{len(results)} trials, {inside} killed inside a save, {corrupt} corrupt; {time.monotonic() - started:.0f} s; "
          f"trial folders in {root}")  # fmt: skip
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())
