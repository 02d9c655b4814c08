"""Reading pytest's output for the DeepSpeed conformance run, and writing its tables (.md + .json).

`parse_pytest_log` turns one file's pytest output (verbose, `-rfEs`, as `deepspeed_unit_tests.py` runs it)
into per-test outcomes and a reason for each test that did not pass. `render_markdown` writes the per-file
table for both systems and the headline figure: of the tests DeepSpeed passes, how many pass through the
`deepspeed` alias on shardspeed.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter

from unit_test_sample import tree_estimate

__all__ = [
    "alias_only_figure",
    "conformance_figure",
    "junit_reasons",
    "parse_pytest_log",
    "render_markdown",
    "summarize_file",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# `unit/x.py::Class::test[param] PASSED [ 10%]` (pytest -v); ids may hold spaces inside brackets
_RESULT = re.compile(r"^((?:unit|tests)/\S+?\.py::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# `FAILED unit/x.py::test - Reason` / `ERROR unit/x.py - Reason` / `SKIPPED [1] unit/x.py:12: reason`
_SUMMARY = re.compile(r"^(FAILED|ERROR) ((?:unit|tests)/\S+?\.py(?:::.+?)?)(?: - (.*))?$")
_SKIP_SUMMARY = re.compile(r"^SKIPPED \[(\d+)\] (\S+?): (.*)$")
_COLLECTED = re.compile(r"collected (\d+) items?(?: / (\d+) errors?)?(?: / (\d+) deselected)?")
OUTCOMES = ("passed", "failed", "skipped", "error")


def _clean(text: str) -> str:
    return _ANSI.sub("", text).rstrip("\n")


def parse_pytest_log(text: str) -> dict:
    """Per-test outcomes, failure reasons, skip reasons and collection errors found in one pytest log."""
    tests: dict[str, str] = {}
    reasons: dict[str, str] = {}
    skip_reasons: Counter = Counter()
    collection_errors: list[str] = []
    collected = deselected = 0
    first_error = (
        ""  # the first `E   SomeError: ...` line: the reason of a collection error the summary leaves bare
    )
    for raw in text.splitlines():
        line = _clean(raw).strip()
        if not first_error and re.match(r"^E\s+[\w.]*(Error|Exception)\b", line):
            first_error = line[1:].strip()
        match = _COLLECTED.search(line)
        if match and line.startswith("collect"):
            collected = int(match.group(1))
            deselected = int(match.group(3) or 0)
            continue
        match = _RESULT.match(line)
        if match:
            outcome = {"XFAIL": "skipped", "XPASS": "passed"}.get(match.group(2), match.group(2).lower())
            # a test that failed its teardown after passing shows twice: the worse outcome wins
            if tests.get(match.group(1)) not in ("failed", "error"):
                tests[match.group(1)] = outcome
            continue
        match = _SUMMARY.match(line)
        if match:
            kind, node, reason = match.groups()
            reason = (reason or "").strip()
            if "::" in node:
                reasons[node] = reason
                tests.setdefault(node, kind.lower())
            else:
                collection_errors.append(f"{node}: {reason or first_error}".strip(": "))
            continue
        match = _SKIP_SUMMARY.match(line)
        if match:
            skip_reasons[match.group(3).strip()] += int(match.group(1))
    return {
        "collected": collected - deselected if collected >= deselected else collected,
        "tests": tests,
        "reasons": reasons,
        "skip_reasons": dict(skip_reasons),
        "collection_errors": collection_errors,
    }


def _reason(text: str) -> str:
    """The exception line of a failure's traceback text (`E   TypeError: ...`), else its last line."""
    if "EXITED with status 124" in text:  # pytest_plugins/conformance_limit.py ended the test
        return "stopped at the per-test time limit"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return errors[0] if errors else (lines[-1] if lines else "")


def junit_reasons(xml_text: str, test_file: str) -> dict[str, str]:
    """Test id -> reason for each failed or errored test of `test_file` in a pytest junit report.

    pytest-forked reports have no separate crash message, so the reason is read from the traceback text.
    """
    module = test_file[: -len(".py")].replace("/", ".")
    reasons = {}
    for case in ElementTree.fromstring(xml_text).iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        if problem is None:
            continue
        owner = case.get("classname", "")
        klass = owner[len(module) + 1 :] if owner.startswith(module + ".") else ""
        test_id = "::".join(part for part in (test_file, klass, case.get("name", "")) if part)
        reasons[test_id] = _reason(problem.get("message") or problem.text or "")
    return reasons


def summarize_file(parsed: dict, status: str, seconds: float) -> dict:
    """Counts per outcome plus the commonest reasons, for one file on one system."""
    counts = Counter(parsed["tests"].values())
    row = {outcome: counts.get(outcome, 0) for outcome in OUTCOMES}
    row["collected"] = max(parsed["collected"], len(parsed["tests"]))
    row["not_run"] = max(0, row["collected"] - len(parsed["tests"]))
    row["status"] = status
    row["seconds"] = round(seconds, 1)
    why = Counter(_short(r) for r in parsed["reasons"].values() if r)
    row["why"] = [f"{n}x {r}" if n > 1 else r for r, n in why.most_common(3)]
    if parsed["collection_errors"]:
        row["why"] = [_short(e) for e in parsed["collection_errors"][:2]] + row["why"]
    return row


def _short(reason: str, limit: int = 140) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def conformance_figure(results: dict) -> dict:
    """Of the tests DeepSpeed passes, how many pass on shardspeed (and which do not)."""
    passed_by_deepspeed = passed_by_both = 0
    missing = []
    for name, entry in results["files"].items():
        ours = entry.get("shardspeed", {}).get("tests", {})
        for test, outcome in entry.get("deepspeed", {}).get("tests", {}).items():
            if outcome != "passed":
                continue
            passed_by_deepspeed += 1
            if ours.get(test) == "passed":
                passed_by_both += 1
            else:
                missing.append((name, test, ours.get(test, "not run")))
    share = passed_by_both / passed_by_deepspeed if passed_by_deepspeed else 0.0
    return {
        "deepspeed_passed": passed_by_deepspeed,
        "shardspeed_passed_of_those": passed_by_both,
        "share": round(share, 4),
        "not_passing_on_shardspeed": missing,
    }


def _cell(row: dict | None) -> str:
    if not row:
        return "not run"
    parts = [f"{row['passed']}/{row['collected']} passed"]
    for key in ("failed", "error", "skipped", "not_run"):
        if row.get(key):
            parts.append(f"{row[key]} {key.replace('_', ' ')}")
    if row["status"] != "ok":
        parts.append(row["status"])
    return ", ".join(parts)


def _why(row: dict | None) -> str:
    if not row or not row.get("why"):
        return ""
    return "; ".join(text.replace("|", "\\|") for text in row["why"])


def _ran(results: dict, side: str) -> list[str]:
    return [name for name, entry in results["files"].items() if entry.get(side)]


def alias_only_figure(results: dict) -> dict:
    """Files run through the alias whose DeepSpeed side has not run yet: their tests and passes."""
    files = [
        name
        for name, entry in results["files"].items()
        if entry.get("shardspeed") and not entry.get("deepspeed")
    ]
    rows = [results["files"][name]["shardspeed"] for name in files]
    return {
        "files": len(files),
        "collected": sum(row["collected"] for row in rows),
        "passed": sum(row["passed"] for row in rows),
        "skipped": sum(row["skipped"] for row in rows),
        "not_run": sum(row.get("not_run", 0) for row in rows),
        "stopped": sum(1 for row in rows if row["status"] != "ok"),
    }


def _inventory_lines(results: dict) -> list[str]:
    inventory = results.get("inventory", {})
    if not inventory:
        return []
    not_run = {name: entry for name, entry in inventory.items() if not entry["runs"]}
    lines = [
        f"DeepSpeed's `tests/unit` holds {len(inventory)} test files. With the CPU workflow's marker expression, "
        f"DeepSpeed collects tests in {len(inventory) - len(not_run)} of them here; the other {len(not_run)} it "
        "does not run on CPU (listed at the end, with the reason).",
        "",
    ]
    return lines


def _not_run_lines(results: dict) -> list[str]:
    not_run = {name: entry for name, entry in results.get("inventory", {}).items() if not entry["runs"]}
    if not not_run:
        return []
    lines = ["", f"Files DeepSpeed does not run on CPU ({len(not_run)}):", "", "| file | why |", "|---|---|"]
    for name, entry in not_run.items():
        lines.append(f"| `{name}` | {_short(entry['why_not'], 200).replace('|', chr(92) + '|')} |")
    return lines


def _sampled_lines(results: dict) -> list[str]:
    """(b): the whole-tree estimate from the sampled runs, then one row per sampled file."""
    full = {n for n, e in results["files"].items() if e.get("deepspeed") and e.get("shardspeed")}
    sampled = {  # a file run in full on both sides since it was sampled counts by its full run
        n: e
        for n, e in results.get("sampled", {}).items()
        if e.get("deepspeed") and e.get("shardspeed") and n not in full
    }
    if not sampled:
        return []
    est = tree_estimate(results)
    seeds = sorted({e["seed"] for e in sampled.values()})
    sizes = sorted({e["sample_size"] for e in sampled.values()})
    lines = [
        "## (b) Estimate from a sample (not a full run; the whole tree once every file is sampled)",
        "",
        f"In files not run in full on both sides, a sampled run took {'/'.join(map(str, sizes))} of DeepSpeed's "
        f"collected tests per file (seed {'/'.join(map(str, seeds))}; the same node ids on both sides, same limits). "
        f"Sampled so far: {est['sampled_files']} files, {est['sampled_tests']} tests, of which DeepSpeed passes "
        f"{est['sampled_deepspeed_passed']}; {len(est['unmeasured_files'])} files are measured neither in full nor "
        "by sample yet.",
        "",
        f"**Estimate over the {est['full_files']} full-run files and the {est['sampled_files']} sampled ones: of "
        f"about {est['estimated_deepspeed_passed']:.0f} tests DeepSpeed passes, about "
        f"{est['estimated_both_passed']:.0f} pass through the alias ({est['estimated_share']:.1%}).** Full-run files "
        "count exactly; each sampled file counts its sampled pass share scaled by the number of tests DeepSpeed "
        "collects there (N collected, k sampled: DeepSpeed's sampled passes and the alias's passes among them, "
        "times N/k). With 2-3 tests a file, one file's share is coarse; the sum over many files is the figure.",
        "",
        "| file (sampled) | DeepSpeed collects | sampled | DeepSpeed passed | alias passed of those | why not (alias) |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in sampled.items():
        passed_ds = [t for t, o in entry["deepspeed"]["tests"].items() if o == "passed"]
        both = [t for t in passed_ds if entry["shardspeed"]["tests"].get(t) == "passed"]
        lines.append(f"| `{name}` | {entry['deepspeed_collected']} | {len(entry['ids'])} | {len(passed_ds)} | "
                     f"{len(both)} | {_why(entry['shardspeed'])} |")  # fmt: skip
    return ["", *lines]


def render_markdown(results: dict) -> str:
    figure = conformance_figure(results)
    alias_only = alias_only_figure(results)
    meta = results["meta"]
    both = [name for name in _ran(results, "deepspeed") if results["files"][name].get("shardspeed")]
    lines = [
        "# DeepSpeed's unit tests through the `deepspeed` alias",
        "",
        f"DeepSpeed's `tests/` at commit `{meta['tests_commit']}`, the files of `unit/` that its CPU workflow runs "
        "(found by `benchmarks/deepspeed_unit_tests.py`), each run with `pytest --forked` on 2 CPU ranks (Gloo) "
        "under a per-test and a per-file time limit, once with DeepSpeed "
        f"{meta.get('deepspeed_version', '?')} installed and once with shardspeed behind the `deepspeed` alias.",
        "",
        *_inventory_lines(results),
        f"What ran: {len(results['files'])} files to run; DeepSpeed's side ran in {len(_ran(results, 'deepspeed'))}, "
        f"the alias side in {len(_ran(results, 'shardspeed'))}, both in {len(both)}. Each row's date and limits "
        "are in the .json.",
        "",
        f"**(a) In the {len(both)} files run in full on both sides: of the {figure['deepspeed_passed']} tests DeepSpeed passes "
        f"here, {figure['shardspeed_passed_of_those']} pass on shardspeed ({figure['share']:.1%}).**",
        "",
    ]
    if alias_only["files"]:
        lines += [
            f"In the {alias_only['files']} files run only through the alias so far: {alias_only['passed']} of "
            f"{alias_only['collected']} tests pass ({alias_only['skipped']} skipped, {alias_only['not_run']} not "
            f"reached before the file's time limit in {alias_only['stopped']} files); which of them DeepSpeed "
            "passes is not measured until its side runs there.",
            "",
        ]
    lines += [
        f"Machine: {meta.get('machine', '')}.",
        "",
        "| file | DeepSpeed | shardspeed | why not (shardspeed) | why not (DeepSpeed) |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["files"].items():
        ours, theirs = entry.get("shardspeed"), entry.get("deepspeed")
        lines.append(f"| `{name}` | {_cell(theirs)} | {_cell(ours)} | {_why(ours)} | {_why(theirs)} |")
    lines += _sampled_lines(results)
    lines += _not_run_lines(results)
    lines += ["", "Tests DeepSpeed passes and shardspeed does not (full-file runs):", ""]
    for name, test, outcome in figure["not_passing_on_shardspeed"]:
        reason = results["files"][name].get("shardspeed", {}).get("reasons", {}).get(test, "")
        lines.append(f"- `{test}`: {outcome}" + (f" ({_short(reason, 200)})" if reason else ""))
    return "\n".join(lines) + "\n"
