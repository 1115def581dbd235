"""One bearer-token check, used by the gateway (its ``api_key``) and by ``art-core serve`` (its ``--token``).

Each caller renders its own 401 body (the gateway answers OpenAI-shaped errors, the server the training API's),
so the check takes a ``reject`` callable instead of knowing either shape.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["BearerAuth", "Reject", "header_value"]

# reject(scope, receive, send, token_given): answer the refused request; token_given is False when the request
# carried no Authorization header at all, so the message can say "send one" rather than "wrong token".
Reject = Callable[[Scope, Receive, Send, bool], Awaitable[None]]


class BearerAuth:
    """Every HTTP request must carry ``Authorization: Bearer <token>``, compared in constant time.

    Args:
        app: the ASGI app behind the check.
        token: the one accepted token.
        reject: answers a refused request (see ``Reject``); it should send ``WWW-Authenticate: Bearer``.
    """

    def __init__(self, app: ASGIApp, *, token: str, reject: Reject) -> None:
        self.app, self.token, self.reject = app, token.encode(), reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = header_value(scope, b"authorization")
        scheme, _, given = (header or b"").partition(b" ")
        # compare_digest always, even on a wrong scheme, so timing tells nothing about the token.
        ok = hmac.compare_digest(given.strip(), self.token)
        if ok and scheme.lower() == b"bearer":
            return await self.app(scope, receive, send)
        await self.reject(scope, receive, send, header is not None)


def header_value(scope: Scope, name: bytes) -> bytes | None:
    """The first value of the (lower-case) header ``name`` in an ASGI scope, or None."""
    for key, value in scope["headers"]:
        if key == name:
            found: bytes = value
            return found
    return None
