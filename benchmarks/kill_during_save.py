"""Kill a training job at random moments around `save_checkpoint`, then check what a fresh job loads.

Each trial starts a 2-rank job (each rank its own process group) that trains a small model and saves after
every step, rotating over three tags so that tags are re-saved (the replace path) as well as created.
Before each save every rank records the state it is about to save (`records/<global step>.rank<R>.pt`);
after each save returns, rank 0 appends the step to `done`. Once the first save is done the driver waits a
random time and SIGKILLs every rank's process group at once. A fresh job of the same configuration then
calls `load_checkpoint` on the folder, and the trial is graded:

- `ok`: the loaded state (parameters, fp32 masters, optimizer state, counters) equals, bit for bit, the
  state recorded for the step it claims, on every rank, and that step is not older than the last save that
  returned before the kill (nothing completed is lost);
- `absent`: no checkpoint, only acceptable when no save had returned;
- anything else (a CheckpointError, a mismatch, an older step) counts as corrupt.

    python benchmarks/kill_during_save.py --trials 6          # 6 trials per configuration (30 in all)

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
TAGS = ("slot0", "slot1", "slot2")
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


def worker(name: str, trial_dir: Path) -> None:
    """One rank of the job that is killed: train and save, forever."""
    import torch.distributed as dist

    import shardspeed

    torch.set_num_threads(1)
    engine, *_ = shardspeed.initialize(model=make_model(), config=make_config(name, trial_dir))
    rank = dist.get_rank()
    records = trial_dir / "records"
    records.mkdir(exist_ok=True)
    for step in range(10**6):
        loss = engine(_batch(step, rank)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        _write_atomically(fingerprint(engine), records / f"{engine.global_steps}.rank{rank}.pt")
        dist.barrier()  # every record is in place before any file of this step's checkpoint is
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


def kill_trial(name: str, trial_dir: Path, delay: float, start_timeout: float = 120.0) -> None:
    """Start the job, wait for its first completed save, wait `delay` s more, SIGKILL every rank's group."""
    trial_dir.mkdir(parents=True)
    port = _free_port()
    with open(trial_dir / "job.log", "w") as log:
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", name, str(trial_dir)],
                env=_rank_env(rank, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the rank and any child it starts
            )
            for rank in range(WORLD)
        ]
        try:
            deadline = time.monotonic() + start_timeout
            while not (trial_dir / "done").exists():
                if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"job of trial {trial_dir} failed to start; see {trial_dir / 'job.log'}"
                    )
                time.sleep(0.02)
            time.sleep(delay)
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


def run(configs: list[str], trials_per_config: int, root: Path, max_delay: float, seed: int) -> list[dict]:
    """All the trials, then one fresh verification job; one result dict per trial."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from harness import run_ranks

    rng = random.Random(seed)
    plan = []
    for name in configs:
        for index in range(trials_per_config):
            trial_dir = root / f"{name}-{index}"
            delay = rng.uniform(0.0, max_delay)
            kill_trial(name, trial_dir, delay)
            plan.append((name, str(trial_dir), delay))
    per_rank = run_ranks(verify_trials, WORLD, [(n, t) for n, t, _ in plan], timeout=600)
    results = []
    for i, (name, trial, delay) in enumerate(plan):
        verdicts = [per_rank[r][i] for r in range(WORLD)]
        ok = all(v.startswith(("ok", "absent")) for v in verdicts)
        results.append({"config": name, "delay_s": round(delay, 3), "ok": ok, "verdicts": verdicts,
                        **leftovers(Path(trial))})  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "TRIAL_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=6, help="trials per configuration")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument(
        "--max-delay", type=float, default=1.0, help="kill up to this many s after the 1st save"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--root", type=Path, default=None, help="where trials are written (default: a temp dir)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0
    root = args.root or Path(tempfile.mkdtemp(prefix="kill-during-save-"))
    started = time.monotonic()
    results = run(args.configs, args.trials, root, args.max_delay, args.seed)
    for r in results:
        print(f"{r['config']:12s} delay {r['delay_s']:.3f}s inside_save={r['inside_save']!s:5s} "
              f"swap_folders_left={r['swap_folders']} {'OK ' if r['ok'] else 'BAD'} {r['verdicts'][0]}")  # fmt: skip
    corrupt = sum(not r["ok"] for r in results)
    inside = sum(r["inside_save"] for r in results)
    print(f"{len(results)} trials, {inside} killed inside a save, {corrupt} corrupt; {time.monotonic() - started:.0f} s; "
          f"trial folders in {root}")  # fmt: skip
    return 1 if corrupt else 0


if __name__ == "__main__":
    sys.exit(main())
