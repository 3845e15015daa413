"""GET /v1/models: the base model and every known adapter, in any cache tier (adapters name the
base as parent; rank and target modules once their files have been read).
GET /v1/models/{model}: one of them (the official client's `models.retrieve`), or a 404.
A tenant's API key sees the base and the adapters it may use only (api/auth.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..engine import AsyncEngine
from .auth import Caller, get_caller
from .deps import get_engine
from .errors import model_not_found
from .schemas import now

router = APIRouter(tags=["models"])


def _cards(engine: AsyncEngine, caller: Caller) -> list[dict]:
    eng = engine.engine
    created = now()
    base = {"id": eng.model_name, "object": "model", "created": created, "owned_by": "loraplex",
            "root": eng.settings.model or eng.model_name, "parent": None, "max_model_len": eng.max_model_len}
    # Every adapter a request may name, in any tier (a request for one off the GPU loads it).
    adapters = [{"id": e.name, "object": "model", "created": created, "owned_by": "loraplex",
                 "root": e.id.uri if e.id else str(e.path or e.source or ""), "parent": eng.model_name,
                 "max_model_len": eng.max_model_len, "rank": e.spec.max_rank if e.spec else None,
                 "target_modules": list(e.spec.target_modules) if e.spec else None}
                for e in sorted(eng.adapters.known(), key=lambda e: e.name)
                if caller.may_use(eng.adapters.tenant_of(e.name))]
    return [base] + adapters


@router.get("/v1/models")
async def list_models(engine: AsyncEngine = Depends(get_engine), caller: Caller = Depends(get_caller)) -> dict:
    return {"object": "list", "data": _cards(engine, caller)}


@router.get("/v1/models/{model:path}")  # an adapter's name may hold slashes ("acme/sql-lora")
async def retrieve_model(model: str, engine: AsyncEngine = Depends(get_engine),
                         caller: Caller = Depends(get_caller)) -> dict:
    for card in _cards(engine, caller):
        if card["id"] == model:
            return card
    raise model_not_found(model)
