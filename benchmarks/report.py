"""Render a suite result: the markdown table, the PNG plots, and the headline table in benchmarks/README.md."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

__all__ = ["markdown", "plot_memory", "plot_scaling", "plot_step_times", "update_readme", "write_all"]

_MIB = 2**20
_COLORS = {"one-process": "#555555", "shardspeed": "#1f77b4", "torch": "#ff7f0e", "deepspeed": "#2ca02c"}


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def _row_cells(r: dict) -> list[str]:
    head = [r["system"], str(r["zero_stage"])]
    if r["status"] != "ok":
        return [*head, f"*{r['status'].split(' (')[0]}*", *[""] * 13]
    loss = f"{r['final_loss']:.6f}" + ("" if r.get("loss_matches", True) else " ≠")
    return [
        *head,
        f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", f"{r['max_s']:.4f}",
        _fmt(r.get("vs_one_process"), ".3f", "x"), _fmt(r.get("vs_floor"), ".3f", "x"),
        _fmt(r.get("vs_ddp"), ".3f", "x"),
        f"{r['tokens_per_s']:,.0f}", f"{r['peak_rss_bytes'] / _MIB:,.0f}",
        f"{r['model_state_bytes'] / _MIB:,.1f}", f"{r['formula_bytes'] / _MIB:,.1f}",
        f"{r['model_state_bytes'] / r['formula_bytes']:.2f}x",
        f"{r['comm_bytes'] / _MIB:,.1f}", f"{r['comm_zero_volume_psi']:.2f}", loss,
    ]  # fmt: skip


_HEADER = [
    "system", "stage", "median s/step", "min", "max", "vs one-process", "vs no-comm-x2", "vs DDP", "tokens/s",
    "peak RSS/rank MiB", "model states/rank MiB", "ZeRO formula MiB", "vs formula", "comm MiB/step",
    "comm volume (Ψ)", "final loss",
]  # fmt: skip


def table(result: dict) -> str:
    lines = ["| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(_row_cells(r)) + " |" for r in result["rows"]]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    m, s, load = result["model"], result["settings"], result["load_average"]
    numel = _numel(result)
    held_notes = [
        f"{r['system']} holds {r['model_state_held_bytes'] / _MIB:,.0f} MiB of which "
        f"{r['model_state_bytes'] / _MIB:,.1f} MiB resident"
        for r in result["rows"]
        if r["status"] == "ok" and r["model_state_held_bytes"] > 1.5 * r["model_state_bytes"]
    ]
    notes = [
        f"# {m['name']} ({m['kind']}, {numel / 1e6:.2f}M parameters)",
        "",
        f"vocab {m['vocab']}, d {m['dim']}, {m['layers']} layers, seq {m['seq']}; micro-batch {s['micro_batch']}"
        f" per rank; fp32, torch AdamW ({s['adam']}); {_clipping(s)}; 2 ranks x 1 thread on Gloo/loopback, one-process = 1 "
        f"process doing one rank's work. {s['rounds']} rounds x {s['steps']} measured steps after "
        f"{s['warmup']} warm-up, interleaved; engines' reduce_bucket_size "
        f"{s.get('reduce_bucket_size') or 'default'}; load average (1 min) during the run "
        f"{load['min']:.2f}-{load['max']:.2f} (our own 2 ranks make ~2); other processes used "
        f"{_others(result)} cores just before the jobs; wall {result['wall_s'] / 60:.1f} min.",
        "",
        table(result),
        "",
        f"Rounds used per system (quiet / run): {_rounds(result)}. "
        "Step times: the slowest rank's, over all measured steps of the quiet rounds (other processes "
        "under 0.25 cores during the timed steps; all rounds when none was quiet). Model states: params + grads"
        " + optimizer state + the system's buffers, resident bytes, counted at the end of a backward; "
        "formula: fp32 Adam, 16Ψ / (8+8/N)Ψ / (4+12/N)Ψ / 16Ψ/N at stages 0/1/2/3 (DDP adds its 4Ψ C++ "
        "buckets). Comm volume in units of Ψ fp32 parameters, all-reduce counted twice (ZeRO paper: 2Ψ for "
        "stages 0-2, 3Ψ for stage 3). ≠ marks a final loss that differs from one-process's.",
    ]
    paired = _paired_to_floor(result)
    if paired:
        notes += ["", "Per round, against no-comm-x2 of the same round (all rounds, median [min-max]): "
                  + "; ".join(paired) + "."]  # fmt: skip
    if held_notes:
        notes += ["", "Allocated but untouched buffers: " + "; ".join(held_notes) + "."]
    return "\n".join(notes) + "\n"


def _rounds(result: dict) -> str:
    return ", ".join(f"{r['system']} {r['rounds_used']}/{r['rounds_run']}" for r in _done(result))


def _others(result: dict) -> str:
    busy = [b for r in result["rows"] for b in r.get("others_busy_cores", [])]
    return f"{min(busy):.2f}-{max(busy):.2f}" if busy else "?"


def _numel(result: dict) -> int:
    return result.get("numel") or 0


def _done(result: dict) -> list[dict]:
    return [r for r in result["rows"] if r["status"] == "ok"]


def plot_step_times(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = _done(result)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    names = [r["system"] for r in rows][::-1]
    med = [r["median_s"] for r in rows][::-1]
    err = [[r["median_s"] - r["min_s"] for r in rows][::-1], [r["max_s"] - r["median_s"] for r in rows][::-1]]
    ax.barh(names, med, xerr=err, color=[_COLORS[r["family"]] for r in rows][::-1], capsize=3)
    ref = next((r["median_s"] for r in rows if r["system"] == "one-process"), None)
    if ref:
        ax.axvline(ref, color="k", linestyle="--", linewidth=1, label="one-process (compute limit)")
        ax.legend(loc="lower right")
    ax.set_xlabel("seconds per step (median, min-max)")
    ax.set_title(f"{result['model']['name']}: step time by system")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = _done(result)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["model_state_bytes"] / _MIB for r in rows], 0.4, label="model states (counted)",
           color=[_COLORS[r["family"]] for r in rows])  # fmt: skip
    ax.bar([i + 0.2 for i in x], [r["peak_rss_bytes"] / _MIB for r in rows], 0.4, label="peak RSS",
           color="#cccccc")  # fmt: skip
    ax.scatter(list(x), [r["formula_bytes"] / _MIB for r in rows], marker="_", s=400, color="k", zorder=3,
               label="ZeRO formula")  # fmt: skip
    ax.set_xticks(list(x), [r["system"] for r in rows], rotation=40, ha="right")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"{result['model']['name']}: memory per rank against the ZeRO formula")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(results: list[dict], path: Path) -> None:
    """Step time relative to one-process, per system, against model size (one point per results file)."""
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = {}
    for result in results:
        numel = _numel(result)
        for r in _done(result):
            if r.get("vs_one_process") is not None:
                series.setdefault(r["system"], []).append((numel / 1e6, r["vs_one_process"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("step time / one-process step time")
    ax.set_title("scaling with model size")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(readme: Path, result: dict) -> None:
    """Replace the table between `<!-- results:<model> -->` markers in the README, if it has them."""
    name = result["model"]["name"]
    if not readme.exists():
        return
    text = readme.read_text()
    begin, end = f"<!-- results:{name} -->", f"<!-- /results:{name} -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if pattern.search(text):
        readme.write_text(pattern.sub(lambda _: f"{begin}\n{table(result)}\n{end}", text))


def _paired_to_floor(result: dict) -> list[str]:
    """Each row's round medians over the floor's in the same round: interleaving makes the rounds pairs, so
    these ratios cancel slow drifts of a shared machine that pooled medians keep."""
    rows = {r["system"]: r for r in result["rows"] if r["status"] == "ok"}
    floor = rows.get("no-comm-x2")
    if floor is None:
        return []
    out = []
    for name, r in rows.items():
        if name == "no-comm-x2":
            continue
        ratios = sorted(a / b for a, b in zip(r["round_medians"], floor["round_medians"]))
        median = statistics.median(ratios)
        out.append(f"{name} {median:.3f}x [{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    return out


def _clipping(settings: dict) -> str:
    clip = settings.get("max_grad_norm", 0.0)
    return f"gradient clipping at norm {clip:g} in every system" if clip else "no gradient clipping"


def write_all(result: dict, out_dir: Path, plots: bool = True, name: str | None = None) -> list[Path]:
    """Write `<name>.json`, `<name>.md` and the PNGs into `out_dir` (`name`: the model's by default); returns
    the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or result["model"]["name"]
    written = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    written[0].write_text(json.dumps(result, indent=1))
    written[1].write_text(markdown(result))
    if plots and _done(result):
        written += [out_dir / f"{name}_step_time.png", out_dir / f"{name}_memory.png"]
        plot_step_times(result, written[2])
        plot_memory(result, written[3])
        # one run per size: a file named after its model (not a variant such as small_clip.json)
        others = [(p.stem, json.loads(p.read_text())) for p in sorted(out_dir.glob("*.json"))]
        others = [
            o
            for stem, o in others
            if isinstance(o, dict)  # zero_memory.json is a list of rows, not a speed run
            and o.get("model", {}).get("kind") == "gpt"
            and o["model"]["name"] != "tiny"
            and o["model"]["name"] == stem
        ]
        if len(others) >= 2:
            written.append(out_dir / "scaling.png")
            plot_scaling(others, written[-1])
    return written
