"""The MII-style front over real HTTP: `shardspeed.mii.serve` starts `shardspeed-serve` on loopback.

A tiny random Llama with the locally built byte tokenizer is saved in Hugging Face format. Then, against
the running server: concurrent OpenAI completions (different prompts and lengths) each equal to the
model's own greedy `generate`, and served in shared batches; streaming (SSE) equal to the plain answer;
MII's route through the client `serve` returns; bad requests answered 4xx with the field named while the
server keeps serving; a client that disconnects mid-stream has its request cancelled and its KV blocks
returned. `mii.pipeline` in-process gives the same text.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from shardspeed import mii
from shardspeed.mii.tokenizer import END_OF_TEXT, byte_tokenizer

from harness import free_port

pytest.importorskip("fastapi", reason="the serve extra is not installed (integration stage only)")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (integration stage only)")
httpx = pytest.importorskip("httpx", reason="the serve extra is not installed (integration stage only)")
pytest.importorskip("transformers", reason="the serve extra is not installed (integration stage only)")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

PROMPTS = ["def ", "import os\n", "class A:", "x = 1", "for i in", "return", "while True:", "# a"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=END_OF_TEXT + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=END_OF_TEXT, pad_token_id=END_OF_TEXT)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def reference_text(model, tokenizer, prompt: str, max_new: int) -> tuple[str, int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids))
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), len(new)


def test_server_concurrent_requests_errors_and_disconnect(model_dir):
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
                calls = [http.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": n})
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
                                                                  "stream": True}) as stream:  # fmt: skip
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

        # bad requests: 4xx naming the field, and the server keeps serving
        bad = [
            ({"max_tokens": 3}, 400, "prompt"),
            ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
            ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
            ({"prompt": "x", "model": "nope"}, 404, "model"),
            ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
            ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ]
        for body, status, param in bad:
            response = http.post("/v1/completions", json=body)
            assert response.status_code == status, (body, response.text)
            assert response.json()["error"]["param"] == param and param in response.json()["error"]["message"]
        response = http.post(
            "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "body"
        assert http.post("/mii/other", json={"prompts": ["x"]}).status_code == 404

        # a client that goes away mid-stream: its request is cancelled, its blocks come back
        with http.stream("POST", "/v1/completions", json={"prompt": "def ", "max_tokens": 120,
                                                                  "stream": True}) as stream:  # fmt: skip
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 120
        while True:
            health = http.get("/health").json()
            if health["running"] == 0 and health["free_kv_blocks"] == health["total_kv_blocks"]:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.1)
        assert health["cancelled_requests"] == 1, health
        again = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": budgets[0]})
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
                    http.post("/v1/completions", json={"prompt": p, "max_tokens": 10}) for p in PROMPTS[:4]
                ]
                return await asyncio.gather(*calls)

        for response, prompt in zip(asyncio.run(many()), PROMPTS[:4]):
            assert response.json()["choices"][0]["text"] == reference_text(model, tokenizer, prompt, 10)[0]
    finally:
        client.terminate_server()
    assert client._process.returncode is not None
