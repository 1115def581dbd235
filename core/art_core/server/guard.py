"""The server's two outer ASGI layers: the bearer token on every route, and the training API's body rules.

    check the token (every route, the gateways' too)  ->  read the body: size limit, gzip  ->  routes

Both answer errors as ``{"error": {"type", "message", "param"}}`` JSON (the gateways' OpenAI-shaped errors
have the same ``message``), which ``RemoteBackend`` turns back into ``art_core.errors`` exceptions.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..gateway.auth import BearerAuth, header_value
from ..wire import API_PREFIX

__all__ = ["TrainingBody", "bearer_token", "send_error"]


async def send_error(send: Send, status: int, type_: str, message: str, *, param: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """Answer a JSON error directly on the ASGI channel."""
    body = json.dumps({"error": {"type": type_, "message": message, "param": param}}).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def bearer_token(app: ASGIApp, *, token: str) -> BearerAuth:
    """Every HTTP request must carry ``Authorization: Bearer <token>``; a refusal is a training-API 401."""
    return BearerAuth(app, token=token, reject=_reject_token)


async def _reject_token(scope: Scope, receive: Receive, send: Send, token_given: bool) -> None:
    message = ("the token is not valid for this server: use the one `art-core serve --token` was started with"
               if token_given else "no token given: send 'Authorization: Bearer <token>' (RemoteBackend(url, "
               "token=...) or ART_SERVER_TOKEN)")
    await _drain(receive)
    await send_error(send, 401, "AuthenticationError", message, headers={"WWW-Authenticate": "Bearer"})


class TrainingBody:
    """For the training API: refuse bodies over ``max_bytes`` (413), inflate ``Content-Encoding: gzip``
    (up to ``max_bytes`` inflated, so a small bomb cannot blow up memory), and hand the routes the plain body."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX) or scope["method"] == "GET":
            return await self.app(scope, receive, send)
        declared = header_value(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _drain(receive)
            return await self._too_large(send, declared.decode("latin-1")[:40])
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _drain(receive)
                return await self._too_large(send, f"more than {self.max_bytes}")
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        encoding = (header_value(scope, b"content-encoding") or b"identity").strip().lower()
        if encoding == b"gzip":
            inflater = zlib.decompressobj(wbits=31)
            try:
                body = inflater.decompress(body, self.max_bytes + 1)
            except zlib.error as exc:
                return await send_error(send, 400, "ConfigError",
                                        f"the body says Content-Encoding: gzip but does not inflate: {exc}")
            if len(body) > self.max_bytes or inflater.unconsumed_tail:
                return await self._too_large(send, f"more than {self.max_bytes} once inflated")
        elif encoding != b"identity":
            return await send_error(send, 415, "ConfigError",
                                    f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: "
                                    "send gzip or no encoding")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the real channel, which reports a disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: str) -> None:
        await send_error(send, 413, "ConfigError",
                         f"the request body is {size} bytes, above this server's limit of {self.max_bytes}: send "
                         "fewer groups per train call, or start the server with a larger --max-body-mb")


async def _drain(receive: Receive, limit: int = 64 * 1024 * 1024) -> Any:
    """Read and drop the rest of a refused request's body (bounded), so the client sees the answer rather than
    a reset connection."""
    drained = 0
    while drained < limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
