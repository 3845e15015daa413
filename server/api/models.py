"""GET /v1/models: the base model and every loaded adapter (adapters name the base as parent)."""

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
    adapters = [{"id": e.id.name, "object": "model", "created": created, "owned_by": "loraplex",
                 "root": e.id.uri, "parent": eng.model_name, "max_model_len": eng.max_model_len,
                 "rank": e.spec.max_rank, "target_modules": list(e.spec.target_modules)}
                for e in sorted(eng.adapters.list(), key=lambda e: e.id.name)]
    return {"object": "list", "data": [base] + adapters}
