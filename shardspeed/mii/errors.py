"""Every error the server answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` is what handlers raise. ``install_error_handlers`` maps the rest onto the same shape: a body
that fails validation (FastAPI's 422) becomes a 400 whose ``param`` and message name the field, an unknown
route a 404, a wrong method a 405, anything unexpected a 500 (logged with its traceback).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

__all__ = [
    "APIError",
    "ErrorBody",
    "error_body",
    "error_response",
    "install_error_handlers",
    "validation_error",
]

logger = logging.getLogger("shardspeed.mii.server")

_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error", 503: "server_error"}


class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong, starting with the field it is about")
    type: str = Field(
        description="invalid_request_error, authentication_error, not_found_error or server_error"
    )
    param: str | None = Field(description="the field at fault (messages[0].content, body, ...), if one is")
    code: str | None = Field(
        description="a machine-readable reason where there is one (model_not_found, ...)"
    )


class ErrorBody(BaseModel):
    """OpenAI's error shape: every error answer's body, and a stream's error event."""

    error: ErrorDetail


class APIError(Exception):
    """An answer other than success: HTTP ``status``, the offending field ``param``, a message naming it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers=None
):
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc) -> str | None:
    """``("body", "messages", 0, "content", "list[TextPart]", 0, "text")`` -> ``messages[0].content[0].text``.

    Pydantic puts the member of a union it tried (``str``, ``list[int]``, a model's name) into the location:
    those are not fields and are left out.
    """
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
            continue
        text = str(item)
        if "[" in text or "-" in text or text[:1].isupper() or text in _TYPE_TAGS:
            continue
        parts.append(text)
    return ".".join(parts) or None


def _shown(value) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error(errors: list[dict]) -> APIError:
    """The first of pydantic's errors as a 400 naming the field (unknown fields by name, as refused)."""
    error = errors[0]
    kind, message = error.get("type", ""), str(error.get("msg", "invalid"))
    param = _param(error.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, f"body: malformed JSON ({error.get('ctx', {}).get('error', message)})", "body")
    if kind == "extra_forbidden":
        return APIError(400, f"{param}: unknown field, not supported by this server", param)
    if kind == "missing":
        param = param or "body"
        return APIError(400, f"{param}: required field missing", param)
    message = message.removeprefix("Value error, ")
    if param is None:
        if ":" in message and message.split(":", 1)[0].isidentifier():  # a model-level check names its field
            param = message.split(":", 1)[0]
            return APIError(400, message, param)
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return APIError(
                400, "body: must be a JSON object, sent with Content-Type: application/json", "body"
            )
        return APIError(400, f"body: {message}", "body")
    return APIError(400, f"{param}: {message}, got {_shown(error.get('input'))}", param)


def _cause(error: HTTPException) -> str:
    """What FastAPI's generic "There was an error parsing the body" stands for, when it kept the cause."""
    cause = error.__cause__
    text = str(error.detail) if cause is None else f"{type(cause).__name__}: {cause}"
    return text if len(text) <= 160 else text[:157] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, error: APIError):
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError):
        api = validation_error(list(error.errors()))
        return error_response(api.status, api.message, api.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path} (see /openapi.json)"
        elif error.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif error.status_code == 400:  # FastAPI could not parse the body (not UTF-8, nested too deeply, ...)
            return error_response(400, f"body: malformed JSON ({_cause(error)})", "body")
        else:
            message = str(error.detail)
        return error_response(error.status_code, message, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(error).__name__}: {error}")
