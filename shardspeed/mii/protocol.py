"""The request bodies the server accepts, as typed models: OpenAI's fields with OpenAI's types and ranges.

FastAPI validates every body against these models before a handler runs, and publishes them in
``/openapi.json`` (client generators and schema fuzzers see exactly what is accepted). The models are
strict (a string is not a number, ``true`` is not 1), forbid unknown fields (a field we do not implement is
refused by name, never ignored), reject NaN and infinities, and reject strings that are not valid Unicode
(JSON's ``"\\ud800"`` escape decodes to a lone surrogate). What passes is safe for the sampler; the limits
that depend on the model (context length, vocabulary size, batch size) are checked by the service.

Besides OpenAI's fields, vLLM's ``top_k``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos`` are
accepted, as clients written for vLLM send them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "MIIRequest",
    "StreamOptions",
    "TextPart",
]

MAX_SEED = 2**63 - 1  # a torch generator's seed is a 64-bit integer; OpenAI's seeds fit in int64 too
MAX_STOPS = 4  # OpenAI's limit on stop sequences
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for (legacy) completions; chat has none (up to the context)


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"not valid Unicode: a lone surrogate {value[error.start]!r} at character {error.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


def _at_most_4(value):
    """A stop list over the limit, said as such (else the union's first member, a string, is what the
    error names: "Input should be a valid string")."""
    if isinstance(value, list) and len(value) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} sequences ({len(value)} given)")
    return value


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = Field(False, description="send a last chunk with the request's token usage")


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: Text | None = Field(None, description="the deployment name; absent means the served model")
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
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100, le=100)]] | None = (
        Field(None, description="token id (as a string) -> bias added to its logit")
    )  # fmt: skip
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    user: Text | None = Field(None, max_length=256, description="an end-user id, written to the request log")
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="vLLM: -1 or 0 = all tokens")
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, description="vLLM: 1 = none")
    min_tokens: int = Field(0, ge=0, le=2**31 - 1, description="vLLM: no stop before this many tokens")
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

    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
        | Annotated[list[TokenId], Field(min_length=1, max_length=1_048_576)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    ) = Field(description="a string, a list of strings, a list of token ids, or a list of such lists")
    max_tokens: int | None = Field(
        DEFAULT_MAX_TOKENS, ge=1, le=2**31 - 1, description="new tokens at most; absent or null: 16"
    )
    echo: bool = Field(False, description="return the prompt before the completion")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of this many top tokens")
    best_of: int | None = Field(
        None,
        ge=1,
        le=20,
        description="generate this many per prompt, return the n of best mean log-probability",
    )
    suffix: Text | None = Field(None, description="not supported: must be absent or null")

    @field_validator("max_tokens")
    @classmethod
    def _null_is_the_default(cls, value):
        # OpenAI documents 16 as the default; a client that spells "no value" as null means that default,
        # not the whole context (which is what null means for chat, where no default is documented).
        return DEFAULT_MAX_TOKENS if value is None else value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value is not None:
            raise ValueError("not supported by this server (insertion needs a fill-in-the-middle model)")
        return value

    @model_validator(mode="after")
    def _best_of_at_least_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of: cannot be larger than n when streaming")
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

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: int | None = Field(
        None, ge=1, le=2**31 - 1, description="default: the context left"
    )
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="OpenAI's older name of the above")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens: contradicts max_completion_tokens (give one)")
        return self


class MIIRequest(_Body):
    """``POST /mii/<deployment>``: DeepSpeed-MII's generate arguments."""

    prompts: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=64)]
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_length: int | None = Field(
        None, ge=1, le=2**31 - 1, description="MII: new tokens at most (as max_new_tokens)"
    )
    min_new_tokens: int = Field(0, ge=0, le=2**31 - 1)
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
