"""The server's behaviour when things go wrong: a failing request, a dying generation loop, SIGTERM.

* A fault injected into one request's decode while others run (serve_with_faults.py, seed 4242): that
  request gets a 500 (a streaming one an error event), every other request finishes with the model's own
  greedy answer, the KV blocks all come back and the server keeps serving.
* The generation loop itself dies (seed 4343): the pending request is answered with an error, and the
  process exits with status 1 by itself (for a supervisor to restart it) instead of answering 500 forever.
* SIGTERM with requests in flight (a stream being generated, a client stuck half-way through its body):
  the process exits with status 0 within the 10 s the issue allows (a hang detector, not a speed test:
  the shutdown grace is 1 s here), with no traceback in its log.
* SIGTERM drains: /health answers 503 and a new request 503 while requests in flight get the shutdown
  timeout; a short stream finishes; streams that cannot finish (seed 4444 slows them) end with an error
  event and `data: [DONE]`, a plain request with a 503; the process exits 0 and logs no traceback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
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
        assert (
            "injected decode fault" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        )
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
        assert "Traceback" not in server_log(process), server_log(process)[-5000:]
        stream.close()
    finally:
        stuck.close()
        stop_server(process)


def _call(base: str, path: str, body: dict, results: dict, name: str) -> None:
    """POST ``body``; record (status, data lines of a stream or the JSON body) under ``name``."""
    with httpx.Client(base_url=base, timeout=300) as http:
        if body.get("stream"):
            with http.stream("POST", path, json=body) as response:
                lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
                results[name] = (response.status_code, lines)
        else:
            response = http.post(path, json=body)
            results[name] = (response.status_code, response.json())


def test_sigterm_drains_every_request_in_flight(model_dir):
    process, base = start_server(model_dir, "--shutdown-timeout", "8", script="serve_with_faults.py")
    slow = {"max_tokens": 100, "ignore_eos": True, "seed": 4444}  # 0.2 s a step: 20 s, past the drain
    calls = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True, **slow}),
        "stream": ("/v1/completions", {"prompt": "def ", "stream": True, **slow}),
        "plain": ("/v1/completions", {"prompt": "class ", **slow}),
        "short": ("/v1/completions", {"prompt": "x = ", "max_tokens": 3, "ignore_eos": True, "stream": True}),
    }  # fmt: skip
    results: dict = {}
    threads = {
        name: threading.Thread(target=_call, args=(base, *call, results, name))
        for name, call in calls.items()
    }
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            for name in ("chat", "stream", "plain"):
                threads[name].start()
            while http.get("/health").json()["running"] < 4:  # both chat choices, the stream, the plain one
                time.sleep(0.05)
            threads["short"].start()
            while http.get("/health").json()["running"] < 5 and "short" not in results:
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            # Draining: the listener stays open; /health says so with a 503, a new request is refused.
            while (health := http.get("/health")).status_code == 200:
                time.sleep(0.02)
            assert (health.status_code, health.json()["status"]) == (503, "stopping"), health.text
            refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for thread in threads.values():
            thread.join(timeout=120)
        assert process.wait(timeout=120) == 0, server_log(process)[-3000:]
    finally:
        stop_server(process)
    status, events = results["short"]  # finished within the drain
    assert status == 200 and events[-1] == "[DONE]", events
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events
    for name in ("chat", "stream"):  # ended by the drain: an error event, then [DONE]
        status, events = results[name]
        assert status == 200 and events[-1] == "[DONE]", (name, events[-3:])
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"], (name, error)
        assert len(events) > 3, (name, events)  # tokens went out before the drain ended it
    status, body = results["plain"]
    assert status == 503 and "shutting down" in body["error"]["message"], body
    log = server_log(process)
    for sign in ("Traceback", "Event loop is closed", "CancelledError"):
        assert sign not in log, log[-5000:]
