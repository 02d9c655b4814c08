"""What benchmarks/evoformer.py measures, one case at a time (run in spawned processes on the CPU).

A case is forward + backward of Evoformer attention on Q, K, V [1, n_seq, n_res, heads, dim] with a mask
bias and a pair bias, every input requiring grad, by one system:

- plain: the reference (shardspeed.ops.deepspeed4science.reference): whole logits, softmax, autograd;
- ours: DS4Sci_EvoformerAttention with its defaults ("auto": the math kernel on CPU, SDPA on CUDA);
- ours-math: DS4Sci_EvoformerAttention(backend="math") (CUDA runs; on the CPU it is "ours");
- sdpa: torch's scaled_dot_product_attention over all sequences at once, mask + pair as one float mask
  that requires grad (CUDA runs: its memory-efficient kernel; on the CPU it would fall back to the math
  path, i.e. the plain reference).

Memory on the CPU, per case in a fresh process: one warm-up step, its gradients dropped (the baseline
holds the inputs only; the measured step's output and input gradients count), then
- rss: VmHWM reset to the current RSS (`echo 5 > /proc/self/clear_refs`), one step, VmHWM minus the RSS
  before it. glibc is told to serve allocations over 64 KiB by mmap (MALLOC_MMAP_THRESHOLD_, set by the
  parent), so a freed tensor leaves RSS at once and the figure is the high-water mark of live tensors;
- tracked: the CPU allocator's own events as torch.profiler records them (profile_memory=True), replayed in
  order: the exact peak of bytes live at once, the same on every run.
On CUDA, torch.cuda.max_memory_allocated() over one step after reset_peak_memory_stats().
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

BATCH = 1


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def attention(system: str):
    from shardspeed.ops.deepspeed4science import DS4Sci_EvoformerAttention
    from shardspeed.ops.deepspeed4science.reference import evoformer_attention_reference

    if system == "plain":
        return lambda q, k, v, mask, pair: evoformer_attention_reference(q, k, v, [mask, pair])
    if system == "ours":
        return lambda q, k, v, mask, pair: DS4Sci_EvoformerAttention(q, k, v, [mask, pair])
    if system == "ours-math":
        return lambda q, k, v, mask, pair: DS4Sci_EvoformerAttention(q, k, v, [mask, pair], backend="math")
    if system == "sdpa":
        return _sdpa_whole
    raise ValueError(f"unknown system {system!r}")


def _sdpa_whole(q, k, v, mask, pair):
    batch, n_seq = q.shape[:2]
    heads_first = [t.transpose(2, 3).flatten(0, 1) for t in (q, k, v)]  # [B*S, H, R, D]
    bias = (mask + pair).flatten(0, 1)  # [B*S, H, R, R]: the whole logits-sized mask, as a user would pass it
    out = torch.nn.functional.scaled_dot_product_attention(*heads_first, attn_mask=bias)
    return out.unflatten(0, (batch, n_seq)).transpose(2, 3)


def make_inputs(n_seq: int, n_res: int, heads: int, dim: int, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, n_seq, n_res, heads, dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    mask = (torch.rand(BATCH, n_seq, 1, 1, n_res, generator=g) < 0.9).float().sub(1).mul(1e9)
    pair = torch.randn(BATCH, 1, heads, n_res, n_res, generator=g)
    grad_out = torch.randn(shape, generator=g)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, mask, pair)]
    return leaves, grad_out.to(device=device, dtype=dtype)


def step(fn, leaves, grad_out) -> None:
    for t in leaves:
        t.grad = None
    fn(*leaves).backward(grad_out)


def tracked_peak_bytes(run) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def cpu_memory(case: dict, queue) -> None:
    """Child: peak memory of one forward + backward of `case["system"]` (see the module docstring)."""
    torch.set_num_threads(case["threads"])
    leaves, grad_out = make_inputs(
        case["n_seq"], case["n_res"], case["heads"], case["dim"], torch.float32, "cpu"
    )
    fn = attention(case["system"])
    step(fn, leaves, grad_out)
    for t in leaves:  # the measured step's input gradients count, as in the tracked figure
        t.grad = None
    baseline = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    step(fn, leaves, grad_out)
    rss = (status_kib("VmHWM") - baseline) / 1024
    tracked = tracked_peak_bytes(lambda: step(fn, leaves, grad_out)) / 2**20
    queue.put({"rss_mib": rss, "tracked_mib": tracked})


def time_systems(case: dict, systems: list[str], device: str, dtype, sync, make_fn=None) -> dict:
    """Seconds per forward + backward of each system, interleaved: every round runs each system once (order
    alternating), so load on the machine hits all of them alike."""
    leaves, grad_out = make_inputs(case["n_seq"], case["n_res"], case["heads"], case["dim"], dtype, device)
    fns = {name: (make_fn or attention)(name) for name in systems}
    for fn in fns.values():
        step(fn, leaves, grad_out)  # warm-up
    times = {name: [] for name in systems}
    for round_index in range(case["rounds"]):
        order = systems if round_index % 2 == 0 else systems[::-1]
        for name in order:
            sync()
            start = time.perf_counter()
            step(fns[name], leaves, grad_out)
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def cpu_timing(case: dict, queue) -> None:
    torch.set_num_threads(case["threads"])
    queue.put(time_systems(case, case["systems"], "cpu", torch.float32, lambda: None))


def block_step_memory(case: dict, queue) -> None:
    """Child: peak RSS (as cpu_memory) of forward + backward of one block of examples/evoformer/model.py
    on a batch of one MSA [n_seq, n_res], fp32."""
    import importlib.util

    torch.set_num_threads(case["threads"])
    path = Path(__file__).resolve().parents[1] / "examples/evoformer/model.py"
    spec = importlib.util.spec_from_file_location("evoformer_example_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Evoformer(blocks=1, attention=case["attention"], **case["model"])
    sample = module.SyntheticMSA(size=1, n_seq=case["n_seq"], n_res=case["n_res"])[0]
    batch = {key: value.unsqueeze(0) for key, value in sample.items()}

    def train_step():
        model.zero_grad(set_to_none=True)
        model(batch).backward()

    train_step()
    model.zero_grad(set_to_none=True)
    baseline = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    start = time.perf_counter()
    train_step()
    seconds = time.perf_counter() - start
    queue.put({"rss_mib": (status_kib("VmHWM") - baseline) / 1024, "seconds": seconds})


def logits_mib(n_seq: int, n_res: int, heads: int, itemsize: int = 4) -> float:
    """Bytes of one whole [1, n_seq, heads, n_res, n_res] logits tensor, in MiB."""
    return BATCH * n_seq * heads * n_res * n_res * itemsize / 2**20


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def finite(x: float) -> bool:
    return not (math.isnan(x) or math.isinf(x))
