"""The same Hugging Face Trainer script on DeepSpeed 0.19.8 and on shardspeed: per-step losses side by side.

    python benchmarks/hf_trainer_vs_deepspeed.py --deepspeed-python /path/to/ds-venv/bin/python [--bf16]

Runs tests/integrations/hf_trainer_job.py (tiny GPT-2, 2 ranks, ZeRO 0-3, train 8 steps + resume from step
4) under torchrun twice: with the interpreter given (a separate environment holding DeepSpeed 0.19.8,
transformers and accelerate; DeepSpeed on the CPU accelerator, `DS_ACCELERATOR=cpu`), and with this
interpreter plus the `deepspeed` alias staged on PYTHONPATH. Prints every step's loss from both and the
largest difference per stage. DeepSpeed JIT-compiles two C++ ops on its first run (minutes); they are
cached in --extensions-dir.
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

from alias_path import env_with_alias  # noqa: E402

JOB = ROOT / "tests" / "integrations" / "hf_trainer_job.py"


def run(python: str, env: dict, work: Path, port: int, extra: list[str]) -> dict:
    out = work / "result.json"
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(JOB), "--work", str(work / "runs"), "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed-python", required=True, help="python of an environment with DeepSpeed")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--extensions-dir", default=os.path.join(tempfile.gettempdir(), "ds-torch-extensions")
    )
    args = parser.parse_args()
    extra = ["--bf16"] if args.bf16 else []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "ds").mkdir()
        (tmp / "ss").mkdir()
        ds_env = {**os.environ, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": args.extensions_dir}
        ds_env.pop("PYTHONPATH", None)
        deepspeed = run(args.deepspeed_python, ds_env, tmp / "ds", 29711, extra)
        ours = run(sys.executable, env_with_alias(tmp / "ss" / "site"), tmp / "ss", 29712, extra)
    for shm in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*_127.0.0.1_29711_*"):
        shm.unlink(missing_ok=True)  # DeepSpeed's CPU all-reduce leaves these behind (benchmarks/README.md)
    print(f"{'stage':>5} {'step':>4} {'DeepSpeed 0.19.8':>18} {'shardspeed':>18} {'diff':>10}")
    for stage in ours:
        worst = 0.0
        for run_name in ("train", "resumed"):
            for step, loss in ours[stage][run_name].items():
                if run_name == "resumed" and int(step) <= 4:
                    continue  # restored history, not recomputed
                theirs = deepspeed[stage][run_name][step]
                worst = max(worst, abs(loss - theirs))
                label = step if run_name == "train" else f"r{step}"
                print(f"{stage:>5} {label:>4} {theirs:>18.8f} {loss:>18.8f} {loss - theirs:>10.2e}")
        print(f"stage {stage}: largest |difference| {worst:.2e}")


if __name__ == "__main__":
    main()
