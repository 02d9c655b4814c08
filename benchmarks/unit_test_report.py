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

__all__ = ["conformance_figure", "junit_reasons", "parse_pytest_log", "render_markdown", "summarize_file"]

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
    for raw in text.splitlines():
        line = _clean(raw).strip()
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
                collection_errors.append(f"{node}: {reason}".strip(": "))
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


def render_markdown(results: dict) -> str:
    figure = conformance_figure(results)
    meta = results["meta"]
    lines = [
        "# DeepSpeed's unit tests through the `deepspeed` alias",
        "",
        f"DeepSpeed's `tests/` at commit `{meta['tests_commit']}`, {len(results['files'])} files of its CPU "
        "workflow's `unit/` (selection and reasons in `benchmarks/deepspeed_unit_tests.py`), each run with "
        "`pytest --forked` on 2 CPU ranks (Gloo) under a per-file time limit, once with DeepSpeed "
        f"{meta.get('deepspeed_version', '?')} installed and once with shardspeed behind the `deepspeed` alias.",
        "",
        f"**Of the {figure['deepspeed_passed']} tests DeepSpeed passes here, "
        f"{figure['shardspeed_passed_of_those']} pass on shardspeed ({figure['share']:.1%}).**",
        "",
        f"Machine: {meta.get('machine', '')}. Run: {meta.get('date', '')}.",
        "",
        "| file | DeepSpeed | shardspeed | why not (shardspeed) | why not (DeepSpeed) |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["files"].items():
        ours, theirs = entry.get("shardspeed"), entry.get("deepspeed")
        lines.append(f"| `{name}` | {_cell(theirs)} | {_cell(ours)} | {_why(ours)} | {_why(theirs)} |")
    lines += ["", "Tests DeepSpeed passes and shardspeed does not:", ""]
    for name, test, outcome in figure["not_passing_on_shardspeed"]:
        reason = results["files"][name].get("shardspeed", {}).get("reasons", {}).get(test, "")
        lines.append(f"- `{test}`: {outcome}" + (f" ({_short(reason, 200)})" if reason else ""))
    return "\n".join(lines) + "\n"
