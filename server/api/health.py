"""/healthz (the engine thread is alive), /readyz (the model is loaded and serving), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

# The body is the 0.0.4 text format (EngineMetrics.render: generate_latest, legacy names), and
# 0.0.4 is what prometheus-client serves itself unless a scraper asks for more. Its
# CONTENT_TYPE_LATEST is now version=1.0.0, which no Prometheus 2 scraper nor the endpoint
# picker asked for (and which, without an escaping parameter, the library never sends).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    engine = getattr(request.app.state, "engine", None)
    if engine is not None and engine.error is not None:
        return JSONResponse({"status": "error", "error": repr(engine.error)}, status_code=503)
    if engine is not None and not engine.running:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    engine = getattr(request.app.state, "engine", None)
    if engine is None or not engine.running or engine.error is not None:
        return JSONResponse({"status": "not ready"}, status_code=503)
    return JSONResponse({"status": "ready", "model": engine.engine.model_name})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = request.app.state.engine
    eng = engine.engine
    if engine.running:
        await engine.call(lambda: eng.metrics.refresh(eng))
    return Response(eng.metrics.render(), media_type=CONTENT_TYPE)
