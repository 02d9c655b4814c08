"""DeepSpeed's own unit tests as shardspeed's conformance suite, run beside DeepSpeed 0.19.8.

    git -C <DeepSpeed clone> archive edaa72212 tests | tar x -C /tmp/ds     # fetched once, by you
    python benchmarks/deepspeed_unit_tests.py --tests /tmp/ds/tests \\
        --shardspeed-python /venvs/conf/bin/python --deepspeed-python /venvs/ds/bin/python

Nothing is fetched at run time. `--tests` is DeepSpeed's `tests/` folder from its public repository at
commit `edaa72212` (TESTS_COMMIT; other commits run, and the results record which one was given). Their
`conftest.py` and `unit/common.py` (the `DistributedTest` harness that spawns the ranks itself) are used as
they are, from that folder.

The files are a fixed selection (FILES, each with why it is in) of what DeepSpeed's CPU workflow
(`.github/workflows/cpu-torch-latest.yml`: `pytest --forked unit/`) runs, covering what shardspeed offers:
the engine and its config, ZeRO, checkpoints, communication, pipeline and MoE, the launcher, activation
checkpointing, LR schedules, the accelerator, optimizers without compiled kernels, the utils. Each file runs
as `pytest --forked <file>`, each test under a time limit (`--test-timeout`, enforced in its forked child by
pytest_plugins/conformance_limit.py: their harness can wait for its rank processes forever) and each file
under another (`--file-timeout`), so nothing hangs the run, with
`DS_ACCELERATOR=cpu` and `LOCAL_SIZE=2` (the CPU accelerator reports LOCAL_SIZE devices; the harness skips a
test that wants more ranks than devices, so every test runs on at most 2 CPU ranks over Gloo).

The two systems run in two interpreters, because the alias refuses to be importable beside DeepSpeed:
- `--deepspeed-python`: a venv with `deepspeed==0.19.8` (DS_BUILD_OPS=0), torch 2.13.0, pytest<8.4 (pytest 8.4+
  breaks their forked harness), pytest-forked, numpy, py-cpuinfo
  (`pip install torch==2.13.0 ".[bench,conformance]"`);
- `--shardspeed-python`: a venv with shardspeed and the `conformance` extra, and no DeepSpeed; this script
  stages the alias (integrations/deepspeed-alias) on its PYTHONPATH, as `pip install` would lay it out.

Results: benchmarks/results/deepspeed_unit_tests.{md,json} (per file: collected / passed / failed / skipped
/ why, for both). `--only shardspeed` reruns one side and keeps the other side's last results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unit_test_report import junit_reasons, parse_pytest_log, render_markdown, summarize_file

ROOT = Path(__file__).resolve().parent.parent
ALIAS_SOURCE = ROOT / "integrations" / "deepspeed-alias"
TESTS_COMMIT = "edaa72212"
SIDES = ("deepspeed", "shardspeed")

# (file under tests/, why it is in the selection). Left out, though in the CPU workflow: inference and
# compiled-kernel ops (not CPU or not built), compile/DeepCompile, autotuning, compression, hybrid engine,
# ZenFlow, AutoTP/AutoEP internals, Ulysses-ALST, and files that test DeepSpeed's internal classes rather than
# behaviour users see (launcher runner classes, MultiNodeRunner argument plumbing, the CPU/fused Adam kernels
# compared with each other); the flops-profiler file collects nothing on CPU.
FILES = [
    ("unit/runtime/test_ds_initialize.py", "initialize(): optimizers, schedulers, client objects, dtypes"),
    ("unit/runtime/test_ds_config_dict.py", "config parsing and batch-size rules"),
    ("unit/runtime/test_data.py", "RepeatingLoader, the engine's data loader"),
    ("unit/runtime/test_lr_schedulers.py", "LR schedules and their constants"),
    ("unit/runtime/test_no_sync_ctxt.py", "no_sync and gradient accumulation"),
    ("unit/runtime/test_runtime_utils.py", "runtime.utils helpers (norms, partitioning)"),
    ("unit/runtime/utils/test_partition.py", "partition_uniform/balanced, PartitionedTensor"),
    ("unit/runtime/half_precision/test_dynamic_loss_scale.py", "fp16 dynamic loss scaling"),
    ("unit/runtime/half_precision/test_zero_optim_overflow.py", "overflow checks under ZeRO"),
    ("unit/runtime/activation_checkpointing/test_activation_checkpointing.py", "deepspeed.checkpointing"),
    ("unit/runtime/comm/test_coalesced_collectives.py", "reduce_scatter_coalesced"),
    ("unit/runtime/pipe/test_pipe_schedule.py", "pipeline schedules (instructions)"),
    ("unit/runtime/pipe/test_topology.py", "ProcessTopology and the grid"),
    ("unit/runtime/pipe/test_pipe.py", "PipelineModule training"),
    ("unit/pipe/test_pipe_module.py", "PipelineModule with activation checkpointing"),
    ("unit/runtime/zero/test_zero_config.py", "ZeRO config classes"),
    ("unit/runtime/zero/test_zero_context.py", "zero.Init, GatheredParameters"),
    ("unit/runtime/zero/test_zero_context_return.py", "ZeRO-3 forward return values"),
    ("unit/runtime/zero/test_zero_grad_clip.py", "safe_get/set_local_grad with clipping"),
    ("unit/runtime/zero/test_unwrap_model.py", "unwrap_model_for_generation"),
    ("unit/runtime/zero/test_ignore_unused_parameters.py", "ignore_unused_parameters"),
    ("unit/runtime/zero/test_zero_leaf_module.py", "z3 leaf modules"),
    ("unit/v1/zero/test_zero.py", "ZeRO stages 1-3 end to end"),
    ("unit/v1/half_precision/test_bf16.py", "bf16 with ZeRO"),
    ("unit/v1/moe/test_moe.py", "Mixture of Experts layer, gating, expert parallelism"),
    ("unit/v1/accelerator/test_accelerator.py", "get_accelerator()"),
    ("unit/v1/test_engine_log_level.py", "log_level (0.19 config key)"),
    ("unit/checkpoint/test_latest_checkpoint.py", "`latest` and load without a tag"),
    ("unit/checkpoint/test_lr_scheduler.py", "scheduler state in checkpoints"),
    ("unit/checkpoint/test_other_optimizer.py", "checkpoints of other optimizers"),
    ("unit/checkpoint/test_tag_validation.py", "checkpoint.tag_validation"),
    ("unit/checkpoint/test_zero_optimizer.py", "ZeRO checkpoints, load at another stage/world"),
    ("unit/checkpoint/test_moe_checkpoint.py", "MoE checkpoints"),
    ("unit/checkpoint/test_pipeline.py", "pipeline checkpoints"),
    ("unit/checkpoint/test_shared_weights.py", "tied weights and zero_to_fp32"),
    ("unit/comm/test_dist.py", "deepspeed.comm and init_distributed"),
    ("unit/comm/test_comms_logger.py", "comms logger"),
    ("unit/launcher/test_ds_arguments.py", "add_config_arguments"),
    ("unit/launcher/test_run.py", "launcher: hostfile, include/exclude"),
    ("unit/monitor/test_monitor.py", "monitors"),
    ("unit/ops/adagrad/test_cpu_adagrad.py", "DeepSpeedCPUAdagrad"),
    ("unit/ops/lion/test_cpu_lion.py", "DeepSpeedCPULion"),
    ("unit/utils/test_groups.py", "utils.groups"),
    ("unit/utils/test_init_on_device.py", "OnDevice"),
    ("unit/utils/test_partition_balanced.py", "runtime.utils.partition_balanced"),
    ("unit/utils/test_get_optim_files.py", "zero_to_fp32 helpers"),
]


def stage_alias(folder: Path) -> Path:
    """Lay out the alias in `folder` as `pip install ./integrations/deepspeed-alias` would (metadata too)."""
    import re

    version = re.search(r'^version = "([^"]+)"', (ALIAS_SOURCE / "pyproject.toml").read_text(), re.M).group(1)
    folder.mkdir(parents=True)
    (folder / "deepspeed").symlink_to(ALIAS_SOURCE / "deepspeed", target_is_directory=True)
    info = folder / f"deepspeed-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    return folder


def side_environment(side: str, alias_dir: Path | None, extensions_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SHARDSPEED_"))}
    env.update(
        DS_ACCELERATOR="cpu",  # both: DeepSpeed's and shardspeed's accelerator choice
        LOCAL_SIZE="2",  # the CPU accelerator's device count: tests use at most 2 ranks
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        DS_UNITTEST_TIMEOUT="180",  # their harness's per-test limit on waiting for the ranks
        DS_BUILD_OPS="0",
        COLUMNS="400",  # the short summary keeps whole reasons
        PYTHONDONTWRITEBYTECODE="1",
        # DeepSpeed JIT-builds its CPU ops here: a private folder, so a build lock another job left behind
        # (torch waits on it forever) cannot stall this run
        TORCH_EXTENSIONS_DIR=str(extensions_dir),
    )
    plugins = str(Path(__file__).resolve().parent / "pytest_plugins")  # the per-test limit
    env["PYTHONPATH"] = f"{alias_dir}{os.pathsep}{plugins}" if side == "shardspeed" else plugins
    return env


def run_file(
    python: str, tests_dir: Path, name: str, env: dict, limits: tuple[float, float], log_dir: Path
) -> dict:
    """One file under pytest --forked: each test's forked child ends after `limits[0]` seconds
    (pytest_plugins/conformance_limit.py), the whole file after `limits[1]`; then every process it left
    behind is killed."""
    test_limit, timeout = limits
    log_path = log_dir / (name.replace("/", "__") + ".log")
    junit_path = log_path.with_suffix(".xml")
    junit_path.unlink(missing_ok=True)
    command = [python, "-m", "pytest", "--forked", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-rfEs", "--tb=short", f"--junitxml={junit_path}", "-p", "conformance_limit",
               f"--per-test-limit={test_limit:.0f}", name]  # fmt: skip
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout)
            status = "ok" if code in (0, 1) else f"pytest exit {code}"
        except subprocess.TimeoutExpired:
            status = f"time limit ({timeout:.0f} s)"
        # a test stopped by its time limit leaves its rank processes behind (same process group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    text = log_path.read_text(errors="replace")
    parsed = parse_pytest_log(text)
    if junit_path.exists():  # absent when the time limit stopped pytest
        parsed["reasons"].update(junit_reasons(junit_path.read_text(errors="replace"), name))
    summary = summarize_file(parsed, status, time.monotonic() - started)
    return {**summary, "tests": parsed["tests"], "reasons": parsed["reasons"],
            "skip_reasons": parsed["skip_reasons"]}  # fmt: skip


def _version(python: str, module: str, env: dict) -> str:
    code = f"import importlib.metadata as m; print(m.version({module!r}))"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "?"


def _check_interpreter(side: str, python: str, env: dict) -> None:
    code = "import deepspeed, sys; print('shardspeed' in sys.modules, deepspeed.__file__)"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{side}: `import deepspeed` fails with {python}:\n{out.stderr[-2000:]}")
    if out.stdout.startswith("True") != (side == "shardspeed"):
        expected = "the alias" if side == "shardspeed" else "DeepSpeed itself"
        raise SystemExit(f"{side}: {python} imports deepspeed as {out.stdout.strip()}, expected {expected}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ folder")
    parser.add_argument("--shardspeed-python", default=sys.executable)
    parser.add_argument("--deepspeed-python")
    parser.add_argument("--only", choices=SIDES, help="run one side; the other keeps its last results")
    parser.add_argument("--files", nargs="+", help="a subset of FILES (default: all of them)")
    parser.add_argument("--file-timeout", type=float, default=1800.0, help="seconds per file and side")
    parser.add_argument("--test-timeout", type=float, default=240.0, help="seconds per test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "deepspeed_unit_tests_logs",
                        help="each file's pytest output, per side")  # fmt: skip
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, {platform.platform()}")
    args = parser.parse_args(argv)
    if not (args.tests / "unit" / "common.py").is_file():
        parser.error(f"--tests {args.tests}: not DeepSpeed's tests folder (no unit/common.py in it)")
    unknown = sorted(set(args.files or ()) - {name for name, _ in FILES})
    if unknown:
        parser.error(f"--files: not in the selection: {unknown}")
    if args.only != "shardspeed" and not args.deepspeed_python:
        parser.error("--deepspeed-python is required unless --only shardspeed")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.out / "deepspeed_unit_tests.json"
    results = json.loads(json_path.read_text()) if json_path.exists() else {"files": {}}
    if results.get("meta", {}).get("tests_commit") not in (None, TESTS_COMMIT):
        results = {"files": {}}  # another commit's results do not mix with this one's
    sides = [args.only] if args.only else list(SIDES)
    names = args.files or [name for name, _ in FILES]
    results["files"] = {name: results["files"].get(name, {}) for name, _ in FILES}
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        alias_dir = stage_alias(Path(tmp) / "alias")
        meta = results.setdefault("meta", {})
        meta.update(tests_commit=TESTS_COMMIT, machine=args.machine,
                    date=datetime.date.today().isoformat(), file_timeout_s=args.file_timeout,
                    test_timeout_s=args.test_timeout)  # fmt: skip
        for side in sides:
            python = args.deepspeed_python if side == "deepspeed" else args.shardspeed_python
            env = side_environment(side, alias_dir, args.logs / "torch_extensions")
            (args.logs / side).mkdir(parents=True, exist_ok=True)
            _check_interpreter(side, python, env)
            meta[f"{side}_version"] = _version(
                python, "deepspeed" if side == "deepspeed" else "shardspeed", env
            )
            meta[f"{side}_torch"] = _version(python, "torch", env)
            for name in names:
                row = run_file(
                    python, args.tests, name, env, (args.test_timeout, args.file_timeout), args.logs / side
                )
                results["files"][name][side] = row
                print(f"[{side}] {name}: {row['passed']}/{row['collected']} passed, {row['status']}, "
                      f"{row['seconds']:.0f} s", flush=True)  # fmt: skip
                json_path.write_text(json.dumps(results, indent=1, sort_keys=False))
    (args.out / "deepspeed_unit_tests.md").write_text(render_markdown(results))
    print(f"wrote {json_path} and deepspeed_unit_tests.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
