"""Data efficiency against DeepSpeed 0.19.8 itself: schedule values and the data analyzer's file format.

    python benchmarks/data_efficiency_parity.py --deepspeed-python /path/to/ds-venv/bin/python

Runs this file as a worker in both interpreters (DeepSpeed's classes in one, shardspeed's in the other, never
both in one process) and compares:

- `CurriculumScheduler.update_difficulty` over steps 0-129 for a grid of fixed_linear / fixed_root schedules
  (min and max difficulty, total steps, difficulty step, root degree) and DeepSpeed's fixed_discrete example;
- `RandomLTDScheduler.update_seq` (kept length and consumed layer-tokens) over steps 0-399 for a grid of
  random-LTD schedules, each step called twice as gradient accumulation does;
- MMIDIDX files: the analyzer's index files written by shardspeed read by DeepSpeed's `MMapIndexedDataset`, and
  rows written by DeepSpeed's builder read by shardspeed's.

Writes `benchmarks/results/data_efficiency_parity.md`. The sampler's batches are not compared: DeepSpeed draws
them with NumPy's generator, shardspeed with torch's (docs/configuration.md says why).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, LTD_STEPS = 130, 400


def _curricula() -> list[dict]:
    grid = itertools.product([1, 8, 16], [64, 100, 1024], [5, 37, 100], [1, 2, 8, 16], [1, 2, 3])
    out = []
    for low, high, total, step, root in grid:
        params = {"total_curriculum_step": total, "difficulty_step": step}
        out.append({"min_difficulty": low, "max_difficulty": high, "schedule_type": "fixed_root",
                    "schedule_config": {**params, "root_degree": root}})  # fmt: skip
        if root == 1:
            out.append({"min_difficulty": low, "max_difficulty": high, "schedule_type": "fixed_linear",
                        "schedule_config": params})  # fmt: skip
    out.append({"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]}})  # fmt: skip
    return out


def _random_ltds() -> list[dict]:
    out = []
    for low, high, steps, per in itertools.product([16, 128], [512, 2048], [10, 333], [1, 16]):
        out.append({
            "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22, "random_ltd_layer_id": list(range(1, 23)),
            "model_mask_name": "attention_mask", "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
            "random_ltd_schedule": {"min_value": low, "max_value": high, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": steps, "seq_per_step": per}},
            "layer_token_lr_schedule": {"enabled": False}, "global_batch_size": 32, "micro_batch_size": 4,
        })  # fmt: skip
    return out


def _worker(side: str, folder: str) -> dict:
    logging.disable(logging.WARNING)  # both warn about difficulty steps that are not multiples of 8
    if side == "deepspeed":
        import numpy as np
        import torch
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
        from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler
        from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
        from deepspeed.runtime.data_pipeline.data_sampling.utils import (
            close_mmap_dataset_builder,
            create_mmap_dataset_builder,
        )

        rows = MMapIndexedDataset(f"{folder}/len/len_index_to_sample", skip_warmup=True)
        values = MMapIndexedDataset(f"{folder}/len/len_index_to_metric", skip_warmup=True)
        files = {"index_to_sample": [rows[i].tolist() for i in range(len(rows))],
                 "index_to_metric": [values[i].tolist() for i in range(len(values))]}  # fmt: skip
        builder = create_mmap_dataset_builder(f"{folder}/written_by_deepspeed", np.uint32)
        for row in ([5, 6, 70000], [1], [2**32 - 1]):
            builder.add_item(torch.tensor(row))
        close_mmap_dataset_builder(builder, f"{folder}/written_by_deepspeed")
    else:
        sys.path.insert(0, str(ROOT))
        from shardspeed.data_pipeline import (
            CurriculumScheduler,
            MMapIndexedDataset,
            RandomLTDScheduler,
            write_metric_index,
        )

        write_metric_index(folder, "len", [7, 3, 7, 1, 300, 3, 7])
        files = None
    curricula = []
    for config in _curricula():
        scheduler = CurriculumScheduler(config)
        curricula.append([scheduler.update_difficulty(step) for step in range(STEPS)])
    ltds = []
    for config in _random_ltds():
        scheduler = RandomLTDScheduler(config)
        seq = []
        for step in range(LTD_STEPS):
            scheduler.update_seq(step)
            scheduler.update_seq(step)
            seq.append([scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]])
        ltds.append(seq)
    if side == "shardspeed" and Path(f"{folder}/written_by_deepspeed.idx").exists():
        rows = MMapIndexedDataset(f"{folder}/written_by_deepspeed")
        files = {"written_by_deepspeed": [rows[i].tolist() for i in range(len(rows))]}
    return {"curricula": curricula, "random_ltd": ltds, "files": files}


def _run(python: str, side: str, folder: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([python, __file__, "--worker", side, "--folder", folder], env=env, capture_output=True,
                         text=True, timeout=600, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-python", help="an interpreter with deepspeed==0.19.8")
    parser.add_argument("--shardspeed-python", default=sys.executable)
    parser.add_argument("--worker", choices=["deepspeed", "shardspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "data_efficiency_parity.md"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.folder)))
        return
    if not args.deepspeed_python:
        parser.error("--deepspeed-python is required")
    folder = tempfile.mkdtemp()
    ours = _run(args.shardspeed_python, "shardspeed", folder)  # writes the analyzer's files first
    theirs = _run(args.deepspeed_python, "deepspeed", folder)  # reads them, writes its own rows
    back = _run(args.shardspeed_python, "shardspeed", folder)  # reads DeepSpeed's rows
    same_curricula = sum(a == b for a, b in zip(ours["curricula"], theirs["curricula"]))
    same_ltd = sum(a == b for a, b in zip(ours["random_ltd"], theirs["random_ltd"]))
    expected_index = {
        "index_to_sample": [[3], [1, 5], [0, 2, 6], [4]],
        "index_to_metric": [[1], [3], [7], [300]],
    }
    lines = [
        "# Data efficiency against DeepSpeed 0.19.8",
        "",
        "`python benchmarks/data_efficiency_parity.py --deepspeed-python ...` (DeepSpeed's own classes in their "
        "own interpreter).",
        "",
        "| check | equal to DeepSpeed |",
        "|---|---|",
        f"| CurriculumScheduler difficulty, steps 0-{STEPS - 1} | {same_curricula} of {len(ours['curricula'])} schedules |",
        f"| RandomLTDScheduler kept length and consumed layer-tokens, steps 0-{LTD_STEPS - 1} | "
        f"{same_ltd} of {len(ours['random_ltd'])} schedules |",
        f"| shardspeed's analyzer files read by DeepSpeed's MMapIndexedDataset | {theirs['files'] == expected_index} |",
        "| DeepSpeed's builder's rows (uint32) read by shardspeed | "
        f"{back['files'] == {'written_by_deepspeed': [[5, 6, 70000], [1], [2**32 - 1]]}} |",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
