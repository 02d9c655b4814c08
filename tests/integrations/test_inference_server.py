"""The MII-style front over real HTTP: `shardspeed.mii.serve` starts `shardspeed-serve` on loopback.

A tiny random Llama with the locally built byte tokenizer is saved in Hugging Face format. Then, against
the running server: concurrent greedy OpenAI completions (different prompts and lengths) each equal to the
model's own greedy `generate`, and served in shared batches; streaming (SSE) equal to the plain answer;
MII's route through the client `serve` returns; a client that disconnects, mid-stream or while waiting for
a plain answer, has its request cancelled and its KV blocks returned. `mii.pipeline` in-process gives the
same text. The tensor-parallel server (2 ranks through the launcher) answers the same.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from shardspeed import mii
from shardspeed.mii.tokenizer import byte_tokenizer

from harness import free_port

for _extra in ("fastapi", "uvicorn", "httpx", "transformers", "prometheus_client"):
    pytest.importorskip(_extra, reason="the serve extra is not installed (integration stage only)")

import httpx  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from .server_common import PROMPTS, reference_text, save_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _wait_idle(http, cancelled: int) -> dict:
    """Health once nothing runs and every KV block is back, with ``cancelled`` cancellations counted."""
    deadline = time.monotonic() + 120
    while True:
        health = http.get("/health").json()
        idle = health["running"] == 0 and health["free_kv_blocks"] == health["total_kv_blocks"]
        if idle and health["cancelled_requests"] >= cancelled:
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.05)


def test_server_concurrent_requests_and_disconnect(model_dir):
    port = free_port()
    client = mii.serve(
        str(model_dir), deployment_name="tiny", restful_api_port=port, max_batch=8, timeout=600
    )
    base = f"http://127.0.0.1:{port}"
    # Generous timeouts (httpx's default is 5 s): on a loaded shared machine a request can wait that long.
    http = httpx.Client(base_url=base, timeout=300)
    try:
        model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        tokenizer = byte_tokenizer()
        budgets = [4 + 5 * i for i in range(len(PROMPTS))]
        expected = [reference_text(model, tokenizer, p, n) for p, n in zip(PROMPTS, budgets)]

        async def many():
            async with httpx.AsyncClient(base_url=base, timeout=300) as http:
                calls = [http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": n,
                                                            "temperature": 0})
                         for p, n in zip(PROMPTS * 2, budgets * 2)]  # fmt: skip
                return await asyncio.gather(*calls)

        responses = asyncio.run(many())
        for response, (text, count) in zip(responses, expected * 2):
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["choices"][0]["text"] == text
            assert body["usage"]["completion_tokens"] == count
        health = http.get("/health").json()
        assert health["max_batch_seen"] > 1, health  # requests shared decode batches

        # streaming: the concatenated deltas are the plain answer
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": budgets[1],
                                                          "stream": True, "temperature": 0}) as stream:  # fmt: skip
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert (
            "".join(c["text"] for c in chunks) == expected[1][0] and chunks[-1]["finish_reason"] == "length"
        )

        # MII's route through MII's client
        answers = client.generate(PROMPTS[:2], max_new_tokens=6)
        assert [a["generated_text"] for a in answers] == [
            reference_text(model, tokenizer, p, 6)[0] for p in PROMPTS[:2]
        ]
        # MII's max_length counts the prompt: each prompt gets what is left of it
        answers = client.generate(PROMPTS[:2], max_length=12, return_full_text=True)
        assert [a["generated_text"] for a in answers] == [
            p + reference_text(model, tokenizer, p, 12 - len(p))[0] for p in PROMPTS[:2]
        ]

        # a client that goes away mid-stream: its request is cancelled, its blocks come back
        with http.stream("POST", "/v1/completions", json={"prompt": "def ", "max_tokens": 120, "stream": True,
                                                          "temperature": 0, "ignore_eos": True}) as stream:  # fmt: skip
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        assert _wait_idle(http, 1)["cancelled_requests"] == 1

        # a plain (non-streaming) request whose client goes away: cancelled too
        async def request_then_hang_up():
            async with httpx.AsyncClient(base_url=base, timeout=300) as client:
                task = asyncio.ensure_future(
                    client.post(
                        "/v1/completions",
                        json={"prompt": "def ", "max_tokens": 120, "temperature": 0, "ignore_eos": True},
                    )
                )
                while http.get("/health").json()["running"] == 0 and not task.done():
                    await asyncio.sleep(0.01)
                task.cancel()  # closes the connection mid-request

        asyncio.run(request_then_hang_up())
        assert _wait_idle(http, 2)["cancelled_requests"] == 2
        again = http.post(
            "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": budgets[0], "temperature": 0}
        )
        assert again.json()["choices"][0]["text"] == expected[0][0]
    finally:
        http.close()
        client.terminate_server()
    assert client._process.returncode is not None

    # the in-process pipeline answers the same
    pipe = mii.pipeline(str(model_dir))
    responses = pipe(PROMPTS[:3], max_new_tokens=8)
    for response, prompt in zip(responses, PROMPTS[:3]):
        text, count = reference_text(model, tokenizer, prompt, 8)
        assert response.generated_text == text and response.generated_length == count
        assert response.prompt_length == len(prompt.encode()) and response.finish_reason == "length"


def test_tensor_parallel_server_through_the_launcher(model_dir):
    """`serve(tensor_parallel=2)`: shardspeed's launcher starts 2 ranks; answers equal the model's own."""
    port = free_port()
    client = mii.serve(
        str(model_dir), deployment_name="tiny", restful_api_port=port, tensor_parallel=2, timeout=600
    )
    try:
        model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        tokenizer = byte_tokenizer()

        async def many():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
                calls = [
                    http.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "temperature": 0})
                    for p in PROMPTS[:4]
                ]
                return await asyncio.gather(*calls)

        for response, prompt in zip(asyncio.run(many()), PROMPTS[:4]):
            assert response.json()["choices"][0]["text"] == reference_text(model, tokenizer, prompt, 10)[0]
    finally:
        client.terminate_server()
    assert client._process.returncode is not None
