"""Server-sent events for streaming responses: `data: {json}\n\n` per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ..engine import EngineStoppedError, RequestFailedError
from .errors import error_body

log = logging.getLogger(__name__)


def sse_event(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_response(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Stream `chunks` as SSE. When the client disconnects, Starlette cancels this generator;
    the cancellation reaches the engine's `generate`, which aborts the request and frees its row."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse_event(chunk)
        except RequestFailedError as e:  # the status line is sent: the error goes in the stream
            yield sse_event(error_body(e.status, str(e), code=e.code))
        except EngineStoppedError as e:
            yield sse_event(error_body(503, str(e), type="service_unavailable", code="engine_stopped"))
        except Exception as e:  # e.g. the engine stopped: an error event, not a cut connection
            log.exception("stream failed")
            yield sse_event(error_body(500, f"internal error: {e}"))
        yield sse_event("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
