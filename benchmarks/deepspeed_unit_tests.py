"""DeepSpeed's own unit tests as shardspeed's conformance suite, run beside DeepSpeed 0.19.8.

    git -C <DeepSpeed clone> archive edaa72212 tests | tar x -C /tmp/ds     # fetched once, by you
    python benchmarks/deepspeed_unit_tests.py --tests /tmp/ds/tests \\
        --shardspeed-python /venvs/conf/bin/python --deepspeed-python /venvs/ds/bin/python

Nothing is fetched at run time. `--tests` is DeepSpeed's `tests/` folder from its public repository at
commit `edaa72212` (TESTS_COMMIT; other commits run, and the results record which one was given). Their
`conftest.py` and `unit/common.py` (the `DistributedTest` harness that spawns the ranks itself) are used as
they are, from that folder.

The files are all of `unit/` that DeepSpeed's CPU workflow (`.github/workflows/cpu-torch-latest.yml`:
`pytest --forked unit/`, then `pytest --forked -m sequential unit/`) runs: the script takes an inventory
first, one `--collect-only` of the whole tree on the DeepSpeed side with the workflow's marker expression
(CPU_WORKFLOW_MARKERS), and runs every file in which DeepSpeed collects a test here. The other files are
listed with the reason DeepSpeed does not run them on CPU (skipped whole at import because its build lacks
an op, every test deselected by the markers, or its own import failing). Each file runs as
`pytest --forked <file>`, each test under a time limit (`--test-timeout`, enforced in its forked child by
pytest_plugins/conformance_limit.py: their harness can wait for its rank processes forever) and each file
under another (`--file-timeout`), so nothing hangs the run, with
`DS_ACCELERATOR=cpu` and `LOCAL_SIZE=2` (the CPU accelerator reports LOCAL_SIZE devices; the harness skips a
test that wants more ranks than devices, so every test runs on at most 2 CPU ranks over Gloo).

The whole tree takes hours on a small machine, so a run can be cut up and resumed: `--chunk I/N` runs every
N-th file from the I-th, `--files` names files, `--resume` skips files that already have results for a side,
and `--only` runs one side. Every finished file is merged into the results at once, under a lock, so chunks
may run side by side and an interrupted run loses only the file it was in; `--report-only` rewrites the
table from the results. Each row records its date and limits.

Running every test on both sides takes hours more, so `--sample K --seed S` takes a sample instead
(unit_test_sample.py): per file (by default the files not yet run in full on both sides), K of the node ids
DeepSpeed collects there, chosen by S and the file's name, run on DeepSpeed's side and then on the alias's
under the same limits. Sampled results are kept apart (`results["sampled"]`, each with the number DeepSpeed
collects and the ids sampled); the report gives (a) the full-file figure and (b) a whole-tree estimate that
scales each sampled file by the tests DeepSpeed collects there, stated as an estimate with its sample sizes.

The two systems run in two interpreters, because the alias refuses to be importable beside DeepSpeed:
- `--deepspeed-python`: a venv with `deepspeed==0.19.8` (DS_BUILD_OPS=0), torch 2.13.0, pytest<8.4 (pytest 8.4+
  breaks their forked harness), pytest-forked, numpy, py-cpuinfo
  (`pip install torch==2.13.0 ".[bench,conformance]"`);
- `--shardspeed-python`: a venv with shardspeed's dependencies and the `conformance` extra, and no DeepSpeed;
  this script puts this tree's shardspeed and its alias (integrations/deepspeed-alias, staged as `pip install`
  would lay it out) first on its PYTHONPATH, so the tree being measured is the one this script is in.

Results: benchmarks/results/deepspeed_unit_tests.{md,json} (the inventory; per file: collected / passed /
failed / skipped / why, for both). `--only shardspeed` reruns one side and keeps the other side's last results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from unit_test_report import junit_reasons, parse_pytest_log, render_markdown, summarize_file
from unit_test_sample import choose_sample, collect_node_ids

ROOT = Path(__file__).resolve().parent.parent
ALIAS_SOURCE = ROOT / "integrations" / "deepspeed-alias"
TESTS_COMMIT = "edaa72212"
SIDES = ("deepspeed", "shardspeed")

# DeepSpeed's CPU workflow (.github/workflows/cpu-torch-latest.yml at TESTS_COMMIT) runs `pytest --forked unit/`
# twice: once with pytest.ini's marker expression (no sequential, nightly, inference, ... tests) and once with
# `-m sequential`. The union of the two, as one expression:
CPU_WORKFLOW_MARKERS = (
    "(not sequential and not nightly and not inference and not seq_inference and not inference_ops and "
    "not inference_v2 and not inference_v2_ops and not stable_diffusion and not evaluation) or sequential"
)


def test_files(tests_dir: Path) -> list[str]:
    """Every test file of `unit/` as pytest finds them (pytest's default `test_*.py` / `*_test.py`)."""
    unit = tests_dir / "unit"
    found = {*unit.rglob("test_*.py"), *unit.rglob("*_test.py")}
    return sorted(str(path.relative_to(tests_dir)) for path in found)


def collect_inventory(python: str, tests_dir: Path, env: dict, log_dir: Path) -> dict:
    """Per file of `unit/`, what DeepSpeed's CPU workflow collects there on this machine (one collection of
    the whole tree on the DeepSpeed side; pytest_plugins/conformance_inventory.py writes it down)."""
    out = log_dir / "inventory.json"
    command = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-p", "conformance_inventory", f"--inventory-out={out}", "--continue-on-collection-errors",
               "-m", CPU_WORKFLOW_MARKERS, "unit/"]  # fmt: skip
    with open(log_dir / "inventory.log", "w") as log:
        subprocess.run(command, cwd=tests_dir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    collected = json.loads(out.read_text())
    inventory = {}
    for name in test_files(tests_dir):
        entry = collected.get(name, {"selected": 0, "deselected": 0, "skipped_whole": None, "error": None})
        if entry["selected"]:
            entry["runs"] = True
        elif entry["skipped_whole"]:
            entry["runs"], entry["why_not"] = (
                False,
                f"skipped whole on CPU by DeepSpeed: {entry['skipped_whole']}",
            )
        elif entry["error"]:
            entry["runs"], entry["why_not"] = (
                False,
                f"DeepSpeed's own import of the file fails: {entry['error']}",
            )
        elif entry["deselected"]:
            entry["runs"], entry["why_not"] = (
                False,
                "all its tests are deselected by the CPU workflow's markers",
            )
        else:
            entry["runs"], entry["why_not"] = False, "no test collected on CPU"
        inventory[name] = entry
    return inventory


def stage_alias(folder: Path, python: str) -> Path:
    """Lay out the alias in `folder` as `pip install ./integrations/deepspeed-alias` would (metadata too, and
    its commands, `deepspeed`, `ds_report`, ..., in `folder/bin`, run by `python`: DeepSpeed's launcher tests
    run the `deepspeed` command)."""
    version = re.search(r'^version = "([^"]+)"', (ALIAS_SOURCE / "pyproject.toml").read_text(), re.M).group(1)
    folder.mkdir(parents=True)
    (folder / "deepspeed").symlink_to(ALIAS_SOURCE / "deepspeed", target_is_directory=True)
    info = folder / f"deepspeed-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    commands = tomllib.loads((ALIAS_SOURCE / "pyproject.toml").read_text())["project"]["scripts"]
    (folder / "bin").mkdir()
    for command, target in commands.items():
        module, function = target.split(":")
        script = folder / "bin" / command
        script.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
        )
        script.chmod(0o755)
    return folder


def side_environment(
    side: str, alias_dir: Path | None, extensions_dir: Path, deepspeed_python: str | None = None
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SHARDSPEED_"))}
    # each side's `deepspeed` command first on PATH: the alias's staged one, or the one installed beside
    # DeepSpeed's interpreter
    commands = alias_dir / "bin" if side == "shardspeed" else Path(deepspeed_python or sys.executable).parent
    env["PATH"] = os.pathsep.join((str(commands), env.get("PATH", "")))
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
    # the shardspeed side runs this tree's shardspeed (ahead of any installed one) behind its staged alias
    shardspeed_side = os.pathsep.join((str(alias_dir), str(ROOT), plugins))
    env["PYTHONPATH"] = shardspeed_side if side == "shardspeed" else plugins
    return env


def run_file(
    python: str,
    tests_dir: Path,
    name: str,
    env: dict,
    limits: tuple[float, float],
    log_dir: Path,
    node_ids: list[str] | None = None,
) -> dict:
    """One file under pytest --forked (only `node_ids` of it when given: a sampled run): each test's forked
    child ends after `limits[0]` seconds (pytest_plugins/conformance_limit.py), the whole file after
    `limits[1]`; then every process it left behind is killed."""
    test_limit, timeout = limits
    log_path = log_dir / (name.replace("/", "__") + (".sample.log" if node_ids else ".log"))
    junit_path = log_path.with_suffix(".xml")
    junit_path.unlink(missing_ok=True)
    command = [python, "-m", "pytest", "--forked", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-rfEs", "--tb=short", f"--junitxml={junit_path}", "-p", "conformance_limit",
               f"--per-test-limit={test_limit:.0f}", "-m", CPU_WORKFLOW_MARKERS, *(node_ids or [name])]  # fmt: skip
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
    code = "import deepspeed, sys; print('shardspeed' in sys.modules, sys.modules.get('shardspeed', deepspeed).__file__)"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{side}: `import deepspeed` fails with {python}:\n{out.stderr[-2000:]}")
    if out.stdout.startswith("True") != (side == "shardspeed"):
        expected = "the alias" if side == "shardspeed" else "DeepSpeed itself"
        raise SystemExit(f"{side}: {python} imports deepspeed as {out.stdout.strip()}, expected {expected}")
    if side == "shardspeed" and not out.stdout.split()[-1].startswith(str(ROOT)):
        raise SystemExit(f"shardspeed side imports shardspeed from {out.stdout.split()[-1]}, not from {ROOT}")


def _tree_commit() -> str | None:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ folder")
    parser.add_argument("--shardspeed-python", default=sys.executable)
    parser.add_argument("--deepspeed-python", help="needed to take the inventory and for the DeepSpeed side")
    parser.add_argument("--only", choices=SIDES, help="run one side; the other keeps its last results")
    parser.add_argument(
        "--files", nargs="+", help="these files of unit/ only (default: every file DeepSpeed runs)"
    )
    parser.add_argument(
        "--chunk", help="I/N: the I-th of N interleaved parts of the files (run parts in turns)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip files that already have results for a side"
    )
    parser.add_argument(
        "--inventory", action="store_true", help="take the inventory again (else the recorded one)"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the .md from the .json; run nothing"
    )
    parser.add_argument("--sample", type=int, metavar="K",
                        help="sampled run: K tests per file (default files: those not yet run in full on both "
                             "sides), the same ids on both sides; kept apart from full-file results")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (with --sample)")
    parser.add_argument("--file-timeout", type=float, default=1800.0, help="seconds per file and side")
    parser.add_argument("--test-timeout", type=float, default=240.0, help="seconds per test")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "deepspeed_unit_tests_logs",
                        help="each file's pytest output, per side")  # fmt: skip
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, {platform.platform()}")
    parser.add_argument("--tree-commit", default=_tree_commit(),
                        help="the shardspeed commit this tree is (recorded with each alias-side row)")  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.tests / "unit" / "common.py").is_file():
        parser.error(f"--tests {args.tests}: not DeepSpeed's tests folder (no unit/common.py in it)")
    unknown = sorted(set(args.files or ()) - set(test_files(args.tests)))
    if unknown:
        parser.error(f"--files: not test files of {args.tests}/unit: {unknown}")
    if args.chunk:
        part, _, parts = args.chunk.partition("/")
        if not (part.isdigit() and parts.isdigit() and 1 <= int(part) <= int(parts)):
            parser.error(f"--chunk {args.chunk}: expected I/N with 1 <= I <= N")
        args.chunk = (int(part), int(parts))
    if args.sample is not None and (args.sample < 1 or args.only == "deepspeed"):
        parser.error("--sample K needs K >= 1; with --only, only the alias side can be rerun")
    if args.sample is not None and not args.only and not args.deepspeed_python:
        parser.error(
            "--sample K needs --deepspeed-python (or --only shardspeed: rerun the alias on the sample)"
        )
    if args.only != "shardspeed" and not args.deepspeed_python and not args.report_only:
        parser.error("--deepspeed-python is required unless --only shardspeed")
    return args


@contextlib.contextmanager
def _locked_results(json_path: Path):
    """The results, read under a lock and written back on exit: chunks may run side by side."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    # the lock lives outside the repository; its name is that of the results file it guards
    lock_name = "deepspeed_unit_tests-" + hashlib.sha1(str(json_path.resolve()).encode()).hexdigest()[:12]
    with open(Path(tempfile.gettempdir()) / f"{lock_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = json.loads(json_path.read_text()) if json_path.exists() else {}
        if results.get("meta", {}).get("tests_commit") not in (None, TESTS_COMMIT):
            results = {}  # another commit's results do not mix with this one's
        results.setdefault("meta", {})
        results.setdefault("files", {})
        yield results
        json_path.write_text(json.dumps(results, indent=1, sort_keys=False))


def _selected(args, inventory: dict) -> list[str]:
    names = args.files or [name for name, entry in inventory.items() if entry["runs"]]
    if args.chunk:
        part, parts = args.chunk
        names = names[part - 1 :: parts]
    return names


def rerun_sampled_alias(args, alias_dir: Path, json_path: Path) -> None:
    """`--sample K --only shardspeed`: the alias side again on the node ids already sampled (same seed and K),
    DeepSpeed's side kept: after a change to the tree, the sample measures the tree as it is now."""
    with _locked_results(json_path) as results:
        full = {n for n, e in results["files"].items() if e.get("deepspeed") and e.get("shardspeed")}
        entries = {n: e for n, e in results.get("sampled", {}).items() if e.get("seed") == args.seed
                   and e.get("sample_size") == args.sample and e.get("deepspeed") and n not in full}  # fmt: skip
    names = [n for n in (args.files or entries) if n in entries]
    env = side_environment("shardspeed", alias_dir, args.logs / "torch_extensions", args.deepspeed_python)
    (args.logs / "shardspeed").mkdir(parents=True, exist_ok=True)
    _check_interpreter("shardspeed", args.shardspeed_python, env)
    for name in names:
        ids = entries[name]["ids"]
        side = run_file(args.shardspeed_python, args.tests, name, env, (args.test_timeout, args.file_timeout),
                        args.logs / "shardspeed", ids)  # fmt: skip
        with _locked_results(json_path) as results:
            entry = results["sampled"][name]
            entry.update(shardspeed=side, shardspeed_commit=args.tree_commit,
                         shardspeed_date=datetime.date.today().isoformat())  # fmt: skip
        print(
            f"[sample, alias] {name}: {side['passed']} of {len(ids)} passed ({side['seconds']:.0f} s)",
            flush=True,
        )


def run_sampled(args, inventory: dict, alias_dir: Path, json_path: Path) -> None:
    """`--sample K`: per file, K of DeepSpeed's node ids, run on DeepSpeed's side and then the alias's, file
    after file (so every finished file has both sides), into `results["sampled"]`."""
    if args.only == "shardspeed":
        rerun_sampled_alias(args, alias_dir, json_path)
        return
    with _locked_results(json_path) as results:
        full = {n for n, e in results["files"].items() if e.get("deepspeed") and e.get("shardspeed")}
        done = {n for n, e in results.get("sampled", {}).items() if e.get("seed") == args.seed
                and e.get("sample_size") == args.sample and e.get("deepspeed") and e.get("shardspeed")}  # fmt: skip
    names = [n for n in _selected(args, inventory) if args.files or n not in full]
    names = [n for n in names if not (args.resume and n in done)]
    envs = {side: side_environment(side, alias_dir, args.logs / "torch_extensions", args.deepspeed_python)
            for side in SIDES}  # fmt: skip
    pythons = {"deepspeed": args.deepspeed_python, "shardspeed": args.shardspeed_python}
    for side in SIDES:
        (args.logs / side).mkdir(parents=True, exist_ok=True)
        _check_interpreter(side, pythons[side], envs[side])
    node_ids = collect_node_ids(pythons["deepspeed"], args.tests, names, CPU_WORKFLOW_MARKERS,
                                envs["deepspeed"], args.logs / "sample_collect.log")  # fmt: skip
    for name in names:
        if not node_ids.get(name):
            print(f"[sample] {name}: DeepSpeed collects nothing here now; skipped", flush=True)
            continue
        chosen = choose_sample(node_ids[name], args.sample, args.seed, name)
        entry = {"deepspeed_collected": len(node_ids[name]), "sample_size": args.sample, "seed": args.seed,
                 "ids": chosen, "date": datetime.date.today().isoformat(),
                 "file_timeout_s": args.file_timeout, "test_timeout_s": args.test_timeout,
                 "shardspeed_commit": args.tree_commit}  # fmt: skip
        for side in SIDES:
            entry[side] = run_file(pythons[side], args.tests, name, envs[side],
                                   (args.test_timeout, args.file_timeout), args.logs / side, chosen)  # fmt: skip
        with _locked_results(json_path) as results:
            results.setdefault("sampled", {})[name] = entry
        ds, ss = entry["deepspeed"], entry["shardspeed"]
        print(f"[sample] {name}: {len(chosen)} of {len(node_ids[name])}; DeepSpeed {ds['passed']} passed, "
              f"alias {ss['passed']} passed ({ds['seconds']:.0f} s + {ss['seconds']:.0f} s)", flush=True)  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.out / "deepspeed_unit_tests.json"
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        alias_dir = stage_alias(Path(tmp) / "alias", args.shardspeed_python)
        args.logs.mkdir(parents=True, exist_ok=True)
        with _locked_results(json_path) as results:
            if not args.report_only and (args.inventory or "inventory" not in results):
                env = side_environment(
                    "deepspeed", alias_dir, args.logs / "torch_extensions", args.deepspeed_python
                )
                results["inventory"] = collect_inventory(args.deepspeed_python, args.tests, env, args.logs)
                results["meta"]["inventory_date"] = datetime.date.today().isoformat()
            inventory = results.get("inventory", {})
            # one row per file DeepSpeed runs, in the tree's order; rows of files it does not run are dropped
            if inventory:
                results["files"] = {
                    name: results["files"].get(name, {}) for name, entry in inventory.items() if entry["runs"]
                }
            results["meta"].update(
                tests_commit=TESTS_COMMIT, machine=args.machine, markers=CPU_WORKFLOW_MARKERS
            )
        if args.sample and not args.report_only:
            run_sampled(args, inventory, alias_dir, json_path)
        names = [] if args.report_only or args.sample else _selected(args, inventory)
        for side in [] if args.report_only or args.sample else [args.only] if args.only else list(SIDES):
            python = args.deepspeed_python if side == "deepspeed" else args.shardspeed_python
            env = side_environment(side, alias_dir, args.logs / "torch_extensions", args.deepspeed_python)
            (args.logs / side).mkdir(parents=True, exist_ok=True)
            _check_interpreter(side, python, env)
            versions = {
                f"{side}_version": _version(
                    python, "deepspeed" if side == "deepspeed" else "shardspeed", env
                ),
                f"{side}_torch": _version(python, "torch", env),
            }
            for name in names:
                with _locked_results(json_path) as results:
                    done = side in results["files"].get(name, {})
                if args.resume and done:
                    continue
                row = run_file(
                    python, args.tests, name, env, (args.test_timeout, args.file_timeout), args.logs / side
                )
                row.update(date=datetime.date.today().isoformat(), markers="cpu-workflow",
                           file_timeout_s=args.file_timeout, test_timeout_s=args.test_timeout)  # fmt: skip
                if side == "shardspeed":
                    row["shardspeed_commit"] = args.tree_commit
                with _locked_results(json_path) as results:
                    results["files"].setdefault(name, {})[side] = row
                    results["meta"].update(versions)
                print(f"[{side}] {name}: {row['passed']}/{row['collected']} passed, {row['status']}, "
                      f"{row['seconds']:.0f} s", flush=True)  # fmt: skip
    with _locked_results(json_path) as results:
        (args.out / "deepspeed_unit_tests.md").write_text(render_markdown(results))
    print(f"wrote {json_path} and deepspeed_unit_tests.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
