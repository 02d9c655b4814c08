"""Sampled runs of DeepSpeed's unit tests: K tests per file, the same node ids on both sides.

Running every test of DeepSpeed's CPU tree on both sides takes many hours on a small machine. A sampled run
(`deepspeed_unit_tests.py --sample K --seed S`) takes DeepSpeed's collected node ids of each file (one
`--collect-only` on the DeepSpeed side, with the CPU workflow's markers), picks K of them with a generator
seeded by S and the file's name (so a rerun picks the same ids), and runs exactly those ids on both sides
under the same limits. The results live apart from the full-file results (`results["sampled"]`), each with
how many tests DeepSpeed collects in the file and how many were sampled, and the report states the figure
drawn from them as an estimate with its sample sizes, never as a full run.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

__all__ = ["choose_sample", "collect_node_ids", "tree_estimate"]


def collect_node_ids(
    python: str, tests_dir: Path, names: list[str], markers: str, env: dict, log_path: Path
) -> dict[str, list[str]]:
    """Per file, the node ids DeepSpeed's side collects there with `markers` (one collection of all `names`)."""
    ids_path = log_path.with_suffix(".json")
    command = [python, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", "-p", "no:randomly",
               "-p", "conformance_inventory", f"--node-ids-out={ids_path}",
               "--continue-on-collection-errors", "-m", markers, *names]  # fmt: skip
    out = subprocess.run(command, cwd=tests_dir, env=env, capture_output=True, text=True, timeout=3600)
    log_path.write_text(out.stdout + out.stderr)
    ids: dict[str, list[str]] = {name: [] for name in names}
    for node in json.loads(ids_path.read_text()):
        ids.setdefault(node.split("::", 1)[0], []).append(node)
    return ids


def choose_sample(node_ids: list[str], size: int, seed: int, file_name: str) -> list[str]:
    """`size` of the file's node ids, chosen by a generator seeded with the seed and the file's name.

    Seeding per file keeps a file's sample the same whichever other files a run holds or in what order.
    """
    chooser = random.Random(f"{seed}:{file_name}")  # a str seed is hashed deterministically (sha512)
    ordered = sorted(node_ids)
    return sorted(chooser.sample(ordered, min(size, len(ordered))))


def tree_estimate(results: dict) -> dict:
    """Of the tests DeepSpeed passes across the whole CPU tree, the share that passes through the alias.

    Files run in full on both sides count exactly. A file with only a sampled run counts its sample scaled up
    to the number of tests DeepSpeed collects there: with N collected, k sampled, d of the k passed by
    DeepSpeed and b of those d passed by the alias too, the file adds N*d/k to DeepSpeed's passes and N*b/k to
    both. That is each file's sampled pass share b/d weighted by the tests DeepSpeed collects there (times its
    pass rate, so a file where DeepSpeed passes little weighs little). Files with neither are counted as such.
    """
    exact_ds = exact_both = 0
    scaled_ds = scaled_both = 0.0
    full_files = sampled_files = sampled_tests = sampled_ds_passes = 0
    unmeasured = []
    for name, entry in results["files"].items():
        theirs, ours = entry.get("deepspeed"), entry.get("shardspeed")
        if theirs and ours:
            full_files += 1
            for test, outcome in theirs.get("tests", {}).items():
                if outcome == "passed":
                    exact_ds += 1
                    exact_both += ours.get("tests", {}).get(test) == "passed"
            continue
        sample = results.get("sampled", {}).get(name, {})
        if not (sample.get("deepspeed") and sample.get("shardspeed")):
            unmeasured.append(name)
            continue
        passed_ds = [t for t, o in sample["deepspeed"]["tests"].items() if o == "passed"]
        passed_both = [t for t in passed_ds if sample["shardspeed"]["tests"].get(t) == "passed"]
        scale = sample["deepspeed_collected"] / len(sample["ids"])
        scaled_ds += scale * len(passed_ds)
        scaled_both += scale * len(passed_both)
        sampled_files += 1
        sampled_tests += len(sample["ids"])
        sampled_ds_passes += len(passed_ds)
    total_ds = exact_ds + scaled_ds
    return {
        "full_files": full_files,
        "full_deepspeed_passed": exact_ds,
        "full_both_passed": exact_both,
        "sampled_files": sampled_files,
        "sampled_tests": sampled_tests,
        "sampled_deepspeed_passed": sampled_ds_passes,
        "estimated_deepspeed_passed": round(total_ds, 1),
        "estimated_both_passed": round(exact_both + scaled_both, 1),
        "estimated_share": round((exact_both + scaled_both) / total_ds, 4) if total_ds else 0.0,
        "unmeasured_files": unmeasured,
    }
