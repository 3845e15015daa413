"""GET /v1/models: the base model and every known adapter, in any cache tier (adapters name the
base as parent; rank and target modules once their files have been read)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..engine import AsyncEngine
from .deps import get_engine
from .schemas import now

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(engine: AsyncEngine = Depends(get_engine)) -> dict:
    eng = engine.engine
    created = now()
    base = {"id": eng.model_name, "object": "model", "created": created, "owned_by": "loraplex",
            "root": eng.settings.model or eng.model_name, "parent": None, "max_model_len": eng.max_model_len}
    # Every adapter a request may name, in any tier (a request for one off the GPU loads it).
    adapters = [{"id": e.name, "object": "model", "created": created, "owned_by": "loraplex",
                 "root": e.id.uri if e.id else str(e.path or e.source or ""), "parent": eng.model_name,
                 "max_model_len": eng.max_model_len, "rank": e.spec.max_rank if e.spec else None,
                 "target_modules": list(e.spec.target_modules) if e.spec else None}
                for e in sorted(eng.adapters.known(), key=lambda e: e.name)]
    return {"object": "list", "data": [base] + adapters}
