"""`summary.txt` of an autotuning search, in DeepSpeed's layout: one row per tuning space, then `global`."""

from __future__ import annotations

import os

from .constants import GLOBAL_TUNING_SPACE
from .experiments import Experiment

__all__ = ["write_summary"]

HEADERS = ("tuning_space", "num_experiments", "best_metric_val", "best_exp_name")


def _table(rows: list[tuple]) -> str:
    """A Markdown ("pipe") table, as DeepSpeed prints it with tabulate."""
    cells = [HEADERS, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]
    numeric = [False, True, True, False]

    def line(row):
        return (
            "| "
            + " | ".join(
                c.rjust(w) if n else c.ljust(w) for c, w, n in zip(row, widths, numeric, strict=True)
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if n else (":" + "-" * (w + 1))
            for w, n in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *[line(r) for r in cells[1:]]])


def write_summary(results_dir: str, finished: list[Experiment], metric: str, best_of, duration) -> str:
    """Write `<results_dir>/summary.txt` and return its text. `best_of(space or None)` picks the best."""
    rows = []
    for space in dict.fromkeys(e.space for e in finished):
        best = best_of(space)
        count = sum(e.space == space for e in finished)
        rows.append((space, count, best.value(metric) if best else None, best.name if best else None))
    overall = best_of(None)
    if overall is not None:
        rows.append((GLOBAL_TUNING_SPACE, len(finished), overall.value(metric), overall.name))
    failed = [e for e in finished if e.error is not None]
    text = _table(rows)
    if failed:
        text += "\n\nFailed experiments:\n" + "\n".join(f"  {e.name}: {e.error}" for e in failed)
    text += f"\n\nTuning completed in {duration}. Total number of experiments: {len(finished)}."
    with open(os.path.join(results_dir, "summary.txt"), "w", encoding="utf-8") as handle:
        handle.write(text + "\n")
    return text
