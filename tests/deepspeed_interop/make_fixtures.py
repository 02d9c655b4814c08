"""Regenerate the DeepSpeed-written fixture checkpoints under fixtures/ with the real DeepSpeed 0.19.8.

    DS_ACCELERATOR=cpu <python with deepspeed==0.19.8 and torch==2.13.0> tests/deepspeed_interop/make_fixtures.py

For each ZeRO stage 0-3 in fp32 and bf16, DeepSpeed runs run_script.py at 2 ranks: 3 steps, a save, 3 more
steps. The tag folder it saved is copied to `fixtures/<stage>-<dtype>/global_step3/` (with `latest`; the
zero_to_fp32.py DeepSpeed copies next to it is left out: it is DeepSpeed's), and what its uninterrupted run
recorded after the save (losses, final fp32 weights, counters) to `fixtures/<stage>-<dtype>/expected.pt`.
tests/test_deepspeed_checkpoint_read.py resumes from each and compares. (fp16 is not in the set: DeepSpeed
0.19.8 refuses fp16 on a CPU, "Type fp16 is not supported on your device".)

`fixtures/pipe-s1-fp32` is the same for pipe_script.py (DeepSpeed's PipelineEngine, 2 ranks as 2 stages, ZeRO
stage 1, fp32), read by tests/test_deepspeed_pipeline_read.py; `fixtures/pipe-s0-fp32` and `pipe-s0-bf16` are
the same at ZeRO stage 0 (fp32: the torch optimizer's state without names; bf16: DeepSpeed's BF16_Optimizer
files), read by tests/test_deepspeed_pipeline_zero0_read.py.

`fixtures/moe-ep<E>-s<S>` are the same for moe_script.py (one `deepspeed.moe.layer.MoE` layer of 2 experts at
ep size E, ZeRO stage S, fp32, 2 ranks: DeepSpeed's expert and expp_rank files), read by
tests/test_deepspeed_moe_checkpoint_read.py, and `fixtures/moe-ep2-s0-bf16` the same in bf16 (DeepSpeed's bf16
optimizer state in the expp_rank files). Each is made by a process of its own, as DeepSpeed keeps its
expert groups in module globals (an earlier run's larger ep group would change which ranks write).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)]
MOE_CASES = [(ep, stage) for ep in (1, 2) for stage in (0, 2)]


def _fixture(name: str, script: str, options: list) -> None:
    """Run `script` with DeepSpeed (train, save, go on) and keep its tag folder and results as `name`."""
    with tempfile.TemporaryDirectory() as tmp:
        run = [
            sys.executable,
            str(HERE / script),
            *options,
            "--save",
            f"{tmp}/ckpt",
            "--out",
            f"{tmp}/expected.pt",
        ]
        subprocess.run(run, check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        target = HERE / "fixtures" / name
        shutil.rmtree(target, ignore_errors=True)
        tag = (Path(tmp) / "ckpt" / "latest").read_text().strip()
        shutil.copytree(Path(tmp) / "ckpt" / tag, target / tag)
        (target / "latest").write_text(tag)
        shutil.copy(f"{tmp}/expected.pt", target / "expected.pt")
    print(f"wrote {target}")


def _moe_fixtures() -> None:
    for ep, stage in MOE_CASES:
        options = ["--world", "2", "--ep", str(ep), "--stage", str(stage)]
        _fixture(f"moe-ep{ep}-s{stage}", "moe_script.py", options)
    options = ["--world", "2", "--ep", "2", "--stage", "0", "--dtype", "bf16"]
    _fixture("moe-ep2-s0-bf16", "moe_script.py", options)


def main(only: str | None = None) -> None:
    """All fixtures, or with `moe` (the first argument) only the MoE ones."""
    if only != "moe":
        for stage, dtype in CASES:
            options = ["--world", "2", "--stage", str(stage), "--dtype", dtype]
            _fixture(f"s{stage}-{dtype}", "run_script.py", options)
        for stage, dtype in [(1, "fp32"), (0, "fp32"), (0, "bf16")]:
            options = ["--world", "2", "--stages", "2", "--stage", str(stage), "--dtype", dtype]
            _fixture(f"pipe-s{stage}-{dtype}", "pipe_script.py", options)
    _moe_fixtures()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
