"""FairScale's own unit tests as the conformance suite of shardspeed's FairScale API, run beside FairScale 0.4.13.

    git --git-dir <FairScale clone>/.git archive 146f1602 | tar x -C /tmp/fs      # fetched once, by you
    python benchmarks/fairscale_unit_tests.py --source /tmp/fs \\
        --shardspeed-python /venvs/conf/bin/python --fairscale-python /venvs/fs/bin/python

Nothing is fetched at run time. `--source` is FairScale's public repository at commit `146f1602`
(SOURCE_COMMIT, its last commit). Each file of FILES (a selection, each with why it is in) runs as
`pytest <file>` from that folder under a per-file time limit, with 2 CPU ranks at most (their harness uses
Gloo where CUDA is absent), in two interpreters:

- `--fairscale-python`: a venv with `fairscale==0.4.13`, torch 2.13.0, pytest, numpy;
- `--shardspeed-python`: a venv with shardspeed, pytest and numpy, and no FairScale; this script stages the
  `fairscale` alias (integrations/fairscale-alias) on its PYTHONPATH.

FairScale's tests import their harness and helpers from FairScale's package: `fairscale.fair_dev.testing`
(`dist_init`, `objects_are_equal`, the `skip_if_*` marks), `fairscale.internal` (version checks) and
`fairscale.nn.model_parallel` (which the harness imports to seed and set up its groups). On the shardspeed
side those three modules are loaded from `--source` (a `sitecustomize` this script writes, so the spawned
rank processes get them too); everything the tests exercise comes through the alias. The run records this.

Results: benchmarks/results/fairscale_unit_tests.{md,json}: per file and system the counts and the reasons
of every failure; the headline is how many of the tests FairScale passes here pass on shardspeed.
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
from unit_test_report import junit_reasons, parse_pytest_log, summarize_file

ROOT = Path(__file__).resolve().parent.parent
ALIAS_SOURCE = ROOT / "integrations" / "fairscale-alias"
SOURCE_COMMIT = "146f1602"
SIDES = ("fairscale", "shardspeed")
HELPERS = ("fairscale.fair_dev", "fairscale.internal", "fairscale.nn.model_parallel")

FILES = [
    ("tests/optim/test_oss.py", "OSS: step, state dict consolidation, clipping, groups"),
    ("tests/nn/data_parallel/test_sharded_ddp_features.py", "ShardedDataParallel's options"),
    ("tests/nn/data_parallel/test_sharded_ddp_pytorch_parity.py", "ShardedDDP + OSS against DDP"),
    ("tests/nn/wrap/test_wrap.py", "enable_wrap / wrap / auto_wrap and the policies"),
    ("tests/nn/checkpoint/test_checkpoint_activations.py", "checkpoint_wrapper"),
    ("tests/nn/misc/test_flatten_params_wrapper.py", "FlattenParamsWrapper"),
    ("tests/nn/checkpoint/test_checkpoint_activations_norm.py", "checkpoint_wrapper around batch norm"),
    ("tests/optim/test_single_node_adascale.py", "AdaScale: gain, accumulation, scale, schedulers"),
    ("tests/nn/data_parallel/test_fsdp_summon_full_params.py", "FSDP summon_full_params"),
    ("tests/nn/data_parallel/test_fsdp_state_dict.py", "FSDP state_dict / local_state_dict"),
    ("tests/nn/data_parallel/test_fsdp_grad_acc.py", "FSDP no_sync and accumulation"),
    ("tests/nn/data_parallel/test_fsdp.py", "FSDP: the main file"),
    ("tests/experimental/nn/test_offload.py", "OffloadModel"),
    ("tests/nn/pipe/test_pipe.py", "Pipe (GPipe in one process)"),
]

# Loads FairScale's own test harness modules from its source tree, ahead of the alias, in every process.
SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, importlib.util, os, sys
_SOURCE = {source!r}
_STAGED = {staged!r}
_HELPERS = {helpers!r}

class _HelperFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fairscale":  # the alias: once it has put its finder first, put this one before it
            spec = importlib.machinery.PathFinder.find_spec(name, [_STAGED])
            inner, finder = spec.loader, self
            class _Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return inner.create_module(spec)
                def exec_module(self, module):
                    inner.exec_module(module)
                    sys.meta_path.remove(finder)
                    sys.meta_path.insert(0, finder)
            spec.loader = _Loader()
            return spec
        if not any(name == h or name.startswith(h + ".") for h in _HELPERS):
            return None
        base = os.path.join(_SOURCE, *name.split("."))
        if os.path.isdir(base):
            return importlib.util.spec_from_file_location(name, os.path.join(base, "__init__.py"),
                                                          submodule_search_locations=[base])
        return importlib.util.spec_from_file_location(name, base + ".py")

sys.meta_path.insert(0, _HelperFinder())
"""


def stage_shardspeed_side(folder: Path, source: Path) -> Path:
    """The alias laid out as `pip install ./integrations/fairscale-alias` would, and the helper loader."""
    folder.mkdir(parents=True)
    (folder / "fairscale").symlink_to(ALIAS_SOURCE / "fairscale", target_is_directory=True)
    info = folder / "fairscale-0.4.13+shardspeed.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fairscale\nVersion: 0.4.13+shardspeed\n")
    (info / "top_level.txt").write_text("fairscale\n")
    text = SITECUSTOMIZE.format(source=str(source), staged=str(folder), helpers=HELPERS)
    (folder / "sitecustomize.py").write_text(text)
    return folder


def stage_tests_root(folder: Path, source: Path) -> Path:
    """A folder holding only FairScale's `tests` package: the rank processes their tests spawn import the
    test module by name from it, and FairScale's source (next to `tests`) stays off sys.path."""
    folder.mkdir(parents=True)
    (folder / "tests").symlink_to(source / "tests", target_is_directory=True)
    return folder


def side_environment(side: str, staged: Path, tests_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SHARDSPEED_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", COLUMNS="400", PYTHONDONTWRITEBYTECODE="1")
    # FairScale's `tests` before this repository's own `tests` package
    paths = [staged, tests_root, ROOT] if side == "shardspeed" else [tests_root]
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def run_file(python: str, source: Path, name: str, env: dict, timeout: float, log_dir: Path) -> dict:
    log_path = log_dir / (name.replace("/", "__") + ".log")
    junit_path = log_path.with_suffix(".xml")
    junit_path.unlink(missing_ok=True)
    # -P and importlib mode: neither the working directory nor the test folder's root goes on sys.path, so
    # FairScale's source tree (the working directory) is not importable as `fairscale` on either side
    command = [python, "-P", "-m", "pytest", "--import-mode=importlib", "-p", "no:cacheprovider", "-rfEs",
               "--tb=short", f"--junitxml={junit_path}", name]  # fmt: skip
    started = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=timeout)
            status = "ok" if code in (0, 1, 5) else f"pytest exit {code}"
        except subprocess.TimeoutExpired:
            status = f"time limit ({timeout:.0f} s)"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # rank processes a stopped test left behind
        process.wait()
    parsed = parse_pytest_log(log_path.read_text(errors="replace"))
    if junit_path.exists():
        parsed["reasons"].update(junit_reasons(junit_path.read_text(errors="replace"), name))
    summary = summarize_file(parsed, status, time.monotonic() - started)
    return {**summary, "tests": parsed["tests"], "reasons": parsed["reasons"],
            "skip_reasons": parsed["skip_reasons"]}  # fmt: skip


def figure(results: dict) -> dict:
    """Of the tests FairScale passes, how many pass on shardspeed; and what shardspeed passes that
    FairScale skips on this machine (FSDP and OffloadModel need CUDA there)."""
    theirs_passed = both = 0
    missing, beyond = [], []
    for name, entry in results["files"].items():
        ours = entry.get("shardspeed", {}).get("tests", {})
        theirs = entry.get("fairscale", {}).get("tests", {})
        for test, outcome in theirs.items():
            if outcome == "passed":
                theirs_passed += 1
                if ours.get(test) == "passed":
                    both += 1
                else:
                    missing.append((name, test, ours.get(test, "not run")))
        beyond += [(name, t) for t, o in ours.items() if o == "passed" and theirs.get(t) != "passed"]
    share = both / theirs_passed if theirs_passed else 0.0
    return {"fairscale_passed": theirs_passed, "shardspeed_passed_of_those": both, "share": round(share, 4),
            "not_passing_on_shardspeed": missing, "passing_only_on_shardspeed": beyond}  # fmt: skip


def _cell(row: dict | None) -> str:
    if not row:
        return "not run"
    parts = [f"{row['passed']}/{row['collected']} passed"]
    parts += [
        f"{row[k]} {k.replace('_', ' ')}" for k in ("failed", "error", "skipped", "not_run") if row.get(k)
    ]
    return ", ".join(parts + ([row["status"]] if row["status"] != "ok" else []))


def render_markdown(results: dict) -> str:
    fig, meta = figure(results), results["meta"]
    lines = [
        "# FairScale's unit tests through the `fairscale` alias",
        "",
        f"FairScale's repository at commit `{meta['source_commit']}`, {len(results['files'])} files (selection "
        "and reasons in `benchmarks/fairscale_unit_tests.py`), each run with `pytest` on at most 2 CPU ranks "
        f"(Gloo), once with FairScale {meta.get('fairscale_version', '?')} installed and once with shardspeed "
        "behind the `fairscale` alias. On the shardspeed side FairScale's test harness modules "
        f"({', '.join(f'`{h}`' for h in HELPERS)}) come from FairScale's source; everything under test "
        "comes through the alias.",
        "",
        f"**Of the {fig['fairscale_passed']} tests FairScale passes here, {fig['shardspeed_passed_of_those']} "
        f"pass on shardspeed ({fig['share']:.1%}).** Tests passing on shardspeed that FairScale does not pass "
        f"here: {len(fig['passing_only_on_shardspeed'])}.",
        "",
        f"Machine: {meta.get('machine', '')}. Run: {meta.get('date', '')}. torch {meta.get('shardspeed_torch')}.",
        "",
        "| file | FairScale | shardspeed | why not (shardspeed, commonest) |",
        "|---|---|---|---|",
    ]
    for name, entry in results["files"].items():
        ours = entry.get("shardspeed")
        why = "; ".join(t.replace("|", "\\|") for t in (ours or {}).get("why", []))
        lines.append(f"| `{name}` | {_cell(entry.get('fairscale'))} | {_cell(ours)} | {why} |")
    lines += ["", "Every test FairScale passes and shardspeed does not, with the reason:", ""]
    for name, test, outcome in fig["not_passing_on_shardspeed"]:
        reason = results["files"][name].get("shardspeed", {}).get("reasons", {}).get(test, "")
        lines.append(f"- `{test}`: {outcome}" + (f" ({reason[:240]})" if reason else ""))
    if fig["passing_only_on_shardspeed"]:
        lines += ["", "Passing on shardspeed, not passing with FairScale on this machine:", ""]
        lines += [f"- `{test}`" for _, test in fig["passing_only_on_shardspeed"]]
    return "\n".join(lines) + "\n"


def check_interpreter(side: str, python: str, env: dict, source: Path) -> str:
    """Where `import fairscale` leads from the test folder: the alias on the shardspeed side, the installed
    FairScale on the other (never FairScale's source tree)."""
    code = "import fairscale; print(fairscale.__file__)"
    out = subprocess.run([python, "-P", "-c", code], env=env, cwd=source, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    where = out.stdout.strip()
    alias = "shardspeed-fairscale-alias" in Path(where).read_text(errors="replace") if where else False
    inside_source = bool(where) and Path(where).resolve().is_relative_to(source.resolve())
    if out.returncode != 0 or alias != (side == "shardspeed") or inside_source:
        raise SystemExit(f"{side}: `import fairscale` gives {where or out.stderr[-2000:]}")
    return where


def _version(python: str, module: str, env: dict) -> str:
    code = f"import importlib.metadata as m; print(m.version({module!r}))"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout.strip() or "?"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="FairScale's repository (a checkout)")
    parser.add_argument("--shardspeed-python", default=sys.executable)
    parser.add_argument("--fairscale-python")
    parser.add_argument("--only", choices=SIDES, help="run one side; the other keeps its last results")
    parser.add_argument("--files", nargs="+", help="a subset of FILES (default: all of them)")
    parser.add_argument("--file-timeout", type=float, default=900.0, help="seconds per file and side")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--logs", type=Path, default=Path(tempfile.gettempdir()) / "fairscale_unit_tests_logs"
    )
    parser.add_argument("--machine", default=f"{os.cpu_count()} CPU cores, {platform.platform()}")
    parser.add_argument("--merge", type=Path, help="take the other side's results from this JSON (a run of "
                        "one side with another --out, e.g. started at the same time), write the tables, run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.source / "fairscale" / "fair_dev" / "testing" / "testing.py").is_file():
        parser.error(f"--source {args.source}: not FairScale's repository")
    unknown = sorted(set(args.files or ()) - {name for name, _ in FILES})
    if unknown:
        parser.error(f"--files: not in the selection: {unknown}")
    if args.only != "shardspeed" and not args.fairscale_python and args.merge is None:
        parser.error("--fairscale-python is required unless --only shardspeed")
    return args


def merge(json_path: Path, other_path: Path) -> dict:
    """This results file with every side it lacks taken from `other_path` (same files, same commit)."""
    results, other = json.loads(json_path.read_text()), json.loads(other_path.read_text())
    for name, entry in other["files"].items():
        for side, row in entry.items():
            results["files"].setdefault(name, {}).setdefault(side, row)
    for key, value in other.get("meta", {}).items():
        results["meta"].setdefault(key, value)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.out / "fairscale_unit_tests.json"
    if args.merge is not None:
        results = merge(json_path, args.merge)
        json_path.write_text(json.dumps(results, indent=1))
        (args.out / "fairscale_unit_tests.md").write_text(render_markdown(results))
        return 0
    results = json.loads(json_path.read_text()) if json_path.exists() else {"files": {}}
    results["files"] = {name: results["files"].get(name, {}) for name, _ in FILES}
    names = args.files or [name for name, _ in FILES]
    with tempfile.TemporaryDirectory(prefix="fs-conformance-") as tmp:
        staged = stage_shardspeed_side(Path(tmp) / "site", args.source.resolve())
        tests_root = stage_tests_root(Path(tmp) / "tests_root", args.source.resolve())
        meta = results.setdefault("meta", {})
        meta.update(source_commit=SOURCE_COMMIT, machine=args.machine, date=datetime.date.today().isoformat(),
                    file_timeout_s=args.file_timeout)  # fmt: skip
        for side in [args.only] if args.only else SIDES:
            python = args.fairscale_python if side == "fairscale" else args.shardspeed_python
            env = side_environment(side, staged, tests_root)
            (args.logs / side).mkdir(parents=True, exist_ok=True)
            meta[f"{side}_imports_from"] = check_interpreter(side, python, env, args.source)
            meta[f"{side}_version"] = _version(python, side, env)
            meta[f"{side}_torch"] = _version(python, "torch", env)
            for name in names:
                row = run_file(python, args.source, name, env, args.file_timeout, args.logs / side)
                results["files"][name][side] = row
                print(f"[{side}] {name}: {row['passed']}/{row['collected']} passed, {row['status']}, "
                      f"{row['seconds']:.0f} s", flush=True)  # fmt: skip
                json_path.write_text(json.dumps(results, indent=1))
    (args.out / "fairscale_unit_tests.md").write_text(render_markdown(results))
    print(f"wrote {json_path} and fairscale_unit_tests.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
