"""The FastAPI application: routers per resource, the engine started in `lifespan`.

`create_app(engine)` serves an already built `LLMEngine` (tests, the demo);
`create_app_from_settings(settings)` builds the engine inside lifespan (the CLI), off the
event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ..engine import AsyncEngine, LLMEngine, freeze_start_up_objects
from ..settings import ServerSettings
from . import adapter_cache, adapters, chat, completions, health, models, tokenize
from .auth import APIKeys, Authenticate
from .body_limit import BodyLimit
from .errors import install_error_handlers

log = logging.getLogger(__name__)


def _build_app(lifespan, settings: ServerSettings | None) -> FastAPI:
    app = FastAPI(title="loraplex", summary="OpenAI-compatible multi-LoRA server", lifespan=lifespan)
    app.state.engine = None
    max_request_bytes = settings.max_request_bytes if settings is not None else ServerSettings.max_request_bytes
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    # Outermost: a request without a key is refused before its body is read.
    app.add_middleware(Authenticate, keys=APIKeys.from_settings(settings) if settings is not None else APIKeys())
    install_error_handlers(app)
    for module in (completions, chat, models, adapters, adapter_cache, tokenize, health):
        app.include_router(module.router)
    return app


def create_app(engine: LLMEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine = AsyncEngine(engine)
        async_engine.start()
        app.state.engine = async_engine
        try:
            yield
        finally:
            async_engine.stop()

    # (engine None: the routes alone, for a look at them; its lifespan is never run)
    return _build_app(lifespan, engine.settings if engine is not None else None)


def create_app_from_settings(settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await asyncio.to_thread(LLMEngine.from_settings, settings)
        freeze_start_up_objects()  # what start-up made lives on: no collection walks it again
        async_engine = AsyncEngine(engine)
        async_engine.start()
        app.state.engine = async_engine
        log.info("serving %s with adapters %s", engine.model_name,
                 [e.id.name for e in engine.adapters.list()] or "none")
        try:
            yield
        finally:
            async_engine.stop()

    return _build_app(lifespan, settings)
