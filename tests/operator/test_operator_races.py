"""Races between the operator and quick hands, made deterministic by holding one request in
the emulator until the test has done its move.

An adapter is in kopf's index (and so in the plans of other adapters' reconciles) from its
first event, before kopf has put the operator's finalizer on it. Deleted in that window it
goes at once, without the finalizer's handler: the plan must still lose it."""

from __future__ import annotations

import asyncio
import json

import pytest

from loraplex.operator.kube import ADAPTERS, BASE_MODELS

from .test_operator_e2e import NS, adapter_body, base_body, plan_of

FINALIZER = "loraplex.io/operator"


def hold_finalizer_patch(emulator, monkeypatch, name: str) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold kopf's PATCH that puts the finalizer on adapter `name` until `release` is set;
    `held` is set once it is held. (kmock binds its handlers at start, so the hold wraps the
    emulator's `__call__`, which aiohttp looks up on the class at every request.)"""
    held, release = asyncio.Event(), asyncio.Event()
    original = type(emulator).__call__

    async def call(self, raw_request):
        if raw_request.method == "PATCH" and raw_request.path == ADAPTERS.path(NS, name) and not release.is_set():
            body = await raw_request.read()
            if FINALIZER in json.dumps(json.loads(body or b"null")):
                held.set()
                await release.wait()
        return await original(self, raw_request)

    monkeypatch.setattr(type(emulator), "__call__", call)
    return held, release


async def _planned(api, names: list[str]):
    plan = await plan_of(api)
    return plan if plan and [a["name"] for a in plan["adapters"]] == names else None


@pytest.mark.timeout(60)
async def test_an_adapter_deleted_before_its_finalizer_is_on_leaves_the_plan(api, emulator, operator,
                                                                             eventually_, settled, monkeypatch):
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("a", 10))
    await eventually_(lambda: _planned(api, ["a"]), what="a plan with a")

    held, release = hold_finalizer_patch(emulator, monkeypatch, "x")
    await api.create(ADAPTERS.path(NS), adapter_body("x", 5))
    await asyncio.wait_for(held.wait(), 10)  # x is indexed; its finalizer is not on yet
    await api.merge_patch(ADAPTERS.path(NS, "a"), {"spec": {"priority": 20}})  # a's reconcile plans x too
    await eventually_(lambda: _planned(api, ["a", "x"]), what="x planned before its finalizer is on")
    await settled()  # a's handlers done: no reconcile is left that would drop x by chance

    await api._request("DELETE", ADAPTERS.path(NS, "x"))  # no finalizer: gone at once
    assert await api.get(ADAPTERS.path(NS, "x")) is None
    release.set()  # kopf's finalizer patch now finds it gone (404)
    await eventually_(lambda: _planned(api, ["a"]), timeout=10, what="x out of the plan")
