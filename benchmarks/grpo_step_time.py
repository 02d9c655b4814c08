"""TRL's GRPOTrainer step time on shardspeed and on DeepSpeed 0.19.8: the same job, the same machine, runs
interleaved (ours, theirs, ours, theirs, ...).

    python benchmarks/grpo_step_time.py --deepspeed-python /path/to/ds-venv/bin/python [--rounds 3] [--steps 8]

Each run is one torchrun launch of 2 CPU ranks running tests/integrations/trl_job.py's GRPO job (tiny Llama
from a config, fp32, a KL reference, 2 generations of 6 tokens per prompt) at each ZeRO stage asked for, with
`--steps` optimizer steps. The time of a step is TRL's own logged `step_time` (generation, reward, reference
and policy forward/backward, optimizer step); the first step of every run (warm-up: first allocations, JIT-built
ops) is left out. Reports, per framework and stage, the median over all kept steps of all rounds, the min and
max, and each round's median; also the largest difference between the losses the two logged. Writes
benchmarks/results/grpo_step_time.{json,md}. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
sys.path.insert(0, str(ROOT / "tests"))

from alias_path import env_with_alias  # noqa: E402

from harness import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# Run inside each rank: trl_job's GRPO trainer, its per-step times kept (the job itself logs losses only).
RUNNER = """
import json, os, sys
sys.path.insert(0, {jobdir!r})
import trl_job
from transformers import set_seed
rank = int(os.environ.get("RANK", "0"))
model_path = trl_job.save_tiny_llama(os.path.join({work!r}, f"tiny-llama-rank{{rank}}"))
out = {{}}
for stage in {stages!r}:
    set_seed(trl_job.SEED)
    args = trl_job.common_args(os.path.join({work!r}, f"grpo-z{{stage}}"), stage, False, {steps})
    trainer = trl_job.grpo(model_path, args)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "step_time" in e]
    out[stage] = {{"step_time": [e["step_time"] for e in logged], "loss": [e["loss"] for e in logged]}}
    del trainer
if rank == 0:
    with open({out!r}, "w") as handle:
        json.dump(out, handle)
"""


def launch(python: str, env: dict, work: Path, stages: list[int], steps: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = work / "result.json"
    out.unlink(missing_ok=True)
    script = work / "runner.py"
    script.write_text(
        RUNNER.format(
            jobdir=str(ROOT / "tests" / "integrations"),
            work=str(work / "runs"),
            stages=stages,
            steps=steps,
            out=str(out),
        )
    )
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def summary(rounds: list[dict], stage: int) -> dict:
    per_round = [statistics.median(r[stage]["step_time"][1:]) for r in rounds]
    kept = [t for r in rounds for t in r[stage]["step_time"][1:]]
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "round_medians": per_round}


def report(data: dict) -> str:
    args = data["args"]
    lines = [
        "# GRPO step time: shardspeed beside DeepSpeed 0.19.8",
        "",
        f"`python benchmarks/grpo_step_time.py` — TRL 1.16.0's GRPOTrainer (tests/integrations/trl_job.py's job: "
        f"tiny Llama from a config, fp32, KL reference, 2 generations of 6 tokens), 2 CPU ranks, "
        f"{args['steps']} steps per run, {args['rounds']} rounds run interleaved (shardspeed, DeepSpeed, "
        "shardspeed, ...). Step time is TRL's logged `step_time`; each run's first step is left out. Seconds.",
        "",
        "| ZeRO stage | shardspeed median (min-max) | DeepSpeed 0.19.8 median (min-max) | shardspeed / DeepSpeed | "
        "per-round medians (shardspeed; DeepSpeed) | largest loss difference |",
        "|---|---|---|---|---|---|",
    ]
    for stage in args["stages"]:
        ours, theirs = summary(data["shardspeed"], stage), summary(data["deepspeed"], stage)
        same = max(
            abs(x - y)
            for a, b in zip(data["shardspeed"], data["deepspeed"])
            for x, y in zip(a[stage]["loss"], b[stage]["loss"])
        )
        rounds = "; ".join(", ".join(f"{t:.3f}" for t in s["round_medians"]) for s in (ours, theirs))
        lines.append(
            f"| {stage} | {ours['median']:.3f} ({ours['min']:.3f}-{ours['max']:.3f}) | {theirs['median']:.3f} "
            f"({theirs['min']:.3f}-{theirs['max']:.3f}) | {ours['median'] / theirs['median']:.2f} | {rounds} | "
            f"{same:.1e} |"
        )
    lines += [
        "",
        f"Load average when the run started: {data['load']:.1f} (the machine's 2 cores are shared with other jobs, "
        "which the interleaving spreads over both frameworks alike). ZeRO-2 only by default: at ZeRO-3 DeepSpeed 0.19.8 "
        "stops before the first step of this job on CPU (results/trl_trainers.md). The losses differ in the last "
        "bits only (fp32 reductions in another order).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--deepspeed-python", required=True, help="python of an environment with DeepSpeed, trl"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    args = parser.parse_args()
    load = os.getloadavg()[0]
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = env_with_alias(tmp / "site")
        env.update(SHARDSPEED_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
        ds_env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
        ds_env.pop("PYTHONPATH", None)
        for index in range(args.rounds):
            ours.append(launch(sys.executable, env, tmp / f"ss{index}", args.stages, args.steps))
            theirs.append(launch(args.deepspeed_python, ds_env, tmp / f"ds{index}", args.stages, args.steps))
            print(f"round {index}: shardspeed {ours[-1]}\n  deepspeed {theirs[-1]}", flush=True)
    data = {"args": vars(args), "load": load, "shardspeed": ours, "deepspeed": theirs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grpo_step_time.json").write_text(json.dumps(data, indent=1))
    text = report(data)
    (RESULTS / "grpo_step_time.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
