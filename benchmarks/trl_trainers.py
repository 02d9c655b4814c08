"""TRL's trainers (SFT, DPO, GRPO and RLOO with a KL reference, reward model) on shardspeed, and on DeepSpeed
when given: a table of logged losses per trainer x ZeRO stage (x optimizer offload).

    python benchmarks/trl_trainers.py [--deepspeed-python /path/to/ds-venv/bin/python] [--steps 3]

Runs tests/integrations/trl_job.py (tiny Llama from a config, 2 CPU ranks, fp32) under torchrun with this
interpreter and the `deepspeed` alias staged on PYTHONPATH; with --deepspeed-python, also in that
environment (DeepSpeed 0.19.8, trl 1.16, transformers 5.23, accelerate 1.15; `DS_ACCELERATOR=cpu`).
Writes benchmarks/results/trl_trainers.{json,md}. Needs trl in this interpreter (the [hf] extra).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
sys.path.insert(0, str(ROOT / "tests"))

from alias_path import env_with_alias  # noqa: E402

from harness import free_port  # noqa: E402

JOB = ROOT / "tests" / "integrations" / "trl_job.py"
RESULTS = ROOT / "benchmarks" / "results"
# What DeepSpeed's column needs said (measured with 0.19.8 on CPU; see the results file).
DEEPSPEED_NOTE = (
    "\n"
    + "DeepSpeed 0.19.8 ran the same job (`--deepspeed-python`, one launch per run, `DS_ACCELERATOR=cpu`). At ZeRO 0-2 every trainer logs exactly our losses. At ZeRO-3 every trainer stops before its first step, in Transformers' `from_pretrained` -> `deepspeed.zero.Init(config_dict_or_path=...)` -> `DeepSpeedConfig`: on CPU, Accelerate initialised torch.distributed itself, so `deepspeed.comm` reports no process group, DeepSpeedConfig takes a world size of 1 and its batch check fails (train batch 4, the size Transformers filled in for 2 ranks, != 2 x 1 x 1). With `offload_optimizer: cpu` at ZeRO 1-2 DeepSpeed steps with its DeepSpeedCPUAdam (JIT-built once) and shardspeed with torch's Adam on the host: SFT and RLOO log the same losses bit for bit, DPO, GRPO and the reward model within 2.4e-7 (fp32 rounding of two Adam implementations). Its ZeRO-3 offload runs stop as its ZeRO-3 runs do."
    + "\n"
)
RUNS = [
    f"{t}:{s}{o}"
    for t in ("sft", "dpo", "grpo", "rloo", "reward")
    for s in (0, 1, 2, 3)
    for o in ("", ":offload", ":offload_all")
    if (s or not o) and (s == 3 or o != ":offload_all")
]


def _launch(python: str, env: dict, work: Path, runs: list[str], steps: int):
    out = work / "result.json"
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(JOB), "--work", str(work / "runs"), "--out", str(out),
           "--steps", str(steps), "--runs", *runs]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    return proc, out


def run(python: str, env: dict, work: Path, runs: list[str], steps: int) -> dict:
    proc, out = _launch(python, env, work, runs, steps)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _error_line(text: str) -> str:
    """The exception that stopped rank 0 (torchrun prefixes a worker's lines with "[rank0]: "), else the last
    line of the first traceback."""
    lines = text.splitlines()
    worker = [line[len("[rank0]: ") :] for line in lines if line.startswith("[rank0]: ")]
    for block in (worker, lines):
        ends = [line for line in block if line and not line.startswith((" ", "Traceback", "["))]
        if block is worker and ends:
            return ends[-1].strip()[:300]
        for i, line in enumerate(block):
            if line.startswith("Traceback"):
                for tail in block[i + 1 :]:
                    if tail and not tail.startswith((" ", "Traceback")):
                        return tail.strip()[:300]
    return (lines[-1] if lines else "no output")[:300]


def run_each(python: str, env: dict, work: Path, runs: list[str], steps: int) -> dict:
    """One launch per run, so that a run that fails records its error and the others still run."""
    results = {}
    for spec in runs:
        proc, out = _launch(python, env, work, [spec], steps)
        if proc.returncode == 0:
            results.update(json.loads(out.read_text()))
        else:
            results[spec] = {"error": _error_line(proc.stderr + proc.stdout)}
        print(spec, results[spec].get("loss", results[spec].get("error")), flush=True)
    return results


def _fmt(values) -> str:
    return ", ".join(f"{v:.7g}" for v in values) if values else "-"


def _largest_difference(a: list[float], b: list[float]) -> str:
    return f"{max(abs(x - y) for x, y in zip(a, b)):.1e}" if len(a) == len(b) else "steps differ"


def table(ours: dict, theirs: dict | None) -> str:
    lines = ["| run | logged loss per step (shardspeed) | vs the same trainer at ZeRO-0 | GRPO reward / KL | "
             "DeepSpeed 0.19.8 loss | vs DeepSpeed |", "|---|---|---|---|---|---|"]  # fmt: skip
    for run_name, result in ours.items():
        zero0 = ours.get(run_name.split(":")[0] + ":0")
        same = _largest_difference(result["loss"], zero0["loss"]) if zero0 else ""
        if zero0 and "kl" in result:
            same += f" (KL: {_largest_difference(result['kl'], zero0['kl'])})"
        extra = f"{result['reward']} / {_fmt(result['kl'])}" if "reward" in result else ""
        ds, diff = "not run", ""
        if theirs is not None and run_name in theirs and "error" in theirs[run_name]:
            ds = "fails: `" + theirs[run_name]["error"].replace("|", "\\|") + "`"
        elif theirs is not None and run_name in theirs:
            ds, diff = (
                _fmt(theirs[run_name]["loss"]),
                _largest_difference(result["loss"], theirs[run_name]["loss"]),
            )
        lines.append(f"| `{run_name}` | {_fmt(result['loss'])} | {same} | {extra} | {ds} | {diff} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed-python", help="python of an environment with DeepSpeed and trl")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", nargs="+", default=RUNS)
    parser.add_argument(
        "--deepspeed-runs", nargs="+", help="the runs to repeat under DeepSpeed (default: --runs)"
    )
    parser.add_argument("--deepspeed-from", type=Path,
                        help="keep DeepSpeed's results from this trl_trainers.json (with --deepspeed-python: and run --deepspeed-runs)")  # fmt: skip
    parser.add_argument("--ours-from", type=Path,
                        help="read shardspeed's results from this trl_trainers.json; run only the --runs it lacks")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        saved = json.loads(args.ours_from.read_text())["shardspeed"] if args.ours_from else {}
        missing = [r for r in args.runs if r not in saved]
        if missing:
            (tmp / "ss").mkdir()
            env = env_with_alias(tmp / "ss" / "site")
            env.update(SHARDSPEED_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
            saved = {**saved, **run(sys.executable, env, tmp / "ss", missing, args.steps)}
        ours = {r: saved[r] for r in args.runs}  # in --runs' order
        theirs = json.loads(args.deepspeed_from.read_text())["deepspeed"] if args.deepspeed_from else None
        if args.deepspeed_python:
            (tmp / "ds").mkdir()
            ds_env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
            ds_env.pop("PYTHONPATH", None)
            theirs = (theirs or {}) | run_each(
                args.deepspeed_python, ds_env, tmp / "ds", args.deepspeed_runs or args.runs, args.steps
            )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trl_trainers.json").write_text(
        json.dumps({"shardspeed": ours, "deepspeed": theirs}, indent=1)
    )
    text = table(ours, theirs)
    (RESULTS / "trl_trainers.md").write_text(
        "# TRL's trainers on 2 CPU ranks\n\n"
        "`python benchmarks/trl_trainers.py` (tests/integrations/trl_job.py: trl 1.16.0, transformers 5.23.0, "
        f"accelerate 1.15.0; a tiny Llama from a config, fp32, {args.steps} steps). `trainer:stage[:offload]`; "
        "offload = `offload_optimizer: cpu`; offload_all = `offload_optimizer` and `offload_param`: cpu.\n\n"
        + text
        + "\n\n"
        "With two generations per prompt RLOO's advantages are r1 - r2 and r2 - r1, so its logged loss is 0 while "
        "its gradient is not (the KL column shows the policy moving).\n" + (DEEPSPEED_NOTE if theirs else "")
    )
    print(text)


if __name__ == "__main__":
    main()
