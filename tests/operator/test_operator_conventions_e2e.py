"""The operator end to end, as a user of a Kubernetes operator expects it to behave: events,
conditions, deletion, ownership. kopf in-process against the emulated API (emulator.py)."""

from __future__ import annotations

from typing import Any

from loraplex.operator.kube import ADAPTERS, BASE_MODELS, Resource

from .test_operator_e2e import NS, adapter_body, base_body, plan_of

EVENTS = Resource("", "v1", "events")


async def _events_of(api: Any, name: str) -> list[dict[str, Any]]:
    listing = await api.get(EVENTS.path(NS))
    return [e for e in listing["items"] if e["involvedObject"]["name"] == name]


async def test_a_failing_handler_leaves_a_warning_event_on_its_object(api, operator, eventually_):
    """`kubectl describe loraadapter odd` shows why it was refused, not only its status."""
    await api.create(BASE_MODELS.path(NS), base_body())
    await api.create(ADAPTERS.path(NS), adapter_body("odd", 1, pinPolicy="Sometimes"))
    await api.create(ADAPTERS.path(NS), adapter_body("fine", 1))

    async def warned():
        return [e for e in await _events_of(api, "odd") if e["type"] in ("Warning", "Error")]
    (event, *_) = await eventually_(warned, what="a Warning event on odd")
    assert "pinPolicy 'Sometimes'" in event["message"]
    assert event["involvedObject"]["kind"] == "LoRAAdapter"
    await eventually_(lambda: plan_of(api), what="a plan")
    assert await _events_of(api, "fine") == []  # a success is not worth an event
