"""Errors for HTTP callers, in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Client mistakes get a 4xx and say what was wrong and how to fix it; they are never a 500:

    400  malformed JSON, a field that fails validation (``param`` names it), max_tokens over the limit,
         an invalid tool schema, an invalid model name or rollout id
    401  missing or wrong API key
    404  unknown model or route
    405  wrong method on a known route
    413  request body over ``max_request_bytes``
    422  a valid request this model cannot render (e.g. an image part for a text-only chat template)
    500  the engine failed (logged with its traceback)
    503  the gateway is shutting down, or its engine is unavailable

Python callers of the gateway (``Gateway``, ``GatewayControl``) get ``art_core.errors`` exceptions instead;
``APIError`` lives only between a route and its HTTP response.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "error_body", "error_response", "install_error_handlers"]

logger = logging.getLogger(__name__)

_DEFAULT_TYPES = {401: "invalid_request_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the gateway answers with an error: status code plus OpenAI's four error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002  (OpenAI's field name)
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        return error_response(self.status_code, self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None  # noqa: A002
) -> dict[str, Any]:
    """The JSON body OpenAI's API and SDKs use for errors."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    *,
    type: str | None = None,  # noqa: A002
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error response."""
    kind = type or _DEFAULT_TYPES.get(status_code, "invalid_request_error")
    body = error_body(message, type=kind, param=param, code=code)
    return JSONResponse(body, status_code=status_code, headers=headers)


def field_path(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``: the field as the client wrote it."""
    path = ""
    for part in loc:
        if part in ("body", "path", "query", "header") and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, FastAPI's own included, in OpenAI's shape."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "JSON decode error")
            where = error["loc"][-1] if len(error.get("loc", ())) > 1 else "?"
            return error_response(
                400,
                f"the request body is not valid JSON ({reason} at character {where}): send a JSON object "
                "with Content-Type: application/json",
                code="invalid_json",
            )
    problems = []
    for error in errors:
        path = field_path(error.get("loc", ())) or "body"
        detail = error.get("msg", "invalid")
        if "input" in error and error.get("type") not in ("missing",) and _short(error["input"]):
            detail += f" (got {_short(error['input'])})"
        problems.append(f"{path}: {detail}")
    first = field_path(errors[0].get("loc", ())) if errors else None
    summary = problems[0] if len(problems) == 1 else f"{len(problems)} invalid fields: " + "; ".join(problems)
    return error_response(400, summary, param=first or None, code="invalid_value")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = (
            f"no route {request.method} {request.url.path}: the gateway serves /v1/chat/completions, /v1/models "
            "(also under /rollouts/{rollout_id}/v1/...) and /rollouts/{rollout_id}/records"
        )
        return error_response(404, message, code="unknown_url")
    if exc.status_code == 405:
        return error_response(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal gateway error: {type(exc).__name__}: {exc}", code="internal_error")


def _short(value: Any, limit: int = 60) -> str:
    if isinstance(value, (dict, list)) and len(str(value)) > limit:
        return ""  # a whole object would drown the message; the path already says where
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
