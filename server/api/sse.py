"""Server-sent events for streaming responses: `data: {json}\n\n` per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse


def sse_event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Stream `chunks` as SSE. When the client disconnects, Starlette cancels this generator;
    the cancellation reaches the engine's `generate`, which aborts the request and frees its row."""

    async def body() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield sse_event(chunk)
        yield sse_event("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
