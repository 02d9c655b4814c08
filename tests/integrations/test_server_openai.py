"""The server against the clients people point at it: the official `openai` client, a schema fuzzer, bad input.

One live `shardspeed-serve` (a tiny random Llama, byte tokenizer, prefix caching on, an API key) on
loopback. The `openai` client's completions and chat, plain and streaming, with `stop`, `logprobs`, `n`,
`echo`, token-id prompts and usage; greedy answers equal the model's own `generate`. Then a battery of bad
requests, each answered 4xx with the field named and followed by a good request that succeeds; the
documented defaults, error details, metric labels and log stream; then schemathesis with every check
against the server's own `/openapi.json` (bounded examples), which must find nothing; then `/metrics` shows
what was served.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _extra in ("fastapi", "uvicorn", "httpx", "transformers", "prometheus_client", "openai"):
    pytest.importorskip(
        _extra, reason="the serve and serve-tests extras are not installed (integration stage)"
    )

import httpx  # noqa: E402
import openai  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from shardspeed.mii.tokenizer import byte_tokenizer  # noqa: E402

from .server_common import (  # noqa: E402
    PROMPTS,
    reference_ids,
    save_tiny_llama,
    server_log,
    start_server,
    stop_server,
)

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    process, base = start_server(model_dir, "--api-key", KEY, "--max-body-bytes", "65536", "--max-batch", "8")
    try:
        yield base, LlamaForCausalLM.from_pretrained(model_dir).eval(), byte_tokenizer(), process
    finally:
        assert stop_server(process) == 0


def test_openai_client(server):
    base, model, tokenizer, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def greedy(prompt_ids, n):
        return tokenizer.decode(reference_ids(model, prompt_ids, n), skip_special_tokens=True)

    ids = tokenizer(PROMPTS[1])["input_ids"]
    expected = greedy(ids, 24)
    done = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0)
    assert done.choices[0].text == expected and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens == 24
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve(
        "tiny"
    ).created > 0

    # stop: the text ends before the first stop string, which is not returned; finish_reason "stop"
    stop = next(c for c in expected if c.isalnum())
    cut = expected[: expected.index(stop)]
    stopped = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop, "@@"]
    )
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop,
                                         stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == stopped.usage.completion_tokens

    # logprobs: the chosen tokens' log-probabilities, top alternatives; greedy picks the most likely
    with_lp = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3
    )
    lp = with_lp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3 and math.isclose(chosen, max(top.values()), abs_tol=1e-5)
    echoed = client.completions.create(
        model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=0
    )
    assert echoed.choices[0].text == PROMPTS[1] + greedy(ids, 2)
    assert (
        echoed.choices[0].logprobs.token_logprobs[0] is None
        and len(echoed.choices[0].logprobs.tokens) == len(ids) + 2
    )

    # n and seeds: reproducible samples; a list of prompts gives one choice per prompt
    sampled = [client.completions.create(model="tiny", prompt="x", max_tokens=8, n=3, seed=7, temperature=1.0)
               for _ in range(2)]  # fmt: skip
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert len(sampled[0].choices) == 3 and sampled[0].usage.completion_tokens == 24
    several = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=5, temperature=0)
    assert [c.text for c in several.choices] == [greedy(tokenizer(p)["input_ids"], 5) for p in PROMPTS[:3]]

    # chat, plain and streaming, through the default chat template
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def"}]
    template_ids = tokenizer("<|system|>\nYou write Python.\n<|user|>\ndef\n<|assistant|>\n")["input_ids"]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                          top_logprobs=2)  # fmt: skip
    assert chat.choices[0].message.content == greedy(template_ids, 10)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens == len(template_ids)
    assert (
        len(chat.choices[0].logprobs.content) == 10
        and len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
    )
    pieces = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))  # fmt: skip
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == chat.choices[0].message.content
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert again.choices[0].message.content == chat.choices[0].message.content  # from the prefix cache: same
    assert again.usage.prompt_tokens_details.cached_tokens > 0

    # refused by name, never ignored; the key is needed
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"guided_json": {}})
    assert refused.value.body["param"] == "guided_json" and "guided_json" in refused.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def _bad_requests():
    """(route, body, status, field) — every case issue 24 names, and more."""
    c, chat = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    return [
        (c, {"prompt": "def ", "max_tokens": 4, "temperature": "hot"}, 400, "temperature"),
        (c, {"prompt": "def ", "temperature": 1, "seed": 18446744073709551616}, 400, "seed"),
        (c, {"prompt": "def ", "seed": -1}, 400, "seed"),
        (c, {"prompt": "x", "top_p": 0}, 400, "top_p"),
        (c, b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
        (c, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
        (c, b'{"prompt": "\\ud800"}', 400, "prompt"),
        (chat, b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "messages[0].content"),
        (c, {"prompt": "x", "temperature": -1}, 400, "temperature"),
        (c, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
        (c, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
        (c, {"max_tokens": 3}, 400, "prompt"),
        (c, {"prompt": []}, 400, "prompt"),
        (c, {"prompt": ""}, 400, "prompt"),
        (c, {"prompt": [1, 2, 999]}, 400, "prompt"),
        (c, {"prompt": [[1], []]}, 400, "prompt"),
        (c, {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
        (c, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        (c, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        (c, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        (c, {"prompt": "x", "model": "nope"}, 404, "model"),
        (c, {"prompt": "x", "n": 0}, 400, "n"),
        (c, {"prompt": ["x"] * 64, "n": 128}, 400, "n"),
        (c, {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of"),
        (c, {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
        (c, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
        (c, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (c, {"prompt": "x", "stop": [""]}, 400, "stop"),
        (c, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        (c, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        (c, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
        (c, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        (c, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
        (c, {"prompt": "x", "logit_bias": {"999": 1}}, 400, "logit_bias"),
        (c, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (
            c,
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
            400,
            "stream_options",
        ),
        (c, {"prompt": "x", "top_k": -2}, 400, "top_k"),
        (c, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        (c, {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
        (c, {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
        (c, {"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
        (c, {"prompt": "x", "foo": 1}, 400, "foo"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
        (chat, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "messages[0].content",
        ),
        (chat, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name"),
        (chat, {"messages": msg, "tools": []}, 400, "tools"),
        (chat, {"messages": msg, "top_logprobs": 2}, 400, "top_logprobs"),
        (chat, {"messages": msg, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
        (chat, {"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
        (chat, {"messages": msg, "echo": True}, 400, "echo"),
        (c, b"{not json", 400, "body"),
        (c, b"[1, 2]", 400, "body"),
        (c, b"", 400, "body"),
        (c, b'{"prompt": "' + b"x" * 70000 + b'"}', 413, "body"),
        ("/mii/tiny", {"prompts": ["x"], "max_length": 1}, 400, "max_length"),
        ("/mii/other", {"prompts": ["x"]}, 404, "deployment_name"),
    ]


def test_bad_requests_are_refused_by_name_and_the_server_keeps_serving(server):
    base, *_ = server
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = _bad_requests()
    assert len(cases) >= 40
    with httpx.Client(base_url=base, headers=headers, timeout=300) as http:
        for route, body, status, field in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = http.post(route, content=content)
            assert response.status_code == status, (route, body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["param"] is not None and error["param"].startswith(field), (field, error)
            assert field.split("[")[0] in error["message"], (field, error)
            good = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2, (
                body,
                good.text,
            )
        for method, path, status in (("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404)):
            error = http.request(method, path).json()["error"]
            assert http.request(method, path).status_code == status and path in error["message"]
        assert http.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert http.get("/health").json()["status"] == "ok"


def test_documented_defaults_error_details_metrics_and_log(server):
    """What docs/inference.md promises, checked one by one against the live server."""
    base, _, _, process = server
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=300) as http:
        # max_tokens null: completions' documented default (16, OpenAI's); chat: up to the context
        plain = {"prompt": "x", "ignore_eos": True, "max_tokens": None}
        assert http.post("/v1/completions", json=plain).json()["usage"]["completion_tokens"] == 16
        chat = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True, "max_tokens": None}
        answer = http.post("/v1/chat/completions", json=chat).json()
        context = http.get("/v1/models/tiny").json()["max_model_len"]
        assert answer["usage"]["completion_tokens"] == context - answer["usage"]["prompt_tokens"]

        # a limit the schema cannot state says which in error.code (the schema's 400 lists them)
        error = http.post("/v1/completions", json={"prompt": "x", "max_tokens": context}).json()["error"]
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded"), error
        error = http.post("/v1/completions", json={"prompt": "x", "min_tokens": 17}).json()["error"]
        assert (error["param"], error["code"]) == ("min_tokens", "min_tokens_above_max_tokens"), error

        # a stop list over the limit names the limit, not a type the list is not
        error = http.post("/v1/completions", json={"prompt": "x", "stop": ["a"] * 1000}).json()["error"]
        assert error["param"] == "stop" and error["message"].startswith("stop: at most 4 sequences"), error
        # a body that is not valid JSON (here: not UTF-8) names the body
        for body in (b'{"prompt": "\xff"}', b"{not json"):
            response = http.post(
                "/v1/completions", content=body, headers={"Content-Type": "application/json"}
            )
            assert response.status_code == 400 and response.json()["error"]["param"] == "body", response.text

        # /metrics labels a route with a parameter by its template
        assert http.get("/v1/models/tiny").status_code == 200
        metrics = http.get("/metrics").text
    assert 'shardspeed_requests_total{route="/v1/models/{model}",status="200"}' in metrics, metrics
    # the request log goes to stderr (--help and the docs say so), nothing of it to stdout
    assert '"path": "/v1/models/tiny"' in server_log(process, "stderr")
    assert '"path": ' not in server_log(process, "stdout")


def test_schemathesis_with_every_check_finds_nothing(server, tmp_path):
    """Every check schemathesis has, against the live server's own /openapi.json: no 5xx, every status and
    media type answered is documented, every response (and stream event) fits its schema, every request
    the schema calls invalid is refused and every one it calls valid is accepted (less the 400s whose
    ``error.code`` names a limit no JSON Schema can state: schemathesis_hooks.py), auth enforced.
    Bounded: a fixed number of examples per operation, a fixed seed, and the run under a time limit. The
    response-time check is a hang detector here (300 s, as the request timeout), not a speed test."""
    pytest.importorskip("schemathesis", reason="the serve-tests extra is not installed (integration stage)")
    base, *_ = server
    command = [sys.executable, "-m", "schemathesis.cli", "run", base + "/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--max-examples", "20",
               "--phases", "examples,coverage,fuzzing,stateful", "--workers", "1", "--header", f"Authorization: Bearer {KEY}",
               "--request-timeout", "300", "--max-response-time", "300", "--suppress-health-check", "all", "--seed", "1",
               "--no-color"]  # fmt: skip
    # The hooks module registers the narrowed positive_data_acceptance ("all" then includes it) and notes
    # in a file that it ran.
    ran = tmp_path / "narrowed-check-ran"
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks", PYTHONPATH=str(Path(__file__).parent),
               SHARDSPEED_CHECK_RAN=str(ran))  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert ran.exists(), "the narrowed positive_data_acceptance check never ran"
    with httpx.Client(base_url=base, timeout=60) as http:
        metrics = http.get("/metrics").text
        assert http.get("/health").json()["status"] == "ok"
    for name in ("shardspeed_requests_total", "shardspeed_time_to_first_token_seconds_bucket",
                 "shardspeed_inter_token_latency_seconds_bucket", "shardspeed_queue_depth", "shardspeed_running_requests",
                 "shardspeed_kv_blocks_in_use", "shardspeed_prompt_tokens_total", "shardspeed_generation_tokens_total"):  # fmt: skip
        assert name in metrics, name
    assert 'status="500"' not in metrics


def test_the_vocabulary_pattern_matches_exactly_the_ids_below_its_size():
    """/openapi.json's pattern for logit_bias keys: every canonical decimal below n, nothing else."""
    import re

    from shardspeed.mii.openapi import decimal_below

    for n in (*range(1, 130), 257, 1000, 1001, 32000, 128256):
        pattern = re.compile(decimal_below(n))
        for value in (*range(0, 130), *range(n - 3, n + 3), 999, 1000, 1001, 31999, 32000, 128255, 128256):
            assert bool(pattern.fullmatch(str(value))) == (0 <= value < n), (n, value)
        assert not pattern.fullmatch("01") and not pattern.fullmatch("") and not pattern.fullmatch("-1")


def test_the_default_chat_template_is_rendered_as_its_jinja_source_says():
    """chat.py writes DEFAULT_CHAT_TEMPLATE's text directly (Jinja cost ~5 ms a request): same tokens."""
    import random
    import string

    from shardspeed.mii.chat import DEFAULT_CHAT_TEMPLATE, chat_prompt_ids
    from shardspeed.mii.protocol import ChatMessage

    tokenizer, rng = byte_tokenizer(), random.Random(0)
    alphabet = string.printable + "{}%#<>|\u00e9\u4e2d"
    for _ in range(200):
        messages = [ChatMessage(role=rng.choice(["system", "developer", "user", "assistant"]),
                                content="".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))))
                    for _ in range(rng.randint(1, 4))]  # fmt: skip
        plain = [{"role": m.role, "content": m.text} for m in messages]
        text = tokenizer.apply_chat_template(
            plain, chat_template=DEFAULT_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
        )
        assert chat_prompt_ids(tokenizer, messages) == tokenizer(text, add_special_tokens=False)["input_ids"]
