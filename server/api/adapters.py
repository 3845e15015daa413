"""Adapter admin, as vLLM's: POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}. A refused adapter gets a 400 whose message says
which part does not fit and why, a path that holds no adapter a 404 (as vLLM answers "No
adapter found"); the server keeps serving everything else. With API keys both need an admin
key (api/auth.py)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from ..adapter_cache import AdapterExistsError, AdapterPinnedError
from ..adapter_format import AdapterError, AdapterNotFoundError
from ..adapter_names import InvalidAdapterName, check_adapter_name
from ..engine import AsyncEngine
from .auth import get_caller, require_admin
from .deps import get_engine
from .errors import APIError
from .schemas import LoadAdapterRequest, UnloadAdapterRequest

log = logging.getLogger(__name__)
router = APIRouter(tags=["adapters"])


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadAdapterRequest, request: Request,
                            engine: AsyncEngine = Depends(get_engine)) -> PlainTextResponse:
    require_admin(get_caller(request), "load_lora_adapter")
    try:
        check_adapter_name(body.lora_name)
    except InvalidAdapterName as e:
        raise APIError(400, str(e), param="lora_name", code="invalid_adapter_name") from None
    if body.lora_name == engine.engine.model_name:
        raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
    if engine.engine.adapters.has(body.lora_name):  # (load checks again, under the cache's lock)
        raise APIError(400, f"The lora adapter '{body.lora_name}' is already loaded.", param="lora_name",
                       code="adapter_exists")
    try:
        slot = await engine.load_adapter(body.lora_name, body.lora_path)
    except AdapterExistsError as e:  # the name, not the path: not an adapter that does not fit
        raise APIError(400, str(e), param="lora_name", code="adapter_exists") from None
    except AdapterNotFoundError as e:
        raise APIError(404, f"No adapter found for {body.lora_name!r} at {body.lora_path}: {e}",
                       param="lora_path", code="adapter_not_found") from None
    except AdapterError as e:
        log.warning("adapter %s refused: %s", body.lora_name, e)
        raise APIError(400, f"adapter {body.lora_name!r} refused: {e}", param="lora_path",
                       code="adapter_refused") from None
    except OSError as e:
        raise APIError(400, f"adapter {body.lora_name!r}: cannot read {body.lora_path}: {e}",
                       param="lora_path") from None
    log.info("adapter %s from %s in slot %d", body.lora_name, body.lora_path, slot)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request,
                              engine: AsyncEngine = Depends(get_engine)) -> PlainTextResponse:
    require_admin(get_caller(request), "unload_lora_adapter")
    cache = engine.engine.adapters
    try:
        # On the engine thread, between steps, as AsyncEngine.unload_adapter; a pinned adapter
        # is refused (409) rather than unloaded with its pin, which it would silently lose (a
        # plan's pin until the plan changed): a pin means "keep it resident".
        await engine.call(lambda: cache.unload(body.lora_name, refuse_pinned=True))
    except AdapterPinnedError as e:
        raise APIError(409, str(e), param="lora_name", code="adapter_pinned") from None
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
