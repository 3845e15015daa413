"""A bound on request bodies, checked before the app reads one whole.

FastAPI reads a JSON body into memory in one piece before validating it, so one client
sending gigabytes (a chunked upload that never ends, or a huge Content-Length) would take the
server's memory from every tenant. Bodies past `--max-request-bytes` are refused with a 413 in
the OpenAI error shape: at once when the Content-Length says so, else as the chunks arrive
(the body is gathered here up to the bound, then handed to the app as one message).
"""

from __future__ import annotations

import json

from .errors import error_body


class BodyLimit:
    """Pure ASGI middleware: `app.add_middleware(BodyLimit, max_bytes=N)`."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, int(length))
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was sent
                return await self.app(scope, _replay([message], receive), send)
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.max_bytes:
                return await self._refuse(send, None)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, send, length: int | None) -> None:
        said = f"{length} bytes" if length is not None else "more bytes"
        body = json.dumps(error_body(413, f"The request body has {said} than the server takes "
                                          f"(--max-request-bytes {self.max_bytes}).",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive):
    """A receive() that gives `messages` first, then the connection's own (its disconnect,
    which streaming responses wait for)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
