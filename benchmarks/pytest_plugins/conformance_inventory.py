"""A pytest plugin for benchmarks/deepspeed_unit_tests.py: what a collection of DeepSpeed's `unit/` holds, per file.

Run with `--collect-only -p conformance_inventory --inventory-out=FILE`, it writes FILE as JSON: for each test
file, how many tests were selected (the marker expression given with -m), how many were deselected by it,
and whether the file was skipped whole at import (`pytest.skip(allow_module_level=True)`: DeepSpeed does this
for ops its build lacks) or failed to import, with the reason. The conformance script reads it to know which
files DeepSpeed's CPU workflow runs and which it skips whole.
"""

from __future__ import annotations

import json
from collections import defaultdict

_files: dict[str, dict] = defaultdict(
    lambda: {"selected": 0, "deselected": 0, "skipped_whole": None, "error": None}
)


def pytest_addoption(parser) -> None:
    parser.addoption("--inventory-out", default=None, help="where to write the per-file inventory (JSON)")
    parser.addoption("--node-ids-out", default=None, help="where to write the selected node ids (JSON list)")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def pytest_collectreport(report) -> None:
    if not report.nodeid.endswith(".py"):
        return
    entry = _files[report.nodeid]
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["skipped_whole"] = reason.removeprefix("Skipped: ")
    elif report.failed:
        entry["error"] = _error_line(str(report.longrepr))


def pytest_deselected(items) -> None:
    for item in items:
        _files[_file_of(item.nodeid)]["deselected"] += 1


def pytest_collection_finish(session) -> None:
    for item in session.items:
        _files[_file_of(item.nodeid)]["selected"] += 1
    ids_out = session.config.getoption("node_ids_out")
    if ids_out:  # for a sampled run (benchmarks/unit_test_sample.py): which tests there are to choose from
        with open(ids_out, "w") as handle:
            json.dump([item.nodeid for item in session.items], handle, indent=0)
    out = session.config.getoption("inventory_out")
    if out:
        with open(out, "w") as handle:
            json.dump(dict(sorted(_files.items())), handle, indent=1)
