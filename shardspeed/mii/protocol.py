"""The request bodies the server accepts, as typed models: OpenAI's fields with OpenAI's types and ranges.

FastAPI validates every body against these models before a handler runs, and publishes them in
``/openapi.json`` (client generators and schema fuzzers see exactly what is accepted). The models are
strict (a string is not a number, ``true`` is not 1), forbid unknown fields (a field we do not implement is
refused by name, never ignored), reject NaN and infinities, and reject strings that are not valid Unicode
(JSON's ``"\\ud800"`` escape decodes to a lone surrogate). What passes is safe for the sampler; the limits
that depend on the model (context length, vocabulary size) are checked by the service, and openapi.py
writes them into the published schema (the fields carry a ``LIMIT`` marker naming theirs).

Besides OpenAI's fields, vLLM's ``top_k``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos`` are
accepted, as clients written for vLLM send them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "MIIRequest",
    "StreamOptions",
    "TextPart",
]

MAX_SEED = 2**63 - 1  # a torch generator's seed is a 64-bit integer; OpenAI's seeds fit in int64 too
# Fields whose limit depends on the served model carry this key in their JSON schema, naming the limit;
# openapi.py writes the model's numbers in its place (vocabulary size, context).
LIMIT = "x-shardspeed-limit"
MAX_STOPS = 4  # OpenAI's limit on stop sequences
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for (legacy) completions; chat has none (up to the context)
MAX_BEST_OF = 20


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"not valid Unicode: a lone surrogate {value[error.start]!r} at character {error.start}"
        ) from None
    return value


def _whole(value):
    """``value`` (parsed JSON) with every number without a fraction (7.0) as an integer: JSON Schema counts
    7.0 as an integer, as clients reading the published schema do; strict pydantic would refuse it."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {key: _whole(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole(item) for item in value]
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1, json_schema_extra={LIMIT: "token-id"})]
PromptIds = Annotated[list[TokenId], Field(min_length=1, json_schema_extra={LIMIT: "prompt-ids"})]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _at_most_4(value):
    """A stop list over the limit, said as such (else the union's first member, a string, is what the
    error names: "Input should be a valid string")."""
    if isinstance(value, list) and len(value) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} sequences ({len(value)} given)")
    return value


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _whole_numbers(cls, data):
        return _whole(data)


# The rules between fields, in JSON Schema, for /openapi.json: the model validators below check the same
# (a rule here without its check, or the reverse, lets a schema fuzzer find a request that the schema and
# the server judge differently). Relations between two numbers that JSON Schema cannot state (min_tokens <=
# max_tokens, prompt + max_tokens within the context, prompts x n) are in the fields' descriptions only.
def _given(field: str) -> dict:
    """``field`` is present and not null."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}}}}


_STREAM_OPTIONS_NEED_STREAM = {
    "if": _given("stream_options"),
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _best_of_rules() -> list[dict]:
    """best_of >= n: one rule per value of best_of (1..20), as JSON Schema cannot compare two fields; and
    no best_of above 1 when streaming (which keeps the rules few enough for schema tools to expand)."""
    rules: list[dict] = [{"if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
                          "then": {"properties": {"best_of": {"enum": [None, 1]}}}}]  # fmt: skip
    for k in range(1, MAX_BEST_OF + 1):
        best = {"required": ["best_of"], "properties": {"best_of": {"const": k}}}
        rules.append({"if": best, "then": {"properties": {"n": {"maximum": k}}}})
    return rules


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk with the request's token usage")


class _Sampling(_Body):
    """The fields completions and chat share (each one's ``model_config`` states the rules between them)."""

    model: Text | None = Field(None, description="the deployment name; absent means the served model",
                               json_schema_extra={LIMIT: "model-name"})  # fmt: skip
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="0 (or below 1e-5) is greedy; absent means 1 (OpenAI's default)"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128, description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = Field(
        None, description="up to 4 strings; generation ends before the first one, which is not returned"
    )
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # Keys in canonical decimal (no leading zeros), so that the schema's pattern for "below the vocabulary
    # size" accepts exactly the keys the service accepts.
    logit_bias: dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")], Annotated[float, Field(ge=-100, le=100)]] | None = (
        Field(None, description="token id (as a string) -> bias added to its logit", json_schema_extra={LIMIT: "token-keys"})
    )  # fmt: skip
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: Text | None = Field(None, max_length=256, description="an end-user id, written to the request log")
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="vLLM: -1 or 0 = all tokens")
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="vLLM: 1 = none")
    min_tokens: int = Field(0, ge=0, le=2**31 - 1, description="vLLM: no stop before this many tokens",
                            json_schema_extra={LIMIT: "new-tokens"})  # fmt: skip
    ignore_eos: bool = Field(False, description="vLLM: do not stop at the end-of-text token")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_limit(cls, value):
        return _at_most_4(value)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, *_best_of_rules()]})

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1, max_length=64)]
    ) = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    max_tokens: int | None = Field(
        DEFAULT_MAX_TOKENS, ge=1, le=2**31 - 1, description="new tokens at most; absent or null: 16",
        json_schema_extra={LIMIT: "new-tokens"},
    )  # fmt: skip
    echo: bool = Field(False, description="return the prompt before the completion")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of this many top tokens")
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_BEST_OF,
        description="generate this many per prompt (>= n; not above 1 when streaming), return the n of best "
        "mean log-probability",
    )
    suffix: None = Field(None, description="not supported: must be absent or null")

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, value):
        # OpenAI documents 16 as the default; a client that spells "no value" as null means that default,
        # not the whole context (which is what null means for chat, where no default is documented).
        return DEFAULT_MAX_TOKENS if value is None else value

    @field_validator("suffix", mode="before")
    @classmethod
    def _no_suffix(cls, value):
        if value is not None:
            raise ValueError("not supported by this server (insertion needs a fill-in-the-middle model)")
        return value

    @model_validator(mode="after")
    def _best_of_at_least_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of not in (None, 1) and self.stream:  # OpenAI: "results cannot be streamed"
            raise ValueError("best_of: above 1 cannot be streamed (the best are known only at the end)")
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[TextPart], Field(min_length=1)] = Field(
        description="a string, or a list of text parts (images, audio and files are not supported)"
    )

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered through the tokenizer's chat template."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        {"if": _given("top_logprobs"), "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": _given("max_tokens"), "then": {"properties": {"max_completion_tokens": {"type": "null"}}}},
    ]})  # fmt: skip

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: int | None = Field(
        None, ge=1, le=2**31 - 1, description="absent or null: the context left", json_schema_extra={LIMIT: "new-tokens"}
    )  # fmt: skip
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="OpenAI's older name of the above",
                                   json_schema_extra={LIMIT: "new-tokens"})  # fmt: skip
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens: give max_tokens or max_completion_tokens, not both")
        return self


class MIIRequest(_Body):
    """``POST /mii/<deployment>``: DeepSpeed-MII's generate arguments."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": _given("max_new_tokens"), "then": {"properties": {"max_length": {"type": "null"}}}}]})  # fmt: skip

    prompts: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1, json_schema_extra={LIMIT: "new-tokens"})
    max_length: int | None = Field(None, ge=1, le=2**31 - 1, description="MII: prompt + new tokens at most",
                                   json_schema_extra={LIMIT: "total-tokens"})  # fmt: skip
    min_new_tokens: int = Field(0, ge=0, le=2**31 - 1, json_schema_extra={LIMIT: "new-tokens"})
    do_sample: bool = Field(False, description="false (the default here; MII samples by default) is greedy")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool = False
    return_full_text: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_limit(cls, value):
        return _at_most_4(value)

    @model_validator(mode="after")
    def _one_length(self):
        if self.max_new_tokens is not None and self.max_length is not None:
            raise ValueError("max_length: give max_new_tokens or max_length, not both")
        return self

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
