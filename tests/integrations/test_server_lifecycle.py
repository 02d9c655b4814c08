"""The server's behaviour when things go wrong: a failing request, a dying generation loop, SIGTERM.

* A fault injected into one request's decode while others run (serve_with_faults.py, seed 4242): that
  request gets a 500 (a streaming one an error event), every other request finishes with the model's own
  greedy answer, the KV blocks all come back and the server keeps serving.
* The generation loop itself dies (seed 4343): the pending request is answered with an error, and the
  process exits with status 1 by itself (for a supervisor to restart it) instead of answering 500 forever.
* SIGTERM with requests in flight (a stream being generated, a client stuck half-way through its body):
  the process exits with status 0 within the 10 s the issue allows (a hang detector, not a speed test:
  the shutdown grace is 1 s here).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import time
from urllib.parse import urlparse

import pytest

for _extra in ("fastapi", "uvicorn", "httpx", "transformers", "prometheus_client"):
    pytest.importorskip(_extra, reason="the serve extra is not installed (integration stage only)")

import httpx  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from shardspeed.mii.tokenizer import byte_tokenizer  # noqa: E402

from .server_common import (  # noqa: E402
    PROMPTS,
    reference_text,
    save_tiny_llama,
    server_log,
    start_server,
    stop_server,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_a_fault_in_one_requests_decode_ends_only_that_request(model_dir):
    process, base = start_server(model_dir, "--max-batch", "8", script="serve_with_faults.py")
    try:
        model, tokenizer = LlamaForCausalLM.from_pretrained(model_dir).eval(), byte_tokenizer()
        expected = [reference_text(model, tokenizer, p, 30)[0] for p in PROMPTS]

        async def together():
            async with httpx.AsyncClient(base_url=base, timeout=300) as http:
                good = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 30, "temperature": 0})
                        for p in PROMPTS]  # fmt: skip
                faulty = http.post(
                    "/v1/completions",
                    json={"prompt": "x", "max_tokens": 30, "seed": 4242, "ignore_eos": True},
                )
                faulty_chat = http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "y"}], "max_tokens": 30, "seed": 4242, "stream": True,
                    "ignore_eos": True})  # fmt: skip
                return await asyncio.gather(faulty, faulty_chat, *good)

        faulty, faulty_stream, *good = asyncio.run(together())
        assert faulty.status_code == 500, faulty.text
        error = faulty.json()["error"]
        assert error["type"] == "server_error" and "injected decode fault" in error["message"]
        events = [line[6:] for line in faulty_stream.text.splitlines() if line.startswith("data: ")]
        assert "injected decode fault" in json.loads(events[-1])["error"]["message"]
        assert [r.json()["choices"][0]["text"] for r in good] == expected
        with httpx.Client(base_url=base, timeout=60) as http:
            health = http.get("/health").json()
            assert health["status"] == "ok" and health["failed_requests"] == 2, health
            assert health["running"] == 0 and health["free_kv_blocks"] == health["total_kv_blocks"], health
            again = http.post(
                "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0}
            )
            assert again.json()["choices"][0]["text"] == expected[0]
            assert (
                'shardspeed_requests_total{route="/v1/completions",status="500"} 1.0'
                in http.get("/metrics").text
            )
    finally:
        assert stop_server(process) == 0


def test_a_dead_generation_loop_ends_the_process_with_status_1(model_dir):
    process, base = start_server(model_dir, script="serve_with_faults.py")
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "seed": 4343})
        assert response.status_code == 500 and "generation loop failed" in response.json()["error"]["message"]
        assert process.wait(timeout=60) == 1
        assert "injected generation-loop fault" in server_log(process)
    finally:
        stop_server(process)


def test_sigterm_with_requests_in_flight_exits_promptly(model_dir):
    process, base = start_server(model_dir, "--shutdown-timeout", "1")
    host, port = urlparse(base).hostname, urlparse(base).port
    stuck = socket.create_connection((host, port))
    try:
        # A client stuck half-way through its body, and a long stream nobody reads.
        stuck.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip
        stream = socket.create_connection((host, port))
        body = json.dumps({"prompt": "def ", "max_tokens": 120, "stream": True, "ignore_eos": True}).encode()
        stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still running 10 s after SIGTERM")
        assert code == 0, server_log(process)[-3000:]
        stream.close()
    finally:
        stuck.close()
        stop_server(process)
