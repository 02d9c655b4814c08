"""What ``/openapi.json`` says beyond FastAPI's own schema, so that it describes what the server answers.

FastAPI documents each route's 200 and a 422 for a body that fails validation. This server answers a failed
validation with a 400 (errors.py), never a 422, and answers statuses FastAPI cannot know of. So:
  * ``responses(...)`` lists a route's answers for its decorator in app.py: each error status with OpenAI's
    error body (``ErrorBody``), a streamed generation as ``text/event-stream`` beside JSON, ``/metrics`` as
    Prometheus' text, ``/health``'s body for 200 and 503;
  * ``install_schema`` drops FastAPI's 422s (and their models), declares the API key, when the server has
    one, as a bearer scheme with its 401 on the routes that need it, and writes in the limits that depend on
    the served model: token ids (in prompts and as ``logit_bias`` keys) below the vocabulary size, token
    counts within the context. Request fields carry a marker (protocol.LIMIT) naming which limit is theirs.
A schema fuzzer (tests/integrations/test_server_openai.py) then finds every answer documented, every
request the schema calls valid accepted and every other one refused.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

from .errors import ErrorBody
from .protocol import LIMIT, ChatCompletionRequest, CompletionRequest, MIIRequest

__all__ = ["OUTSIDE_SCHEMA", "decimal_below", "install_schema", "responses"]

# The codes of the 400s for limits no JSON Schema can state: prompt tokens + new tokens over the context
# (also MII's max_length within the prompt), min_tokens above the new tokens allowed, prompts x n over
# the server's 256 generations per request, a prompt the tokenizer encodes to no token.
OUTSIDE_SCHEMA = (
    "context_length_exceeded",
    "min_tokens_above_max_tokens",
    "too_many_generations",
    "empty_prompt",
)
_WHY = {
    400: "an invalid request: `error.param` names the field (`body` for a body that is not a JSON object). "
    "Limits this schema cannot state (they relate two numbers, or depend on the tokenizer) come with an "
    f"`error.code`: {', '.join(OUTSIDE_SCHEMA)}",
    404: "no such model, deployment or route",
    413: "a body larger than the server's --max-body-bytes",
    500: "the generation of this request failed (the server goes on)",
    503: "the server is shutting down, or its generation loop failed",
}
_UNAUTHORIZED = "no valid API key: send `Authorization: Bearer <key>`"


class Health(BaseModel):
    status: str = Field(description="ok (answered with 200), stopping or failed (503)")
    running: int
    waiting: int
    cancelled_requests: int
    failed_requests: int
    max_batch_seen: int
    free_kv_blocks: int
    total_kv_blocks: int
    error: str | None = Field(None, description="why the generation loop failed, when it did")


def _error(status: int) -> dict:
    return {"model": ErrorBody, "description": _WHY[status]}


def responses(kind: str) -> dict:
    """The ``responses`` of one kind of route: ``generation``, ``stream`` (generation, maybe streamed),
    ``model`` (a route naming a model in its path), ``health``, ``metrics``."""
    if kind == "health":
        return {200: {"model": Health, "description": "serving"},
                503: {"model": Health, "description": "stopping (draining after SIGTERM) or failed"}}  # fmt: skip
    if kind == "metrics":
        text = {"text/plain": {"schema": {"type": "string"}}}
        return {200: {"description": "Prometheus' text exposition format (version 0.0.4)", "content": text}}
    if kind == "model":
        return {404: _error(404)}
    answers = {status: _error(status) for status in (400, 404, 413, 500, 503)}
    if kind == "stream":
        # OpenAPI 3.1 has the schema of an event stream describe one event (its fields: data, event, id)
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string",
                 "description": "a JSON chunk (OpenAI's shape, or an error body), then [DONE] last"}}}  # fmt: skip
        events = {"text/event-stream": {"schema": event}}
        answers[200] = {"description": "JSON; with `stream`, server-sent events ending `data: [DONE]`",
                        "content": events}  # fmt: skip
    return answers


def decimal_below(n: int) -> str:
    """A regular expression matching exactly the decimal integers 0 .. n-1, written without leading zeros."""
    if n < 1:
        raise ValueError(f"n: must be at least 1, got {n}")
    top = str(n - 1)
    options = [("[0-9]" if length == 1 else f"[1-9][0-9]{{{length - 1}}}") for length in range(1, len(top))]
    for i, digit in enumerate(top):  # numbers as long as n - 1: equal to it up to i, then a lower digit
        low = 1 if i == 0 and len(top) > 1 else 0
        high = int(digit) if i == len(top) - 1 else int(digit) - 1
        if high < low:
            continue
        rest = len(top) - i - 1
        options.append(
            top[:i] + (str(low) if low == high else f"[{low}-{high}]") + (f"[0-9]{{{rest}}}" if rest else "")
        )
    return "^(" + "|".join(options) + ")$"


def _limits(vocab_size: int, context: int, model_name: str) -> dict:
    """What each ``LIMIT`` marker becomes in the schema for this model."""
    return {
        "model-name": {"enum": [model_name]},  # any other name is a 404
        "token-id": {"maximum": vocab_size - 1},
        "token-keys": {"propertyNames": {"pattern": decimal_below(vocab_size)}},
        # a prompt is at least one token, so at most context - 1 new tokens (and prompt tokens) fit
        "new-tokens": {"maximum": context - 1},
        "prompt-ids": {"maxItems": context - 1},
        "total-tokens": {"maximum": context},  # MII's max_length: prompt + new tokens
    }


def _write_limits(node, limits: dict) -> None:
    """Replace each marker under ``node`` by its limit, on the member of an ``anyOf`` that is not null."""
    if isinstance(node, list):
        for item in node:
            _write_limits(item, limits)
        return
    if not isinstance(node, dict):
        return
    marker = node.pop(LIMIT, None)
    if marker is not None:
        targets = [m for m in node.get("anyOf", [node]) if m.get("type") != "null"]
        for target in targets:
            if marker == "token-keys":  # the keys' pattern replaces pydantic's: no other key is valid
                values = list(target.pop("patternProperties", {}).values())
                target["additionalProperties"] = values[0] if values else {}
            target.update(limits[marker])
    for value in node.values():
        _write_limits(value, limits)


def _exact_request_schemas(schemas: dict) -> None:
    """Pydantic's own schemas of the request bodies in place of FastAPI's copies: FastAPI passes schemas
    through its models, which hold bounds as floats, so seed's maximum 2**63 - 1 came out as 2**63 (and
    admitted seeds the server refuses)."""
    for model in (CompletionRequest, ChatCompletionRequest, MIIRequest):
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(own.pop("$defs", {}))
        schemas[model.__name__] = own


def install_schema(app: FastAPI, *, vocab_size: int, context: int, model_name: str, api_key: bool) -> None:
    """``app.openapi`` (what ``/openapi.json`` serves) with the changes in the module docstring."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path, operations in schema["paths"].items():
            for operation in operations.values():
                operation["responses"].pop("422", None)
                if api_key and path.startswith(("/v1", "/mii")):
                    operation["security"] = [{"apiKey": []}]
                    operation["responses"]["401"] = {
                        "description": _UNAUTHORIZED,
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
                        },
                    }
        components = schema.setdefault("components", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(unused, None)
        _exact_request_schemas(components.setdefault("schemas", {}))
        if api_key:
            components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        _write_limits(schema, _limits(vocab_size, context, model_name))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
