"""Prefix caching in ``shardspeed-serve``: time to first token with it and without it, servers side by side.

    python benchmarks/prefix_cache.py                       # the README's demo model, 9 rounds
    python benchmarks/prefix_cache.py --model-dir runs/tiny-llama --rounds 5
    python benchmarks/prefix_cache.py --arch 7m             # the 7.3M model of benchmarks/inference.py

Model (``--arch demo``, the default): the architecture examples/train_to_serve.py trains and the README serves
(``runs/tiny-llama``: Llama, hidden 128, 4 layers, 4 heads / 2 key-value heads, the byte vocabulary of 257,
context 512; 0.75M parameters), with random weights unless ``--model-dir`` names a trained one: the time does
not depend on the weights' values, as every answer has its 32 tokens (``ignore_eos``). ``--arch 7m``: hidden
256, 8 heads, intermediate 688 (7.3M parameters with its 8192-token vocabulary; here the byte vocabulary).

Load: two ``shardspeed-serve`` processes on 127.0.0.1 with one thread each, the same model, one with prefix
caching and one with ``--no-prefix-caching``. Each round sends ``--clients`` (32) streaming chat requests at
once to one server, then the same requests to the other (which goes first alternates every round): a shared
system prompt of 256 tokens (bytes) and a question of each client's own, new every round; greedy, 32 new
tokens; logprobs on, so that every token has its chunk. Time to first token: from sending the request to
the first chunk carrying a token. Per round: the median over the clients for each server, and the ratio of
the two medians (without / with caching), which compares two runs made back to back under the same load.
Reported: the median, min and max over the rounds of each; round 0 warms both servers up and is not counted.
The answers with and without caching must be the same. Then the prefill alone, in this process without HTTP
(``engine_prefill``), for the same prompts: what caching saves before serving costs are added.

Bounded: ``--rounds`` rounds, each request under a 300 s timeout, the servers stopped (by their pids) at
the end; only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SYSTEM_PROMPT = ("You are a careful Python reviewer. Answer with one short line of code and nothing else. "
                 "Prefer the standard library; never import anything that is not needed; keep names short "
                 "and clear; follow PEP 8; do not explain; do not apologise; do not repeat the question. "
                 "Use f-strings, pathlib and type hints where they help.")[:256]  # fmt: skip
NEW_TOKENS = 32
ARCHS = {  # hidden, layers, heads, kv heads, intermediate
    "demo": (128, 4, 4, 2, 336),  # examples/train_to_serve.py's tiny_llama(128, 4, 128)
    "7m": (256, 4, 8, 8, 688),
}


def save_model(path: Path, arch: str) -> int:
    """A randomly initialised Llama of ``arch`` with the byte tokenizer, saved for the server; its size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardspeed.mii.tokenizer import END_OF_TEXT, byte_tokenizer

    hidden, layers, heads, kv_heads, intermediate = ARCHS[arch]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=END_OF_TEXT + 1, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, bos_token_id=None, eos_token_id=END_OF_TEXT,
                         pad_token_id=END_OF_TEXT, tie_word_embeddings=arch == "demo")  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(model_dir: Path, port: int, caching: bool, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "shardspeed.mii.server", str(model_dir), "--host", "127.0.0.1", "--port",
               str(port), "--max-batch", "32", "--log-level", "warning"]  # fmt: skip
    if not caching:
        command.append("--no-prefix-caching")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(command, env=env, stdout=log, stderr=log)


def _wait_ready(base: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on {base} exited with {process.returncode}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server on {base} was not ready within {timeout:.0f} s")


async def _clients(base: str, questions: list[str]) -> tuple[list[float], list[str]]:
    """The streaming chat requests, sent at once: (seconds to the first token, answer) for each."""
    import httpx

    async def one(http, question: str):
        body = {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True}  # fmt: skip
        start, first, text = time.perf_counter(), None, []
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if (choice.get("logprobs") or {}).get("content"):  # a chunk per token: the first is here
                    first = first or time.perf_counter() - start
                text.append(choice["delta"].get("content") or "")
        return first, "".join(text)

    limits = httpx.Limits(max_connections=len(questions) + 8)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        answers = await asyncio.gather(*(one(http, q) for q in questions))
    return [a[0] for a in answers], [a[1] for a in answers]


def _questions(round_index: int, clients: int) -> list[str]:
    return [f"Round {round_index}, task {i}: reverse a list of {i + 2} items." for i in range(clients)]


def engine_prefill(model_dir: Path, rounds: int, clients: int) -> dict:
    """The same chat prompts prefilled in this process, without HTTP: milliseconds of prefill per request with
    and without caching, each round's batch of ``clients`` prompts timed as one batcher step, alternating."""
    import torch

    from shardspeed.inference.generation import GenerationSettings
    from shardspeed.inference.scheduler import BatchRequest, ContinuousBatcher
    from shardspeed.mii.chat import chat_prompt_ids
    from shardspeed.mii.pipeline import load_model
    from shardspeed.mii.protocol import ChatMessage

    torch.set_num_threads(1)
    engine, tokenizer = load_model(str(model_dir))
    batchers = {mode: ContinuousBatcher(engine.decoder, max_len=engine.config.max_out_tokens, max_batch=clients,
                                        prefix_caching=mode == "on") for mode in ("on", "off")}  # fmt: skip
    result: dict = {"prefill_ms": {"on": [], "off": []}, "ratio": []}
    for round_index in range(rounds + 1):  # round 0 fills the cache (and warms up) and is not counted
        prompts = [chat_prompt_ids(tokenizer, [ChatMessage(role="system", content=SYSTEM_PROMPT),
                                               ChatMessage(role="user", content=question)])
                   for question in _questions(round_index, clients)]  # fmt: skip
        ms = {}
        for mode in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
            for ids in prompts:  # one new token each: the step prefills them all and they leave
                settings = GenerationSettings(max_new_tokens=1, ignore_eos=True)
                batchers[mode].submit(BatchRequest(ids, settings, emit=lambda token, reason: None))
            start = time.perf_counter()
            batchers[mode].step()
            ms[mode] = 1000 * (time.perf_counter() - start) / clients
        if round_index:
            for mode in ("on", "off"):
                result["prefill_ms"][mode].append(ms[mode])
            result["ratio"].append(ms["off"] / ms["on"])
    result["prompt_tokens"] = statistics.median(len(p) for p in prompts)
    return result


def run(model_dir: Path, rounds: int, clients: int) -> dict:
    ports = {"on": _free_port(), "off": _free_port()}
    result: dict = {"ttft_median_s": {"on": [], "off": []}, "ratio": [], "same_answers": True}
    with tempfile.NamedTemporaryFile("w", prefix="prefix-cache-servers-", suffix=".log", delete=False) as log:
        processes = {mode: _start(model_dir, port, mode == "on", log) for mode, port in ports.items()}
    try:
        for mode, port in ports.items():
            _wait_ready(f"http://127.0.0.1:{port}", processes[mode])
        for round_index in range(rounds + 1):  # round 0 warms both servers up and is not counted
            questions = _questions(round_index, clients)
            medians, answers = {}, {}
            for mode in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
                ttfts, answers[mode] = asyncio.run(_clients(f"http://127.0.0.1:{ports[mode]}", questions))
                medians[mode] = statistics.median(ttfts)
            result["same_answers"] &= answers["on"] == answers["off"]
            if round_index:
                for mode in ("on", "off"):
                    result["ttft_median_s"][mode].append(medians[mode])
                result["ratio"].append(medians["off"] / medians["on"])
                print(f"round {round_index}: median TTFT with caching {1000 * medians['on']:.0f} ms, without "
                      f"{1000 * medians['off']:.0f} ms, ratio {result['ratio'][-1]:.2f}", flush=True)  # fmt: skip
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return result


def _stat(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    low, mid, high = (
        f"{scale * v:.{digits}f}" for v in (min(values), statistics.median(values), max(values))
    )
    return f"{mid} ({low}-{high})"


def render(result: dict) -> str:
    on, off, ratio = result["ttft_median_s"]["on"], result["ttft_median_s"]["off"], result["ratio"]
    setup, engine = result["setup"], result["engine"]
    return "\n".join([
        "# Prefix caching: time to first token (benchmarks/prefix_cache.py)", "",
        f"Model: {setup['model']}. Load: {setup['clients']} streaming chat clients at once, a {setup['system_prompt_tokens']}-token "
        f"shared system prompt and a question of their own, greedy, {NEW_TOKENS} new tokens; two servers on 127.0.0.1 "
        f"(1 thread each, caching on / off) taking turns every round; {len(ratio)} rounds counted after a warm-up "
        f"round. Load average {setup['load_average_at_start']} at the start, {setup['load_average_at_end']} at the end "
        f"(2-core machine, shared).", "",
        "| | median over rounds (min-max) |", "|---|---|",
        f"| median time to first token, caching on (ms) | {_stat(on, 1000)} |",
        f"| median time to first token, caching off (ms) | {_stat(off, 1000)} |",
        f"| ratio off / on, per round | **{_stat(ratio, digits=2)}** |", "",
        f"Same answers with and without caching: {result['same_answers']}.", "",
        f"The prefill alone, in one process without HTTP (the same {setup['clients']} prompts of "
        f"{engine['prompt_tokens']:.0f} tokens a round, timed as one batcher step; rounds alternate which goes first):", "",
        "| | median over rounds (min-max) |", "|---|---|",
        f"| prefill per request, caching on (ms) | {_stat(engine['prefill_ms']['on'], digits=1)} |",
        f"| prefill per request, caching off (ms) | {_stat(engine['prefill_ms']['off'], digits=1)} |",
        f"| ratio off / on, per round | **{_stat(engine['ratio'], digits=2)}** |", "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), default="demo")
    parser.add_argument("--model-dir", default=None, help="a saved model to serve instead of a random one")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results", help="where prefix_cache_<arch>.{json,md} go")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model_dir, model = Path(args.model_dir), f"{args.model_dir} (as served)"
        else:
            model_dir = Path(tmp) / f"llama-{args.arch}"
            size = save_model(model_dir, args.arch)
            hidden, layers, heads, kv_heads, _ = ARCHS[args.arch]
            model = (f"Llama, hidden {hidden}, {layers} layers, {heads} heads / {kv_heads} key-value heads, byte "
                     f"vocabulary, context 512: {size / 1e6:.2f}M parameters, random weights ('{args.arch}')")  # fmt: skip
        load = round(os.getloadavg()[0], 1)
        result = run(model_dir, args.rounds, args.clients)
        result["engine"] = engine_prefill(model_dir, args.rounds, args.clients)
    result["setup"] = {"model": model, "clients": args.clients, "rounds": args.rounds,
                       "system_prompt_tokens": len(SYSTEM_PROMPT.encode()), "load_average_at_start": load,
                       "load_average_at_end": round(os.getloadavg()[0], 1)}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"prefix_cache_{args.arch}" if not args.model_dir else "prefix_cache_model_dir"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
