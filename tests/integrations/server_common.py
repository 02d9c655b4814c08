"""What the server's integration tests share: a tiny Llama on disk, its reference answers, a live server.

The model is a random 2-layer Llama over the locally built byte tokenizer (nothing downloaded); its own
greedy ``generate`` is the reference for every greedy answer. ``start_server`` runs ``shardspeed-serve`` (or
``serve_with_faults.py``) as a child process on a free loopback port and waits for ``/health``.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shardspeed.mii.tokenizer import END_OF_TEXT, byte_tokenizer

from harness import free_port

PROMPTS = ["def ", "import os\n", "class A:", "x = 1", "for i in", "return", "while True:", "# a"]
HERE = Path(__file__).parent


def save_tiny_llama(path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=END_OF_TEXT + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=END_OF_TEXT, pad_token_id=END_OF_TEXT)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return Path(path)


def reference_ids(model, prompt_ids: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1] :].tolist()


def reference_text(model, tokenizer, prompt: str, max_new: int) -> tuple[str, int]:
    new = reference_ids(model, tokenizer(prompt)["input_ids"], max_new)
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def start_server(model_dir, *args: str, script: str | None = None, timeout: float = 300.0):
    """(process, base URL) of a server on a free loopback port, once its /health answers."""
    port = free_port()
    entry = [str(HERE / script)] if script else ["-m", "shardspeed.mii.server"]
    command = [
        sys.executable,
        *entry,
        str(model_dir),
        "--port",
        str(port),
        "--deployment-name",
        "tiny",
        *args,
    ]
    # Output to files, not pipes: a pipe nobody reads fills up and blocks the server's log writes. stdout
    # and stderr apart: the request log must go to stderr.
    with (
        tempfile.NamedTemporaryFile("w", prefix="shardspeed-serve-", suffix=".out", delete=False) as out,
        tempfile.NamedTemporaryFile("w", prefix="shardspeed-serve-", suffix=".err", delete=False) as err,
    ):
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
    process.stdout_path, process.stderr_path = out.name, err.name
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: {server_log(process)[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return process, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"server on {base} not ready within {timeout:.0f} s")
        time.sleep(0.2)


def server_log(process, stream: str = "both") -> str:
    """What the server wrote: ``"stdout"``, ``"stderr"`` or both (stdout first)."""
    paths = {"stdout": [process.stdout_path], "stderr": [process.stderr_path]}.get(
        stream, [process.stdout_path, process.stderr_path]
    )
    texts = []
    for path in paths:
        with open(path, errors="replace") as handle:
            texts.append(handle.read())
    return "".join(texts)


def stop_server(process) -> int:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
