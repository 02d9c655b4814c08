"""DeepSpeed's ZeRO-3 + AutoTP checkpoints as a universal folder (what `ds_to_universal` writes for them).

Such a checkpoint is a grid of files `zero_pp_rank_{d}_mp_rank_{t:02d}_{model,optim}_states.pt`: tensor rank
t's model-states file lists the shapes of *its* shards (`param_shapes`, one dict per sub-group, uneven splits
included), and its data-parallel files hold ZeRO-3's partition of those shards (layout.Zero3Layout). Each
parameter is read whole per tensor rank, for the fp32 master and each per-element optimizer state, then the
tensor slices are merged by the checkpoint's `universal_checkpoint_info` (checkpoint/tp_slices.py) and written
as `zero/<name>/<state>.pt`. Layouts the info marks unsupported are refused before anything is read.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from shardspeed.checkpoint import files
from shardspeed.checkpoint.deepspeed_format.layout import Zero3Layout
from shardspeed.checkpoint.files import CheckpointError
from shardspeed.checkpoint.tp_slices import PARAM, SUB_PARAM_SHAPE, merge_rank_slices

__all__ = ["is_deepspeed_zero3_tp", "write_zero3_tp_universal"]

_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")
_INFO = "universal_checkpoint_info"


def _grid(folder: Path, kind: str) -> list[list[Path]]:
    """grid[tp][dp] of the `kind` ("model" or "optim") files; every (tp, dp) pair must be there."""
    found = {}
    for path in folder.iterdir():
        m = _FILE.match(path.name)
        if m and m.group(3) == kind:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
    if not found:
        raise CheckpointError(f"{folder}: no ZeRO-3 {kind}-states files")
    tp, dp = max(found) + 1, max(max(d) for d in found.values()) + 1
    missing = [(t, d) for t in range(tp) for d in range(dp) if d not in found.get(t, {})]
    if missing:
        raise CheckpointError(f"{folder}: no ZeRO-3 {kind}-states file for (tp rank, dp rank) {missing}")
    return [[found[t][d] for d in range(dp)] for t in range(tp)]


def is_deepspeed_zero3_tp(folder) -> bool:
    """Whether `folder` is a DeepSpeed ZeRO-3 checkpoint saved at tensor degree > 1."""
    folder = Path(folder)
    return folder.is_dir() and any(
        (m := _FILE.match(p.name)) and m.group(3) == "model" and int(m.group(2)) > 0 for p in folder.iterdir()
    )


def _rank_values(optim_files: list[Path], shapes: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {name: this tensor rank's whole shard}} from its data-parallel optimizer files."""
    layout = Zero3Layout([[(n, tuple(s)) for n, s in group.items()] for group in shapes], len(optim_files))
    buffers, step = {}, None  # buffers[state][dp][sub-group]
    for path in optim_files:  # in data-parallel order
        osd = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        buffers.setdefault("fp32", []).append(osd["fp32_flat_groups"])
        per_group = osd["optimizer_state_dict"]["state"]
        per_group = [per_group[k] for k in sorted(per_group)] if isinstance(per_group, dict) else per_group
        for key in per_group[0] if per_group else ():
            if key == "step":
                step = per_group[0][key]
                continue
            buffers.setdefault(key, []).append([g[key] for g in per_group])
    out = {}
    for state, by_rank in buffers.items():
        out[state] = {}
        for name, place in layout.places.items():
            pieces = [by_rank[r][place.buffer].narrow(0, at, hi - lo)
                      for r in range(len(optim_files)) for lo, hi, at in layout.held_by(name, r)]  # fmt: skip
            shape = next(g[name] for g in shapes if name in g)
            out[state][name] = torch.cat(pieces).reshape(tuple(shape))
    if step is not None:
        out["step"] = step
    return out


def write_zero3_tp_universal(source, output, validate_info) -> None:
    """Write DeepSpeed ZeRO-3 + AutoTP checkpoint `source` as the universal folder `output` (and point
    `latest_universal` at it). `validate_info` refuses layouts the info marks unsupported."""
    source, output = Path(source), Path(output)
    model_grid, optim_grid = _grid(source, "model"), _grid(source, "optim")
    if (len(model_grid), len(model_grid[0])) != (len(optim_grid), len(optim_grid[0])):
        raise CheckpointError(f"{source}: the model-states and optimizer-states files form different grids")
    first = torch.load(model_grid[0][0], map_location="cpu", weights_only=False)
    info = first.get(_INFO)
    if info is None:
        raise CheckpointError(f"{model_grid[0][0]} has no '{_INFO}': AutoTP writes it with every checkpoint")
    validate_info(info)
    tp = len(model_grid)
    shapes = [
        torch.load(row[0], map_location="cpu", weights_only=False)["param_shapes"] for row in model_grid
    ]
    per_rank = [_rank_values(optim_grid[t], shapes[t]) for t in range(tp)]
    names = [n for group in shapes[0] for n in group]
    zero = output / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    for name in names:
        (zero / name).mkdir(exist_ok=True)
        for state in (s for s in per_rank[0] if s != "step"):
            value, extra = merge_rank_slices(info, name, [per_rank[t][state][name] for t in range(tp)], tp)
            # The fused layout is recorded as plain data: a pickled class would need the library that wrote
            # it to be read back, and a DeepSpeed AutoTP loader cuts by its parameters' metadata anyway.
            if SUB_PARAM_SHAPE in extra:
                fused = extra[SUB_PARAM_SHAPE]
                extra[SUB_PARAM_SHAPE] = {"shape": fused.shape, "partition_dim": fused.partition_dim}
            torch.save({**extra, PARAM: value}, zero / name / f"{state}.pt")
        if "step" in per_rank[0]:
            torch.save(per_rank[0]["step"], zero / name / "step.pt")
    first_optim = torch.load(optim_grid[0][0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
    common = {k: v for k, v in first_optim.items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
    inner = first_optim["optimizer_state_dict"]
    common["optimizer_state_dict"] = {"state": {}, "param_groups": inner.get("param_groups", [])}
    torch.save(common, zero / "optimizer_state.pt")
    for row in model_grid:
        for path in row:
            shutil.copy2(path, output / path.name)
    files.atomic_write_text(output.parent / "latest_universal", output.name)
