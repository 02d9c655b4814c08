"""Inference speed: shardspeed's init_inference next to Hugging Face `generate` and DeepSpeed's init_inference.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/benchvenv/bin/python benchmarks/inference.py --parts generate tp
    python benchmarks/inference.py --parts server        # an environment with the serve extra

Needs transformers (and DeepSpeed for its column; `pip install 'shardspeed[bench,serve]'`). The parts, each
one interleaved run (the systems take turns every round; medians and min/max over rounds):

0. public (`--parts public`): DeepSpeed's usual call, `init_inference(model, dtype=torch.float32,
   replace_with_kernel_inject=False).generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)`
   (through the `deepspeed` alias where installed), prompt 64, batch 1 and 8, against the same model's HF
   `generate`; records which decode path ran and whether any call was handed to the model's own generate.
1. generate: a 7.3M-parameter Llama (4 layers, hidden 256, vocab 8192; random weights), prompt 32 tokens,
   greedy, 64 new tokens (stop token disabled so every system makes all 64), 1 thread. Tokens/s of the whole
   `generate` call at batch 1 and 8 on the wall clock (the headline), and time to first token
   (`max_new_tokens=1`) at batch 1; tokens per CPU-second of the process beside them.
2. tensor parallel: shardspeed at tp 1 (one rank, one thread) and tp 2 (two ranks, one thread each) on the
   same model at batch 32, launched with torchrun; DeepSpeed's tp 2 is tried once and its outcome recorded.
3. server: `shardspeed-serve` (1 thread) on the same model saved to disk; 32 requests of 64 tokens sent one
   after another, then by 1, 8 and 32 concurrent clients; completion tokens/s over the wall time.
Prefix caching has its own script: benchmarks/prefix_cache.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

NEW_TOKENS, PROMPT = 64, 32


def llama(seed: int = 0, vocab: int = 8192):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def _systems(with_deepspeed: bool) -> dict:
    import shardspeed

    systems = {"hf_generate": llama().generate}
    systems["shardspeed"] = shardspeed.init_inference(
        llama(), dtype=torch.float32, max_out_tokens=256
    ).generate
    if with_deepspeed:
        for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29655", RANK="0", WORLD_SIZE="1",
                               LOCAL_RANK="0").items():  # fmt: skip
            os.environ.setdefault(key, value)
        import deepspeed

        engine = deepspeed.init_inference(llama(), dtype=torch.float32, replace_with_kernel_inject=False)
        systems["deepspeed"] = engine.generate
    return systems


def _time(fn, ids, new_tokens: int, clock=time.perf_counter) -> float:
    start = clock()
    out = fn(ids, max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    elapsed = clock() - start
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return elapsed


def _measure(fn, ids, new_tokens: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call. With one thread, CPU time is the work
    itself, unaffected by the time other processes on a shared machine hold the core."""
    wall, cpu = time.perf_counter(), time.process_time()
    _time(fn, ids, new_tokens)
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_generate(rounds: int, with_deepspeed: bool) -> dict:
    torch.set_num_threads(1)
    systems = _systems(with_deepspeed)
    outputs = {}
    ids1 = torch.randint(1, 8192, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ids8 = torch.randint(1, 8192, (8, PROMPT), generator=torch.Generator().manual_seed(2))
    for name, fn in systems.items():  # warm-up, and the greedy tokens must agree
        outputs[name] = fn(ids1, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids1))
    same = {name: bool(torch.equal(out, outputs["hf_generate"])) for name, out in outputs.items()}
    keys = ("tps_b1", "tps_b8", "ttft_ms", "cpu_tps_b1", "cpu_tps_b8", "cpu_ttft_ms")
    samples = {name: {key: [] for key in keys} for name in systems}
    for _ in range(rounds):
        for name, fn in systems.items():
            for key, ids, new, scale in (("tps_b1", ids1, NEW_TOKENS, None), ("tps_b8", ids8, NEW_TOKENS, None),
                                         ("ttft_ms", ids1, 1, 1000.0)):  # fmt: skip
                wall, cpu = _measure(fn, ids, new)
                if scale is None:  # tokens per second
                    samples[name][key].append(ids.shape[0] * new / wall)
                    samples[name]["cpu_" + key].append(ids.shape[0] * new / cpu)
                else:  # milliseconds
                    samples[name][key].append(scale * wall)
                    samples[name]["cpu_" + key].append(scale * cpu)
    return {"same_tokens_as_hf": same, "samples": samples}


# ---- the public call as a DeepSpeed user writes it --------------------------------------------------------
PUBLIC_PROMPT = 64


def _public_engine():
    """`deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)` through the
    alias where it is installed (the same function as shardspeed.init_inference), and whether `generate`
    then stays on the fast decode path (the engine logs when it hands a call to the model's own generate)."""
    import logging

    import shardspeed

    try:
        import deepspeed

        init, through = deepspeed.init_inference, "deepspeed (alias)"
        if init is not shardspeed.init_inference:  # the real DeepSpeed: not the system measured here
            init, through = shardspeed.init_inference, "shardspeed"
    except ImportError:
        init, through = shardspeed.init_inference, "shardspeed"
    engine = init(llama(), dtype=torch.float32, replace_with_kernel_inject=False)
    handed_over = []

    class Watch(logging.Handler):
        def emit(self, record):
            if "not handled by the fast path" in record.getMessage():
                handed_over.append(record.getMessage())

    logger = logging.getLogger("shardspeed.inference.engine")
    logger.addHandler(Watch())
    logger.setLevel(logging.INFO)
    return engine, {"through": through, "decoder": type(engine.decoder).__name__, "handed_over": handed_over}


def bench_public(rounds: int) -> dict:
    """HF `generate` against the engine's `generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)`,
    batch 1 and 8, prompt 64: per round the median of 3 calls of each, the systems alternating their order."""
    torch.set_num_threads(1)
    engine, route = _public_engine()
    systems = {"hf_generate": llama().generate, "shardspeed": engine.generate}
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    ids = {
        b: torch.randint(1, 8192, (b, PUBLIC_PROMPT), generator=torch.Generator().manual_seed(b))
        for b in (1, 8)
    }
    same = {
        b: bool(torch.equal(*(fn(ids[b], **kwargs) for fn in systems.values()))) for b in ids
    }  # and warm-up
    samples = {name: {f"{kind}_b{b}": [] for kind in ("wall", "cpu") for b in ids} for name in systems}
    for r in range(rounds):
        for b in ids:
            for name in list(systems)[:: 1 if r % 2 == 0 else -1]:
                walls, cpus = [], []
                for _ in range(3):
                    wall, cpu = time.perf_counter(), time.process_time()
                    out = systems[name](ids[b], **kwargs)
                    walls.append(time.perf_counter() - wall)
                    cpus.append(time.process_time() - cpu)
                    assert out.shape == (b, PUBLIC_PROMPT + NEW_TOKENS), out.shape
                samples[name][f"wall_b{b}"].append(b * NEW_TOKENS / statistics.median(walls))
                samples[name][f"cpu_b{b}"].append(b * NEW_TOKENS / statistics.median(cpus))
    return {"route": {**route, "handed_over": len(route["handed_over"])}, "same_tokens_as_hf": same,
            "samples": samples}  # fmt: skip


def _render_public(public: dict) -> list[str]:
    s, route = public["samples"], public["route"]
    lines = ["## the public call (7.3M Llama, prompt 64, 64 new tokens, greedy, pad_token_id=0, 1 thread)", "",
             f"`init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False)` through {route['through']}:"
             f" decoder {route['decoder']}, calls handed to the model's own generate: {route['handed_over']}; "
             f"greedy tokens equal to HF's: {public['same_tokens_as_hf']}. Per round the median of 3 calls.", "",
             "| system | tokens/s b1 (wall) | tokens/s b8 (wall) | tokens/CPU-s b1 | tokens/CPU-s b8 |", "|---|---|---|---|---|"]  # fmt: skip
    for name, v in s.items():
        lines.append(f"| {name} | {_stat(v['wall_b1'])} | {_stat(v['wall_b8'])} | {_stat(v['cpu_b1'])} | "
                     f"{_stat(v['cpu_b8'])} |")  # fmt: skip
    lines.append("")
    for key, what in (("wall_b1", "batch 1, wall"), ("wall_b8", "batch 8, wall"), ("cpu_b1", "batch 1, CPU"),
                      ("cpu_b8", "batch 8, CPU")):  # fmt: skip
        paired = [a / b for a, b in zip(s["shardspeed"][key], s["hf_generate"][key])]
        lines.append(f"- shardspeed / hf_generate, {what}: paired per round median {statistics.median(paired):.2f}x "
                     f"({min(paired):.2f}-{max(paired):.2f}, {len(paired)} rounds)")  # fmt: skip
    return lines + [""]


# ---- tensor parallel (torchrun workers) -----------------------------------------------------------------
def tp_worker(out: str, rounds: int, system: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    ids = torch.randint(1, 8192, (32, PROMPT), generator=torch.Generator().manual_seed(3))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if system == "deepspeed":
        import deepspeed

        engine = deepspeed.init_inference(llama(), dtype=torch.float32, tensor_parallel={"tp_size": world})
    else:
        import shardspeed

        engine = shardspeed.init_inference(llama(), dtype=torch.float32, tensor_parallel={"tp_size": world},
                                           max_out_tokens=256)  # fmt: skip
    engine.generate(ids[:, :8], max_new_tokens=4)
    rates = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        rates.append(32 * NEW_TOKENS / _time(engine.generate, ids, NEW_TOKENS))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(rates))


def _torchrun(ranks: int, system: str, rounds: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rates.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(29700 + ranks), __file__, "--tp-worker", out, "--rounds", str(rounds), "--system", system]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", SHARDSPEED_ACCELERATOR="cpu")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return {"error": f"exit code {proc.returncode}", "tail": tail}
        return {"rates": json.loads(Path(out).read_text())}


def bench_tp(rounds: int, with_deepspeed: bool) -> dict:
    results = {"shardspeed_tp1": [], "shardspeed_tp2": []}
    for _ in range(rounds):  # interleaved: one launch per system per round
        for name, ranks in (("shardspeed_tp1", 1), ("shardspeed_tp2", 2)):
            run = _torchrun(ranks, "shardspeed", 1, 600)
            if "error" in run:
                raise RuntimeError(f"{name}: {run}")
            results[name] += run["rates"]
    if with_deepspeed:
        results["deepspeed_tp2"] = _torchrun(2, "deepspeed", 1, 300)
    return results


# ---- server ---------------------------------------------------------------------------------------------
def _save_model(path: Path, vocab: int = 8192) -> None:
    from shardspeed.mii.tokenizer import byte_tokenizer

    model = llama(vocab=vocab)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


async def _clients(base: str, total: int, concurrency: int) -> tuple[float, int]:
    import httpx

    queue = list(range(total))
    tokens = 0

    async def worker(http):
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = {"prompt": f"request {i} " + "x" * (8 + i % 24), "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            response = await http.post("/v1/completions", json=body)
            tokens += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        return time.perf_counter() - start, tokens


def _server_command(path: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardspeed.mii.server", str(path), "--port", str(port), "--max-batch", "32",
            "--log-level", "warning", *extra]  # fmt: skip


def bench_server(rounds: int, port: int) -> dict:
    from shardspeed.mii.client import _wait_ready

    results = {f"clients_{c}": [] for c in (1, 8, 32)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-7m"
        _save_model(path)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        process = subprocess.Popen(_server_command(path, port), env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, process, 300)
            asyncio.run(_clients(base, 4, 4))  # warm-up
            for _ in range(rounds):
                for concurrency in (1, 8, 32):
                    wall, tokens = asyncio.run(_clients(base, 32, concurrency))
                    assert tokens == 32 * NEW_TOKENS, tokens
                    results[f"clients_{concurrency}"].append(tokens / wall)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return results


# ---- report ---------------------------------------------------------------------------------------------
def _stat(values) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def render(result: dict) -> str:
    lines = [
        "# Inference: shardspeed init_inference vs Hugging Face generate vs DeepSpeed init_inference",
        "",
    ]
    lines += [result["note"], ""]
    renderers = (("generate", _render_generate), ("public", _render_public), ("tp", _render_tp),
                 ("server", _render_server))  # fmt: skip
    for part, renderer in renderers:
        if result.get(part):
            section = renderer(result[part])
            run = result[part].get("run")
            if run:
                section[1:1] = [
                    "",
                    f"Run: load average {run['load_average_at_start']} at the start, {run['rounds']} rounds.",
                ]
            lines += section
    return "\n".join(lines) + "\n"


def _render_generate(gen: dict) -> list[str]:
    lines = []
    if gen:
        s = gen["samples"]
        lines += ["## generate (7.3M Llama, prompt 32, 64 new tokens, greedy, 1 thread)", "",
                  "| system | tokens/s batch 1 | tokens/s batch 8 | TTFT batch 1 (ms) | greedy tokens = HF |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for name, v in s.items():
            same = gen["same_tokens_as_hf"][name]
            lines.append(
                f"| {name} | {_stat(v['tps_b1'])} | {_stat(v['tps_b8'])} | {_stat(v['ttft_ms'])} | {same} |"
            )
        lines += ["", "Per CPU-second of the process (1 thread: the work itself, whatever else runs on the machine):",
                  "", "| system | tokens/CPU-s batch 1 | tokens/CPU-s batch 8 | TTFT CPU ms batch 1 |", "|---|---|---|---|"]  # fmt: skip
        for name, v in s.items():
            if "cpu_tps_b1" in v:
                lines.append(
                    f"| {name} | {_stat(v['cpu_tps_b1'])} | {_stat(v['cpu_tps_b8'])} | {_stat(v['cpu_ttft_ms'])} |"
                )
        hf = s["hf_generate"]
        for name in s:
            if name == "hf_generate":
                continue
            for prefix, what in (("", "wall"), ("cpu_", "CPU")):
                if prefix + "tps_b1" not in s[name]:
                    continue
                r1 = statistics.median(s[name][prefix + "tps_b1"]) / statistics.median(hf[prefix + "tps_b1"])
                r8 = statistics.median(s[name][prefix + "tps_b8"]) / statistics.median(hf[prefix + "tps_b8"])
                rt = statistics.median(hf[prefix + "ttft_ms"]) / statistics.median(
                    s[name][prefix + "ttft_ms"]
                )
                lines.append(f"\n{name} / hf_generate ({what} time): {r1:.2f}x tokens/s at batch 1, {r8:.2f}x at "
                             f"batch 8, {rt:.2f}x faster first token")  # fmt: skip
                # The same ratio taken within each round (the two ran back to back, under the same load),
                # then the median over rounds: steadier than a ratio of medians on a machine whose load drifts.
                paired = [a / b for a, b in zip(s[name][prefix + "tps_b1"], hf[prefix + "tps_b1"])]
                lines.append(f"  paired per round, batch 1: median {statistics.median(paired):.2f}x "
                             f"({min(paired):.2f}-{max(paired):.2f})")  # fmt: skip
        lines.append("")
    return lines


def _render_tp(tp: dict) -> list[str]:
    lines = []
    if tp:
        lines += ["## tensor parallel (batch 32, 64 new tokens, 1 thread per rank, 2 cores)", "",
                  "| system | tokens/s |", "|---|---|"]  # fmt: skip
        for name in ("shardspeed_tp1", "shardspeed_tp2"):
            lines.append(f"| {name} | {_stat(tp[name])} |")
        ratio = statistics.median(tp["shardspeed_tp2"]) / statistics.median(tp["shardspeed_tp1"])
        lines.append(f"\ntp 2 / tp 1: {ratio:.2f}x")
        if "deepspeed_tp2" in tp:
            lines.append(f"\nDeepSpeed 0.19.8 init_inference tp 2 on CPU: {json.dumps(tp['deepspeed_tp2'])}")
        lines.append("")
    return lines


def _render_server(server: dict) -> list[str]:
    lines = []
    if server:
        lines += ["## server (shardspeed-serve, 1 thread; 32 requests x 64 tokens; completion tokens/s)", "",
                  "| concurrent clients | tokens/s |", "|---|---|"]  # fmt: skip
        for c in (1, 8, 32):
            lines.append(f"| {c} | {_stat(server[f'clients_{c}'])} |")
        ratio = statistics.median(server["clients_32"]) / statistics.median(server["clients_1"])
        lines.append(f"\n32 concurrent / one after another: {ratio:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["generate", "tp", "server"])
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the .md from the .json, run nothing"
    )
    parser.add_argument("--port", type=int, default=28571)
    parser.add_argument("--tp-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--system", default="shardspeed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp_worker:
        tp_worker(args.tp_worker, args.rounds, args.system)
        return
    with_ds = not args.no_deepspeed
    out = Path(args.out)
    previous = out / "inference.json"
    result = json.loads(previous.read_text()) if previous.exists() else {}  # parts run from two venvs merge
    if args.render_only:
        (out / "inference.md").write_text(render(result))
        return
    result["note"] = (
        "Shared 2-core CPU machine, loaded by other jobs: wall-clock figures are noisy (each part says the "
        "load average when it started). Medians over interleaved rounds, (min-max) in brackets."
    )
    parts = {"generate": lambda: bench_generate(args.rounds, with_ds), "tp": lambda: bench_tp(args.rounds, with_ds),
             "public": lambda: bench_public(args.rounds),
             "server": lambda: bench_server(args.rounds, args.port)}  # fmt: skip
    for part in args.parts:
        load = os.getloadavg()[0]
        result[part] = parts[part]()
        result[part]["run"] = {"load_average_at_start": round(load, 1), "rounds": args.rounds}
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference.json").write_text(json.dumps(result, indent=1))
    (out / "inference.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
