"""The flops profiler's printed report, laid out as DeepSpeed's: a summary, the top modules per depth,
and the module tree with params, MACs, latency and FLOP/s per module."""

from __future__ import annotations

__all__ = ["format_profile", "number_to_string"]

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(value: float, unit: str = "", precision: int = 2) -> str:
    """`3.14 G` style: the largest SI prefix that keeps the number at or above 1."""
    for scale, prefix in _PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{precision}f} {prefix}{unit}".rstrip()
    return f"{value:.{precision}f} {unit}".rstrip()


def _rate(flops: float, seconds: float) -> str:
    return number_to_string(flops / seconds, "FLOPS") if seconds > 0 else "0 FLOPS"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0.00%"


def _walk(module, name: str, depth: int):
    yield name, module, depth
    for child_name, child in module.named_children():
        yield from _walk(child, child_name, depth + 1)


def _summary(profiler, profile_step: int) -> list[str]:
    total = profiler.module_profile(profiler.model)
    engine = profiler.ds_engine
    lines = [f"Profile Summary at step {profile_step}:"]
    rows = []
    if engine is not None:
        rows += [("world size", engine.world_size), ("data parallel size", engine.world_size),
                 ("batch size per GPU", engine.train_micro_batch_size_per_gpu())]  # fmt: skip
    rows += [
        ("params per GPU", number_to_string(total["params"], "")),
        ("fwd MACs per GPU", number_to_string(total["macs"], "MACs")),
        ("fwd flops per GPU", number_to_string(total["flops"])),
        ("fwd latency", f"{1000 * total['latency']:.2f} ms"),
        ("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", _rate(total["flops"], total["latency"])),
    ]
    timers = getattr(engine, "timers", None)
    if timers is not None and timers.enabled:
        backward = timers.last.get("backward", 0.0)
        step = timers.last.get("step", 0.0)
        factor = 2 + profiler.recompute_fwd_factor
        rows += [
            ("bwd latency", f"{1000 * backward:.2f} ms"),
            (f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency", _rate(factor * total["flops"], backward)),
            ("step latency", f"{1000 * step:.2f} ms"),
            ("iter latency", f"{1000 * (total['latency'] + backward + step):.2f} ms"),
        ]  # fmt: skip
    width = max(len(k) for k, _ in rows) + 2
    return lines + [f"{k + ':':<{width}} {v}" for k, v in rows]


def _aggregated(profiler, module_depth: int, top_modules: int) -> list[str]:
    by_depth: dict[int, list] = {}
    for _, module, depth in _walk(profiler.model, type(profiler.model).__name__, 0):
        by_depth.setdefault(depth, []).append(module)
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in sorted(by_depth):
        if 0 <= module_depth < depth:
            break
        stats: dict[str, dict[str, float]] = {}
        for module in by_depth[depth]:  # modules of one class at one depth are added up, as DeepSpeed does
            p = profiler.module_profile(module)
            agg = stats.setdefault(type(module).__name__, {"params": 0, "macs": 0, "latency": 0.0})
            for key in agg:
                agg[key] += p[key]

        def top(key, fmt, stats=stats):
            best = sorted(stats.items(), key=lambda kv: kv[1][key], reverse=True)[:top_modules]
            return {name: fmt(v[key]) for name, v in best}

        lines += [
            f"depth {depth}:",
            f"    params      - {top('params', lambda v: number_to_string(v, ''))}",
            f"    MACs        - {top('macs', lambda v: number_to_string(v, 'MACs'))}",
            f"    fwd latency - {top('latency', lambda v: f'{1000 * v:.2f} ms')}",
        ]
    return lines


def _detailed(profiler, module_depth: int) -> list[str]:
    total = profiler.module_profile(profiler.model)
    lines = [
        "Each module profile is listed after its name in the following order:",
        "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of "
        "total fwd latency, fwd FLOPS",
        "",
    ]
    for name, module, depth in _walk(profiler.model, "", 0):
        if 0 <= module_depth < depth:
            continue
        p = profiler.module_profile(module)
        label = f"({name}): " if name else ""
        lines.append(
            "  " * depth + f"{label}{type(module).__name__}("
            f"{number_to_string(p['params'], '')} = {_pct(p['params'], total['params'])} Params, "
            f"{number_to_string(p['macs'], 'MACs')} = {_pct(p['macs'], total['macs'])} MACs, "
            f"{1000 * p['latency']:.2f} ms = {_pct(p['latency'], total['latency'])} latency, "
            f"{_rate(p['flops'], p['latency'])})"
        )
    return lines


def format_profile(profiler, profile_step: int, module_depth: int, top_modules: int, detailed: bool) -> str:
    rule = "-" * 30
    lines = [f"\n{rule} Flops Profiler {rule}"]
    lines += _summary(profiler, profile_step)
    lines += ["", f"{rule} Aggregated Profile per GPU {rule}"]
    lines += _aggregated(profiler, module_depth, top_modules)
    if detailed:
        lines += ["", f"{rule} Detailed Profile per GPU {rule}"]
        lines += _detailed(profiler, module_depth)
    lines.append("-" * 80)
    return "\n".join(lines)
