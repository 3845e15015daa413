"""The planner's writes at scale: 10,000 adapters, one change, only what it moves is written.

The API client is replaced by a recorder with the same two methods the planner calls
(`ensure`, `patch_status`), so the test counts writes; the e2e tests do the same over HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import time
from typing import Any

from loraplex.operator.reconciler import AdapterRecord, BaseRecord, Planner
from loraplex.operator.workloads import read_plan

NOW = datetime.datetime(2026, 12, 1, 8, 0, tzinfo=datetime.timezone.utc)
KEY = ("ml", "llama-3-8b")


class Recorder:
    """Writes land here: ConfigMaps by name, statuses by (plural, name)."""

    def __init__(self) -> None:
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.ensures = 0
        self.status_patches: list[tuple[str, str]] = []
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}

    async def ensure(self, desired: dict[str, Any]) -> str:
        await asyncio.sleep(0)  # a request: other tasks run meanwhile
        self.ensures += 1
        name = desired["metadata"]["name"]
        outcome = "unchanged" if self.config_maps.get(name) == desired else "patched"
        self.config_maps[name] = desired
        return outcome

    async def patch_status(self, resource: Any, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        self.status_patches.append((resource.plural, name))
        self.statuses[(resource.plural, name)] = {**self.statuses.get((resource.plural, name), {}), **status}
        return {}


def base_record(status: dict[str, Any] | None = None) -> BaseRecord:
    return BaseRecord.from_body({
        "metadata": {"name": "llama-3-8b", "namespace": "ml", "uid": "base-uid", "generation": 1},
        "spec": {"source": "s3://m/llama", "maxLoraRank": 16, "memory": {"slots": 2000}, "pinnedPercent": 10},
        "status": status or {}})


def adapter_record(i: int, priority: int, status: dict[str, Any] | None = None) -> AdapterRecord:
    return AdapterRecord.from_body({
        "metadata": {"name": f"adapter-{i:05d}", "namespace": "ml", "uid": f"uid-{i}", "generation": 1},
        "spec": {"baseModel": "llama-3-8b", "source": f"s3://a/{i}", "tenant": f"t{i % 50}", "priority": priority,
                 "rank": 8, "targetModules": ["q_proj", "v_proj"]},
        "status": status or {}})


class Pool:
    """The kopf indices as the planner sees them, updated as the API would echo writes back."""

    def __init__(self, n: int) -> None:
        self.priorities = {i: (i * 7919) % 1000 for i in range(n)}
        self.recorder = Recorder()

    def indices(self) -> tuple[dict, dict]:
        statuses = self.recorder.statuses
        adapters = [adapter_record(i, p, statuses.get(("loraadapters", f"adapter-{i:05d}")))
                    for i, p in self.priorities.items()]
        return {KEY: [base_record(statuses.get(("basemodels", "llama-3-8b")))]}, {KEY: adapters}


async def test_one_change_in_ten_thousand_writes_only_what_it_moves():
    pool = Pool(10_000)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    start = time.perf_counter()
    plan = await planner.reconcile(KEY, *pool.indices())
    first_run = time.perf_counter() - start
    assert plan is not None and len(plan.adapters) == 10_000 and len(plan.pinning.pinned) == 200
    assert len(pool.recorder.status_patches) == 10_001  # every adapter once, the base once
    assert first_run < 10, f"first plan of 10,000 adapters took {first_run:.2f}s"

    # The index catches up; a re-run writes nothing at all.
    pool.recorder.status_patches.clear()
    basemodels, adapters = pool.indices()
    planner.forget_written(KEY)
    await planner.reconcile(KEY, basemodels, adapters)
    assert pool.recorder.status_patches == []

    # An unpinned adapter's priority moves but stays below the cut: the plan changes, no status does.
    pinned_before = set(plan.pinning.pinned)
    low = next(i for i in range(10_000) if f"adapter-{i:05d}" not in pinned_before and pool.priorities[i] < 500)
    pool.priorities[low] += 1
    start = time.perf_counter()
    plan = await planner.reconcile(KEY, *pool.indices())
    assert time.perf_counter() - start < 2.0
    assert pool.recorder.status_patches == []
    cm = pool.recorder.config_maps["llama-3-8b-plan"]
    assert cm["metadata"]["annotations"]["loraplex.io/plan-encoding"] == "gzip"  # 10,000 adapters: > 1 MB of JSON
    doc = read_plan(cm)
    assert next(a for a in doc["adapters"] if a["name"] == f"adapter-{low:05d}")["priority"] == pool.priorities[low]

    # Raising it to the top pins it and unpins the last one in: two adapters and the base.
    pool.priorities[low] = 10_000
    plan = await planner.reconcile(KEY, *pool.indices())
    moved = sorted(pinned_before ^ set(plan.pinning.pinned))
    assert len(moved) == 2 and f"adapter-{low:05d}" in moved
    assert sorted(pool.recorder.status_patches) == sorted(
        [("loraadapters", name) for name in moved] + [("basemodels", "llama-3-8b")])


async def test_concurrent_requests_coalesce_into_few_runs():
    pool = Pool(500)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    basemodels, adapters = pool.indices()
    await asyncio.gather(*(planner.reconcile(KEY, basemodels, adapters) for _ in range(200)))
    # One run, plus one for the requests made while it ran; never one per request.
    assert planner.state(KEY).runs <= 2 and pool.recorder.ensures == 1
    assert len(pool.recorder.status_patches) == 501


async def test_orphans_wait_for_their_base():
    pool = Pool(3)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    _, adapters = pool.indices()
    assert await planner.reconcile(KEY, {}, adapters) is None
    assert pool.recorder.config_maps == {}
    status = pool.recorder.statuses[("loraadapters", "adapter-00000")]
    assert status["phase"] == "Pending" and status["conditions"][0]["reason"] == "BaseModelNotFound"


async def test_adapters_of_an_invalid_base_say_so():
    pool = Pool(2)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    _, adapters = pool.indices()
    broken = BaseRecord.from_body({"metadata": {"name": "llama-3-8b", "namespace": "ml", "uid": "b"},
                                   "spec": {"source": "/m", "maxLoraRank": 8, "dtype": "int4"}})
    assert broken.spec is None and "int4" in (broken.error or "")
    await planner.reconcile(KEY, {KEY: [broken]}, adapters)
    status = pool.recorder.statuses[("loraadapters", "adapter-00001")]
    assert status["conditions"][0]["reason"] == "BaseModelInvalid" and "int4" in status["conditions"][0]["message"]
    assert pool.recorder.config_maps == {}


def test_records_read_rank_from_a_local_adapter(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    record = AdapterRecord.from_body({"metadata": {"name": "x", "namespace": "ml", "uid": "u"},
                                      "spec": {"baseModel": "b", "source": f"file://{tmp_path}"}})
    assert record.spec is not None and (record.spec.rank, record.spec.target_modules) == (4, ("q_proj",))
    broken = AdapterRecord.from_body({"metadata": {"name": "y"}, "spec": {"source": "s3://x"}})
    assert broken.spec is None and "baseModel" in (broken.error or "")


async def test_a_run_on_an_index_behind_its_own_writes_moves_no_transition_time():
    """kopf updates an adapter's index entry only once its handler returns, and that handler
    waits for the run: so the run after the one that wrote a status may still see the object
    without it. It recomputed every condition from the index and wrote each status again,
    every lastTransitionTime moved to its own start though no condition's status changed."""
    pool = Pool(3)
    now = [NOW]
    planner = Planner(pool.recorder, clock=lambda: now[0])  # type: ignore[arg-type]
    basemodels, adapters = pool.indices()  # as the index holds them: no status yet
    await planner.reconcile(KEY, basemodels, adapters)
    written = copy.deepcopy(pool.recorder.statuses)
    pool.recorder.status_patches.clear()

    now[0] = NOW + datetime.timedelta(seconds=5)
    await planner.reconcile(KEY, basemodels, adapters)  # the index has not caught up
    assert pool.recorder.status_patches == []
    assert pool.recorder.statuses == written

    # A status that does change still moves its time: the base's Ready, once servers are ready.
    planner.set_ready_replicas(KEY, 1)
    await planner.reconcile(KEY, basemodels, adapters)
    ready = {c["type"]: c for c in pool.recorder.statuses[("basemodels", "llama-3-8b")]["conditions"]}
    assert (ready["Ready"]["status"], ready["Ready"]["lastTransitionTime"]) == ("True", "2026-12-01T08:00:05Z")
    assert ready["Accepted"]["lastTransitionTime"] == "2026-12-01T08:00:00Z"


async def test_a_base_change_on_an_index_behind_its_writes_warns_once(monkeypatch):
    """A BaseModel's create or update handler forgets what was written, so that the run after
    it compares with the API again; the run before it may have written an adapter's status
    that the index does not hold yet. That adapter was then taken for one just rejected: a
    second Warning event, and a new lastTransitionTime on conditions that had not changed."""
    from loraplex.operator import reconciler

    events: list[dict[str, Any]] = []
    monkeypatch.setattr(reconciler.kopf, "event", lambda ref, **event: events.append(event))
    pool = Pool(0)
    now = [NOW]
    planner = Planner(pool.recorder, clock=lambda: now[0])  # type: ignore[arg-type]
    big = AdapterRecord.from_body({
        "metadata": {"name": "big", "namespace": "ml", "uid": "uid-big", "generation": 1},
        "spec": {"baseModel": "llama-3-8b", "source": "s3://a/big", "rank": 64, "targetModules": ["q_proj"]}})
    basemodels, adapters = {KEY: [base_record()]}, {KEY: [big]}
    await planner.reconcile(KEY, basemodels, adapters)
    first = copy.deepcopy(pool.recorder.statuses[("loraadapters", "big")])
    assert first["phase"] == "Rejected" and [e["reason"] for e in events] == ["RankTooLarge"]

    now[0] = NOW + datetime.timedelta(seconds=5)
    planner.forget_written(KEY)  # the BaseModel's handler ran
    await planner.reconcile(KEY, basemodels, adapters)  # the index has not caught up
    assert [e["reason"] for e in events] == ["RankTooLarge"]
    assert pool.recorder.statuses[("loraadapters", "big")]["conditions"] == first["conditions"]


async def test_an_adapter_config_that_appears_later_is_read_at_the_next_run(tmp_path):
    """A file:// adapter applied before its files are copied is Pending (MetadataUnknown); the
    index read its adapter_config.json at its event alone, so it stayed Pending, through every
    resync, until its object changed."""
    pool = Pool(0)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    record = AdapterRecord.from_body({
        "metadata": {"name": "late", "namespace": "ml", "uid": "uid-late", "generation": 1},
        "spec": {"baseModel": "llama-3-8b", "source": f"file://{tmp_path}"}})
    basemodels, adapters = {KEY: [base_record()]}, {KEY: [record]}
    plan = await planner.reconcile(KEY, basemodels, adapters)
    assert plan is not None and plan.verdicts["late"].reason == "MetadataUnknown"

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj", "v_proj"]}))
    planner.forget_written(KEY)  # the resync
    plan = await planner.reconcile(KEY, basemodels, adapters)  # the same index entry
    assert plan is not None and plan.verdicts["late"].accepted and [a.name for a in plan.adapters] == ["late"]
    status = pool.recorder.statuses[("loraadapters", "late")]
    assert (status["phase"], status["rank"], status["targetModules"]) == ("Accepted", 8, ["q_proj", "v_proj"])


async def test_the_bases_rejected_count_counts_adapters_rejected_for_an_invalid_spec():
    """An adapter whose spec is invalid (a warm-up window that ends before it starts, which the
    schema cannot refuse) is Rejected, and names its base; rejectedCount left it out."""
    pool = Pool(1)
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    odd = AdapterRecord.from_body({
        "metadata": {"name": "odd", "namespace": "ml", "uid": "uid-odd", "generation": 1},
        "spec": {"baseModel": "llama-3-8b", "source": "s3://a/odd", "rank": 8, "targetModules": ["q_proj"],
                 "warmup": {"start": "2026-12-02T00:00:00Z", "end": "2026-12-01T00:00:00Z"}}})
    big = AdapterRecord.from_body({
        "metadata": {"name": "big", "namespace": "ml", "uid": "uid-big", "generation": 1},
        "spec": {"baseModel": "llama-3-8b", "source": "s3://a/big", "rank": 64, "targetModules": ["q_proj"]}})
    assert odd.spec is None
    basemodels, adapters = pool.indices()
    await planner.reconcile(KEY, basemodels, {KEY: [*adapters[KEY], odd, big]})
    status = pool.recorder.statuses[("basemodels", "llama-3-8b")]
    assert (status["adapterCount"], status["rejectedCount"]) == (1, 2)


class ReadingRecorder(Recorder):
    """A Recorder that also answers the planner's reads of the ConfigMaps it holds."""

    async def get(self, path: str) -> dict[str, Any] | None:
        await asyncio.sleep(0)
        return self.config_maps.get(path.rsplit("/", 1)[1])


async def test_adapters_tell_the_plan_they_are_served_by_while_the_new_one_is_too_large(monkeypatch):
    """The servers and agents follow the last plan that fit its ConfigMap: an adapter added
    since is not in it, so it is not Accepted (PlanNotWritten) and not pinned, and one pinned
    there reads pinned still, whatever the plan that could not be written says; after a restart
    (nothing known written) the same, from the ConfigMap read back."""
    from loraplex.operator import workloads

    monkeypatch.setattr(workloads, "PLAIN_PLAN_LIMIT", 0)  # every plan gzipped
    pool = Pool(3)  # slots 2000, pinnedPercent 10: every one of these pinned
    pool.recorder = ReadingRecorder()
    planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
    await planner.reconcile(KEY, *pool.indices())
    first = read_plan(pool.recorder.config_maps["llama-3-8b-plan"])
    assert sorted(first["pinned"]) == ["adapter-00000", "adapter-00001", "adapter-00002"]
    size = len(pool.recorder.config_maps["llama-3-8b-plan"]["binaryData"]["plan.json"])
    monkeypatch.setattr(workloads, "CONFIG_MAP_LIMIT", size + 50)  # the 3 fit, 200 more do not

    for i in range(3, 203):
        pool.priorities[i] = 10_000 + i  # above the three: the new plan would pin these instead
    for restarted in (False, True):
        if restarted:
            planner = Planner(pool.recorder, clock=lambda: NOW)  # type: ignore[arg-type]
        plan = await planner.reconcile(KEY, *pool.indices())
        assert plan is not None and "adapter-00000" not in plan.pinning.pinned  # the plan not written
        assert read_plan(pool.recorder.config_maps["llama-3-8b-plan"]) == first  # the one followed
        statuses = pool.recorder.statuses
        for i in (0, 1, 2):
            status = statuses[("loraadapters", f"adapter-{i:05d}")]
            accepted = {c["type"]: c for c in status["conditions"]}["Accepted"]
            assert status["pinned"] is True and status["phase"] == "Accepted"
            assert accepted["status"] == "True" and "PlanTooLarge" in accepted["message"]
        for i in (3, 202):
            status = statuses[("loraadapters", f"adapter-{i:05d}")]
            conditions = {c["type"]: c for c in status["conditions"]}
            assert status["pinned"] is False and status["phase"] == "Pending"
            assert (conditions["Accepted"]["status"], conditions["Accepted"]["reason"]) == ("False", "PlanNotWritten")
            assert "a ConfigMap holds" in conditions["Accepted"]["message"]
            assert conditions["Ready"]["reason"] == "PlanNotWritten"
        base = statuses[("basemodels", "llama-3-8b")]
        assert base["phase"] == "Failed"

    # Room again: the plan is written and the statuses are the plan's.
    monkeypatch.setattr(workloads, "CONFIG_MAP_LIMIT", 1_000_000)
    plan = await planner.reconcile(KEY, *pool.indices())
    new = pool.recorder.statuses[("loraadapters", "adapter-00202")]
    assert new["pinned"] is True and new["phase"] == "Accepted"
    assert pool.recorder.statuses[("loraadapters", "adapter-00000")]["pinned"] is False
