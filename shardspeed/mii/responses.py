"""OpenAI's response shapes: completion and chat choices, their log-probabilities, stream chunks.

Log-probabilities come in two shapes: completions' legacy one (``tokens``, ``token_logprobs``,
``top_logprobs`` as {token: logprob}, ``text_offset``) and chat's (``content``: one entry per token with
``token``, ``logprob``, ``bytes`` and ``top_logprobs``). A token's text is its own decoding (a byte-level
tokenizer's piece of a multi-byte character decodes to U+FFFD, as it does in OpenAI's answers).
"""

from __future__ import annotations

import json

from shardspeed.inference.sampling import Choice

__all__ = ["chat_logprobs", "completion_logprobs", "sse"]


def sse(payload) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Pieces:
    """Token id -> its text, remembered (the same tokens recur)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.known:
            self.known[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self.known[token]


def completion_logprobs(tokenizer, choices: list[Choice], offset: int, prompt: list[Choice] | None = None,
                        first_prompt_token: int | None = None) -> dict:  # fmt: skip
    """Completions' legacy shape; with ``prompt`` (echo) the prompt's tokens come first, the very first
    without a log-probability (nothing comes before it)."""
    piece = _Pieces(tokenizer)
    entries = []
    if prompt is not None and first_prompt_token is not None:
        entries.append(Choice(first_prompt_token))
        entries += prompt
    entries += choices
    result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        text = piece(entry.token)
        result["tokens"].append(text)
        result["token_logprobs"].append(entry.logprob)
        result["top_logprobs"].append(None if entry.top is None else {piece(t): lp for t, lp in entry.top})
        result["text_offset"].append(offset)
        offset += len(text)
    return result


def chat_logprobs(tokenizer, choices: list[Choice]) -> dict:
    piece = _Pieces(tokenizer)

    def entry(token: int, logprob: float) -> dict:
        text = piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top or []]}
        for c in choices
    ]
    return {"content": content, "refusal": None}
