"""OpenAI's response shapes: completion and chat choices, their log-probabilities, stream chunks.

Log-probabilities come in two shapes: completions' legacy one (``tokens``, ``token_logprobs``,
``top_logprobs`` as {token: logprob}, ``text_offset``) and chat's (``content``: one entry per token with
``token``, ``logprob``, ``bytes`` and ``top_logprobs``). A token's text is its own decoding; a token that is only part of a character
(a byte-level tokenizer's piece of a multi-byte character) is written ``bytes:\\xe2\\x80`` as OpenAI
writes it, and chat's ``bytes`` holds the token's real bytes.
"""

from __future__ import annotations

import json
import re

from shardspeed.inference.sampling import Choice

from .tokenizer import byte_values

__all__ = ["chat_logprobs", "completion_logprobs", "sse"]


def sse(payload) -> str:
    """One server-sent event."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


_BYTES = byte_values()


class _Pieces:
    """Token id -> (its text, its bytes), remembered (the same tokens recur)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}

    def _bytes(self, token: int, text: str) -> bytes:
        if "\ufffd" not in text:
            return text.encode("utf-8")
        raw = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(raw, str) and raw and all(c in _BYTES for c in raw):  # byte-level BPE's alphabet
            return bytes(_BYTES[c] for c in raw)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw or "")  # SentencePiece's byte fallback
        return bytes([int(fallback.group(1), 16)]) if fallback else text.encode("utf-8")

    def entry(self, token: int) -> tuple[str, bytes]:
        if token not in self.known:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = self._bytes(token, text)
            if "\ufffd" in text and raw != text.encode("utf-8"):
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self.known[token] = (text, raw)
        return self.known[token]

    def __call__(self, token: int) -> str:
        return self.entry(token)[0]


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
        text, raw = piece.entry(token)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [
        {**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top or []]}
        for c in choices
    ]
    return {"content": content, "refusal": None}
