"""The adapter cache over HTTP: tiers, pins, prefetch and session starts.

    GET  /v1/adapters                      every known adapter: tier (gpu/host/disk/source),
                                           state, pinned, leases, rank, bytes, hits; plus the slot counts
    POST /v1/adapters/{name}/pin           pin (never evicted) and load; 200 at once
    POST /v1/adapters/{name}/unpin
    POST /v1/adapters/{name}/prefetch      200 once resident; ?wait=false: 202 at once
    POST /v1/sessions {"model": name}      a session starts: prefetch its adapter through every
                                           tier and answer once resident, so the first request hits:
                                           the adapter is leased resident until that request comes
                                           (or --session-lease-seconds pass; `leases` in the listing)

Adapter names hold no slash (the name rules refuse one at load), but the routes take the whole
path between /v1/adapters/ and the action as the name: a request naming "acme/sql-lora" is
answered 404 model_not_found in the OpenAI error shape, not with a bare routing 404.

The node agent calls prefetch (?wait=false) and pin when it warms a server (node_agent/warmer.py).
With API keys (api/auth.py), a tenant's key lists, prefetches and starts sessions of the
adapters it may use only (any other is a 404 to it); pin and unpin need an admin key.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import Field

from ..adapter_sources import AdapterLoadError
from ..engine import AsyncEngine
from ..slot_table import AdapterUnloaded
from .auth import Caller, get_caller, require_admin
from .deps import get_engine
from .errors import APIError, model_not_found
from .schemas import RequestBody

router = APIRouter(tags=["adapter cache"])


class SessionRequest(RequestBody):
    model: str = Field(min_length=1)


async def _row(engine: AsyncEngine, name: str) -> dict:
    """`name`'s row of GET /v1/adapters, described on a worker thread: `describe` stats
    every folder of the node's cache, which would stall every stream on the event loop."""
    for row in await asyncio.to_thread(engine.engine.adapters.describe):
        if row["name"] == name:
            return row
    raise model_not_found(name)


def _check_visible(engine: AsyncEngine, name: str, caller: Caller) -> None:
    """A 404, as for an unknown name, for an adapter of another tenant than the caller's."""
    if not caller.may_use(engine.engine.adapters.tenant_of(name)):
        raise model_not_found(name)


async def _wait_resident(engine: AsyncEngine, name: str, timeout: float, session: bool = False) -> None:
    cache = engine.engine.adapters
    try:
        fut = cache.start_session(name) if session else cache.prefetch(name)
    except KeyError:
        raise model_not_found(name) from None
    try:
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
    except AdapterUnloaded:  # no load failed: the adapter is gone, as every later call finds it
        raise APIError(404, f"The model `{name}` does not exist: adapter {name!r} was unloaded before it "
                            f"was loaded.", param="model", code="model_not_found") from None
    except AdapterLoadError as e:
        raise APIError(500, str(e), code="adapter_load_failed") from None
    except asyncio.TimeoutError:
        raise APIError(503, f"adapter {name!r} is not resident after {timeout:g}s (every slot is pinned or "
                            f"in use); it stays queued for a slot", type="service_unavailable",
                       code="adapter_load_timeout") from None


@router.get("/v1/adapters")
async def list_adapters(engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)) -> dict:
    cache = engine.engine.adapters
    rows = [row for row in await asyncio.to_thread(cache.describe) if caller.may_use(row["tenant"])]
    return {"object": "list", "data": rows, "slots": cache.buffers.num_slots, "free_slots": cache.num_free,
            "loads_in_flight": cache.in_flight, "max_concurrent_loads": cache.max_concurrent_loads,
            "host_bytes": cache.host.used_bytes, "host_capacity_bytes": cache.host.capacity_bytes,
            "eviction_policy": cache.policy.name}


@router.post("/v1/adapters/{name:path}/pin")
async def pin(name: str, engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)) -> dict:
    require_admin(caller, "pinning an adapter")
    try:
        engine.engine.adapters.pin(name)
    except KeyError:
        raise model_not_found(name) from None
    return await _row(engine, name)


@router.post("/v1/adapters/{name:path}/unpin")
async def unpin(name: str, engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)) -> dict:
    require_admin(caller, "unpinning an adapter")
    try:
        engine.engine.adapters.unpin(name)
    except KeyError:
        raise model_not_found(name) from None
    return await _row(engine, name)


@router.post("/v1/adapters/{name:path}/prefetch")
async def prefetch(name: str, wait: bool = Query(True, description="answer once resident (false: at once)"),
                   timeout: float = Query(120.0, gt=0, description="seconds to wait for residency"),
                   engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)):
    _check_visible(engine, name, caller)
    if not wait:
        try:
            engine.engine.adapters.prefetch(name)
        except KeyError:
            raise model_not_found(name) from None
        return JSONResponse(await _row(engine, name), status_code=202)
    await _wait_resident(engine, name, timeout)
    return await _row(engine, name)


@router.post("/v1/sessions")
async def start_session(body: SessionRequest, timeout: float = Query(120.0, gt=0),
                        engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)) -> dict:
    session = {"id": f"sess-{uuid.uuid4().hex}", "object": "session", "model": body.model}
    if body.model == engine.engine.model_name:
        return {**session, "tier": "gpu", "adapter": None}
    _check_visible(engine, body.model, caller)
    await _wait_resident(engine, body.model, timeout, session=True)
    row = await _row(engine, body.model)
    return {**session, "tier": row["tier"], "adapter": row}
