"""The warmer: plan parsing and reload, staging order, server warm-up, pod discovery."""

from __future__ import annotations

import asyncio
import base64
import datetime
import gzip
import json
import os
from pathlib import Path

import pytest

from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.tasks import TaskGuard
from loraplex.node_agent.kube import KubeAPI, KubePods, PlanConfigMap, StatusReporter
from loraplex.node_agent.warmer import PlanError, StaticServers, Warmer, parse_plan

from .helpers import T0, ConfigMapDir, plan_json, reporting_warmer


class FakeNow:
    def __init__(self, t: datetime.datetime = T0) -> None:
        self.t = t

    def __call__(self) -> datetime.datetime:
        return self.t


PLANS = [
    ({"baseModel": "b", "adapters": [], "pinned": []}, None),
    ({"baseModel": "b", "slots": 4, "pinned": ["a"],
      "adapters": [{"name": "a", "source": "/x", "sha256": "0" * 64, "pinned": True}],
      "prefetch": [{"name": "a", "start": "2026-05-01T08:00:00Z", "end": "2026-05-02T08:00:00+00:00"}]}, None),
    ({"adapters": []}, "baseModel"),
    ({"baseModel": "b", "pinned": ["zz"], "adapters": []}, "not in the plan"),
    ({"baseModel": "b", "adapters": [{"name": "a", "sha256": "0" * 64}]}, "source"),
    ({"baseModel": "b", "prefetch": [{"name": "a", "start": "soon", "end": "later"}]}, "malformed"),
    ({"baseModel": "b", "prefetch": [{"name": "a", "start": "2026-05-01T08:00:00", "end": "2026-05-01T09:00:00"}]},
     "UTC offset"),
    ([1, 2], "not a JSON object"),
    ({"baseModel": "b", "dtype": "int8", "adapters": []}, "dtype"),
]


@pytest.mark.parametrize("data,problem", PLANS)
def test_parse_plan(data, problem):
    if problem is None:
        plan = parse_plan(data)
        assert plan.base_model == "b"
        assert set(plan.pinned) <= set(plan.adapters)
        # The base's dtype goes with every adapter: the store writes a copy of F32 weights in it.
        with_dtype = parse_plan({**data, "dtype": "bfloat16"})
        assert all(a.ref.dtype == "bfloat16" for a in with_dtype.adapters.values())
        assert all(a.ref.dtype is None for a in plan.adapters.values())
    else:
        with pytest.raises(PlanError, match=problem):
            parse_plan(data)


async def test_plan_reload_follows_configmap_swap(tmp_path, object_store, session):
    object_store.add("a", tmp_path)
    object_store.add("b", tmp_path, seed=1)
    cm = ConfigMapDir(tmp_path / "plan")
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session)
    assert await warmer.check_plan() is False and warmer.plan is None  # no file yet
    cm.write(plan_json(object_store, pinned=["a"]))
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("a",)
    assert await warmer.check_plan() is False  # unchanged
    cm.write(plan_json(object_store, pinned=["a"]))  # same content, new file: no new plan
    assert await warmer.check_plan() is False
    cm.write("{not json")
    assert await warmer.check_plan() is False and warmer.plan.pinned == ("a",)  # bad file: keep the last
    cm.write(plan_json(object_store, pinned=["b"], others=["a"]))
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("b",)
    # A large plan arrives gzipped (the operator's binaryData): same file, same plan reader.
    cm.write(gzip.compress(json.dumps(plan_json(object_store, pinned=["a"], others=["b"])).encode()))
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("a",)


async def test_plan_from_the_api(tmp_path, object_store, session, kube_api):
    object_store.add("a", tmp_path)
    object_store.add("b", tmp_path, seed=1)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    source = PlanConfigMap(KubeAPI(kube_api.url, session), "ml", "llama-plan")
    warmer = Warmer(store, source, session)
    assert await warmer.check_plan() is False and warmer.plan is None  # no ConfigMap yet
    kube_api.put_configmap("ml", "llama-plan", {"plan.json": json.dumps(plan_json(object_store, pinned=["a"]))})
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("a",)
    assert await warmer.check_plan() is False  # same resourceVersion
    kube_api.put_configmap("ml", "llama-plan", {"plan.json": json.dumps(plan_json(object_store, pinned=["b"]))})
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("b",)
    packed = base64.b64encode(gzip.compress(json.dumps(plan_json(object_store, pinned=["a"])).encode())).decode()
    kube_api.put_configmap("ml", "llama-plan", {}, binary={"plan.json": packed})
    assert await warmer.check_plan() is True and warmer.plan.pinned == ("a",)
    kube_api.configmaps.clear()  # deleted: keep the last plan
    assert await warmer.check_plan() is False and warmer.plan.pinned == ("a",)


async def _until(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_run_loop_stages_changes_and_removes_dropped(tmp_path, object_store, session):
    for i, n in enumerate("abc"):
        object_store.add(n, tmp_path, seed=i)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["a"], others=["c"]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, poll_seconds=0.05)
    tasks = TaskGuard()
    tasks.spawn(warmer.run(), "plan-watch")
    try:
        await _until(lambda: store.get("a") is not None)
        assert store.get("a").pinned and store.get("c") is None  # c: neither pinned nor prefetched
        cm.write(plan_json(object_store, pinned=["b"]))  # a deleted, b pinned
        await _until(lambda: store.get("b") is not None and store.get("a") is None)
        assert store.get("b").pinned
        assert not os.path.lexists(tmp_path / "cache" / "a")
        assert tasks.crashed == {}
    finally:
        await tasks.close()


async def test_pinned_first_then_the_plans_prefetch_entries(tmp_path, object_store, session):
    """Pins first, then every entry of the plan's prefetch list that has not ended, one that
    starts later too: the operator lists a window `warmupLeadSeconds` before its start, so
    that the campaign's first requests find it on the node and in the servers (it was staged
    only at its start, so the lead bought nothing)."""
    names = ["p1", "p2", "open", "later", "closed"]
    for i, n in enumerate(names):
        object_store.add(n, tmp_path, seed=i)
    now = FakeNow()
    hour = datetime.timedelta(hours=1)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["p1", "p2"], others=["open", "later", "closed"], prefetch=[
        ("open", T0 - hour, T0 + hour), ("later", T0 + 2 * hour, T0 + 3 * hour),
        ("closed", T0 - 3 * hour, T0 - 2 * hour)]))
    store = AdapterStore(tmp_path / "cache", 10**9, 1, session=session)  # one download at a time
    warmer = Warmer(store, cm.path, session, now=now, poll_seconds=0.05)
    tasks = TaskGuard()
    tasks.spawn(warmer.run(), "plan-watch")
    try:
        await _until(lambda: store.get("later") is not None)  # two hours before its start
        assert object_store.order == ["p1", "p2", "open", "later"]
        assert store.get("closed") is None  # ended: not staged
    finally:
        await tasks.close()


async def _staged_warmer(tmp_path, object_store, session, fake_server, now=None):
    for i, n in enumerate(["p1", "p2", "camp", "plain"]):
        object_store.add(n, tmp_path, seed=i)
    cm = ConfigMapDir(tmp_path / "plan")
    hour = datetime.timedelta(hours=1)
    cm.write(plan_json(object_store, pinned=["p1", "p2"], others=["camp", "plain"],
                       prefetch=[("camp", T0 - hour, T0 + hour)]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, now=now or FakeNow(),
                    discovery=StaticServers([fake_server.url], session))
    assert await warmer.check_plan()
    await warmer.reconcile()
    return warmer


async def test_warms_a_server_when_it_turns_ready(tmp_path, object_store, session, fake_server):
    warmer = await _staged_warmer(tmp_path, object_store, session, fake_server)
    assert await warmer.check_servers() == [] and fake_server.calls == []  # not ready yet
    fake_server.ready = True
    assert await warmer.check_servers() == [fake_server.url]
    assert fake_server.calls == [
        ("prefetch", "p1", "wait=false"), ("pin", "p1", ""),
        ("prefetch", "p2", "wait=false"), ("pin", "p2", ""),
        ("prefetch", "camp", "wait=false"),
    ]
    assert await warmer.check_servers() == []  # warmed once per readiness
    fake_server.ready = False  # a restart: warm it again once it is back
    await warmer.check_servers()
    fake_server.ready = True
    assert await warmer.check_servers() == [fake_server.url]
    assert len(fake_server.calls) == 10
    assert warmer.metrics.server_calls.labels("pin", "ok")._value.get() == 4


async def test_server_errors_are_reported_not_raised(tmp_path, object_store, session, fake_server):
    warmer = await _staged_warmer(tmp_path, object_store, session, fake_server)
    fake_server.fail = {("pin", "p2")}
    results = await warmer.warm_server(fake_server.url)
    bad = [r for r in results if not r.ok]
    assert [(r.name, r.action) for r in bad] == [("p2", "pin")] and bad[0].detail.startswith("500")
    assert warmer.metrics.server_calls.labels("pin", "error")._value.get() == 1
    down = await warmer.call_server("http://127.0.0.1:9", "p1", "prefetch")  # nothing listens
    assert not down.ok


async def test_session_stages_and_prefetches(tmp_path, object_store, session, fake_server):
    warmer = await _staged_warmer(tmp_path, object_store, session, fake_server)
    fake_server.ready = True
    await warmer.check_servers()
    fake_server.calls.clear()
    assert warmer.store.get("plain") is None
    staged, results = await warmer.start_session("plain")
    assert Path(staged.path).is_symlink() and warmer.store.get("plain") is not None
    assert fake_server.calls == [("prefetch", "plain", "wait=false")] and results[0].ok
    with pytest.raises(StoreError) as err:
        await warmer.start_session("not-in-plan")
    assert err.value.reason == "UnknownAdapter" and err.value.status == 404


def pod(uid, ip, ready, deleting=False):
    meta = {"name": f"server-{uid}", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-05-01T08:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_kube_pods_lists_this_nodes_servers(tmp_path, session, kube_api):
    kube_api.pods = [pod("u1", "10.0.0.5", True), pod("u2", "10.0.0.6", False),
                     pod("u3", "10.0.0.7", True, deleting=True), pod("u4", None, False)]
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    pods = KubePods(KubeAPI(kube_api.url, session, token_file=token), "node-7")
    got = await pods.servers("llama-3-8b")
    assert got == {"u1": ("http://10.0.0.5:8000", True), "u2": ("http://10.0.0.6:8000", False)}
    query, auth = kube_api.requests[0]
    assert query["fieldSelector"] == "spec.nodeName=node-7"
    assert query["labelSelector"] == "app.kubernetes.io/name=loraplex-server,loraplex.io/base-model=llama-3-8b"
    assert auth == "Bearer tok-1"
    token.write_text("tok-2")  # a rotated token is picked up
    await pods.servers("llama-3-8b")
    assert kube_api.requests[1][1] == "Bearer tok-2"


async def test_kube_pods_of_a_plans_namespace_only(session, kube_api):
    """Two namespaces each run a BaseModel "llama-3-8b" on the node: the agent following ml's
    plan warms ml's servers alone (it pinned the plan's adapters in the other tenant's servers
    too, where a name of the plan could be another adapter)."""
    mine, theirs = pod("u1", "10.0.0.5", True), pod("u2", "10.0.0.6", True)
    mine["metadata"]["namespace"], theirs["metadata"]["namespace"] = "ml", "other"
    kube_api.pods = [mine, theirs]  # (this stub applies no field selector: the agent filters too)
    pods = KubePods(KubeAPI(kube_api.url, session), "node-7", namespace="ml")
    assert await pods.servers("llama-3-8b") == {"u1": ("http://10.0.0.5:8000", True)}
    assert kube_api.requests[0][0]["fieldSelector"] == "spec.nodeName=node-7,metadata.namespace=ml"


async def _reporting_warmer(tmp_path, session, kube_api, plan: dict):
    """A warmer of `plan` for namespace ml on node-7, reporting to `kube_api`: reconciled once,
    its reports sent. Returns (store, reporter, warmer)."""
    _, store, reporter, warmer = reporting_warmer(tmp_path, session, kube_api, plan)
    await warmer.check_plan()
    await warmer.reconcile()
    await reporter.flush()
    return store, reporter, warmer


async def test_status_reports_follow_staging(tmp_path, object_store, session, kube_api):
    """status.nodes.<node> of each plan adapter: Staging, then Staged with bytes or Failed
    with the reason; an eviction deletes the node's key; unchanged states are not resent."""
    object_store.add("p1", tmp_path)
    object_store.add("bad", tmp_path, seed=1, mode="cut")
    object_store.add("c", tmp_path, seed=2)
    store, reporter, warmer = await _reporting_warmer(tmp_path, session, kube_api,
                                                      plan_json(object_store, pinned=["p1", "bad"], others=["c"]))
    got = {name: body["status"]["nodes"]["node-7"] for ns, name, body, _ in kube_api.patches}
    assert {ns for ns, *_ in kube_api.patches} == {"ml"}
    assert got["p1"] == {"phase": "Staged", "message": "", "bytes": store.get("p1").bytes}
    assert got["bad"]["phase"] == "Failed" and got["bad"]["message"].startswith("Truncated: ")
    assert "c" not in got  # not staged: nothing to report
    assert all(ct == "application/merge-patch+json" for *_, ct in kube_api.patches)
    n = len(kube_api.patches)
    await warmer.reconcile()  # nothing changed: nothing sent
    await reporter.flush()
    assert len(kube_api.patches) == n
    store.on_evict((None, "p1"))  # what the store calls after evicting p1 (no namespace) for room
    await reporter.flush()
    assert kube_api.patches[-1][1:3] == ("p1", {"status": {"nodes": {"node-7": None}}})


async def test_status_reporter_retries_and_skips_deleted(session, kube_api):
    reporter = StatusReporter(KubeAPI(kube_api.url, session), "ml", "node-7", retry_seconds=0.01)
    kube_api.fail_next = 2  # the API answers 500 twice
    kube_api.missing = {"gone"}
    reporter.staged("a", 10)
    reporter.staged("gone", 5)
    task = asyncio.ensure_future(reporter.run())
    try:
        for _ in range(300):
            if reporter.idle and any(p[1] == "a" and p[3] == "ok" for p in kube_api.log):
                break
            await asyncio.sleep(0.01)
        assert reporter.idle
        assert [p[1] for p in kube_api.log if p[3] == "ok"] == ["a"]
        assert [p[3] for p in kube_api.log if p[1] == "gone"] == ["500", "404"]  # 404: not retried
    finally:
        task.cancel()


async def test_transient_failures_are_retried_permanent_ones_wait(tmp_path, object_store, session):
    object_store.add("late", tmp_path)  # its upload is not there yet: 404 at first
    object_store.add("wrong", tmp_path, seed=1)
    served = object_store.adapters.pop("late")
    cm = ConfigMapDir(tmp_path / "plan")
    plan = plan_json(object_store, pinned=["wrong"])
    plan["pinned"].append("late")
    plan["adapters"].append({"name": "late", "source": object_store.source("late"), "sha256": served.sha256,
                             "pinned": True})
    plan["adapters"][0]["sha256"] = "f" * 64  # "wrong" declares a digest its file does not have
    cm.write(plan)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, poll_seconds=0.02, retry_seconds=0.05)
    tasks = TaskGuard()
    tasks.spawn(warmer.run(), "plan-watch")
    try:
        await _until(lambda: set(warmer.errors) == {"late", "wrong"})
        assert warmer.retryable == ["late"]
        object_store.adapters["late"] = served  # the upload lands
        await _until(lambda: store.get("late") is not None)
        await asyncio.sleep(0.3)  # several backoff periods
        assert warmer.retryable == [] and list(warmer.errors) == ["wrong"]
        assert object_store.gets["wrong/adapter_model.safetensors"] == 1  # never fetched again
        plan["adapters"][0]["sha256"] = object_store.adapters["wrong"].sha256  # the CR is fixed
        cm.write(plan)
        # (the store lists it a moment before the warmer's stage returns and clears the error)
        await _until(lambda: store.get("wrong") is not None and warmer.errors == {})
    finally:
        await tasks.close()


async def test_status_reporter_sends_a_state_recorded_while_an_older_one_is_in_flight():
    """A new version of the same size: Staging is on its way to the API when Staged (equal
    to what was sent before it) is recorded. The API must end on Staged, not Staging."""

    class GatedAPI:
        def __init__(self) -> None:
            self.gate = asyncio.Event()
            self.gate.set()
            self.entered = asyncio.Event()
            self.bodies: list[dict] = []

        async def merge_patch(self, path: str, body: dict) -> int:
            self.entered.set()
            await self.gate.wait()
            self.bodies.append(body["status"]["nodes"]["node-7"])
            return 200

    api = GatedAPI()
    reporter = StatusReporter(api, "ml", "node-7")
    reporter.staged("a", 10)
    await reporter.flush()
    api.gate.clear()
    api.entered.clear()
    reporter.staging("a")  # the plan names a new version
    in_flight = asyncio.ensure_future(reporter.flush())
    await asyncio.wait_for(api.entered.wait(), 5)
    reporter.staged("a", 10)  # staged while the Staging patch is on its way
    api.gate.set()
    await in_flight
    await reporter.flush()
    assert api.bodies[-1] == {"phase": "Staged", "message": "", "bytes": 10}
    assert reporter.idle


async def test_a_session_download_voided_by_the_plan_leaves_no_staging_report(tmp_path, object_store, session,
                                                                            kube_api):
    """A session stages "late" (reported Staging); the plan drops it before the download
    ends, so it is void (Removed). The node's entry must not stay Staging for good."""
    object_store.add("keep", tmp_path)
    object_store.add("late", tmp_path, seed=1)
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(plan_json(object_store, pinned=["keep"], others=["late"]))
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    reporter = StatusReporter(KubeAPI(kube_api.url, session), "ml", "node-7")
    warmer = Warmer(store, cm.path, session, reporter=reporter)
    await warmer.check_plan()
    await warmer.reconcile()
    object_store.gate = asyncio.Event()
    started = asyncio.ensure_future(warmer.start_session("late"))
    while object_store.active == 0:
        await asyncio.sleep(0.005)
    await reporter.flush()  # Staging is on the CR now
    previous = warmer.plan
    cm.write(plan_json(object_store, pinned=["keep"]))  # "late" left the plan (say it was rejected)
    assert await warmer.check_plan()
    await warmer.reconcile(previous)
    object_store.gate.set()
    with pytest.raises(StoreError) as err:
        await started
    assert err.value.reason == "Removed"
    await reporter.flush()
    late = [body["status"]["nodes"]["node-7"] for _, name, body, _ in kube_api.patches if name == "late"]
    assert late[0] == {"phase": "Staging", "message": ""}
    assert late[-1] is None  # the node's key deleted: nothing of it is on this node


async def test_a_planned_adapter_without_a_digest_is_staged(tmp_path, object_store, session):
    """The operator writes `"sha256": null` for a LoRAAdapter that gives none (the CRD makes it
    optional): the agent stages it as found, where it used to refuse it (InvalidRequest) and
    the adapter could never reach a server."""
    object_store.add("a", tmp_path, seed=1)
    doc = plan_json(object_store, pinned=["a"])
    doc["adapters"][0]["sha256"] = None
    cm = ConfigMapDir(tmp_path / "plan")
    cm.write(doc)
    store = AdapterStore(tmp_path / "cache", 10**9, session=session)
    warmer = Warmer(store, cm.path, session, poll_seconds=0.05)
    tasks = TaskGuard()
    tasks.spawn(warmer.run(), "plan-watch")
    try:
        await _until(lambda: store.get("a") is not None)
        assert store.get("a").pinned and store.get("a").sha256 == object_store.adapters["a"].sha256
        assert tasks.crashed == {}
    finally:
        await tasks.close()


async def test_a_plan_adapter_staged_on_a_servers_request_is_reported(tmp_path, object_store, session, kube_api):
    """Most adapters of a pool are staged on their first request (a server's POST /v1/stage),
    not ahead; such a staging is reported on status.nodes as the plan's own are (it was not,
    and the adapter's Staged condition said "not staged on any node" for good). A name the
    plan does not list (another base's, on this node) is staged and not reported."""
    object_store.add("c", tmp_path)
    object_store.add("other", tmp_path, seed=1)
    store, reporter, warmer = await _reporting_warmer(tmp_path, session, kube_api, plan_json(object_store, others=["c"]))
    assert kube_api.patches == []  # c is in no warm-up window: nothing staged ahead
    asked = AdapterRef("c", object_store.source("c"), object_store.adapters["c"].sha256, "bfloat16")
    staged = await warmer.stage_on_request(asked)
    await warmer.stage_on_request(AdapterRef("other", object_store.source("other"), object_store.adapters["other"].sha256))
    await reporter.flush()
    reported = [(name, body["status"]["nodes"]["node-7"]) for _, name, body, _ in kube_api.patches]
    assert reported == [("c", {"phase": "Staged", "message": "", "bytes": staged.bytes})]  # the latest state
    assert store.get("other") is not None


async def test_a_servers_request_races_the_plan_loop_and_is_still_reported(tmp_path, object_store, session, kube_api):
    """A server may follow a newer plan than this agent has taken: a request for an adapter
    only that plan lists is staged as the plan's (it was staged as a stranger's, with no
    report, and the plan loop's reconcile, finding nothing on disk yet, reported nothing, so
    the adapter said "not staged on any node" for good). And an adapter no plan lists when
    its request came, listed by a plan the loop took while it downloaded, is reported too."""
    object_store.add("a", tmp_path)
    object_store.add("c", tmp_path, seed=1)
    object_store.add("d", tmp_path, seed=2)
    cm, store, reporter, warmer = reporting_warmer(tmp_path, session, kube_api, plan_json(object_store, others=["a"]))
    await warmer.check_plan()
    await warmer.reconcile()

    def ref(name):
        return AdapterRef(name, object_store.source(name), object_store.adapters[name].sha256)

    cm.write(plan_json(object_store, others=["a", "c"]))  # the servers' plan; the agent's loop has not polled
    staged_c = await warmer.stage_on_request(ref("c"))
    assert "c" not in warmer.plan.adapters  # still the old plan: the request read the new one
    await reporter.flush()
    assert [(name, body["status"]["nodes"]["node-7"]) for _, name, body, _ in kube_api.patches] == [
        ("c", {"phase": "Staged", "message": "", "bytes": staged_c.bytes})]

    stage = store.stage

    async def plan_loop_meanwhile(r):
        cm.write(plan_json(object_store, others=["a", "c", "d"]))
        assert await warmer.check_plan()
        await warmer.reconcile()  # d is not on disk yet: nothing of it to report
        return await stage(r)

    store.stage = plan_loop_meanwhile
    cm.write(plan_json(object_store, others=["a", "c"]))
    staged_d = await warmer.stage_on_request(ref("d"))
    await reporter.flush()
    assert [(name, body["status"]["nodes"]["node-7"]) for _, name, body, _ in kube_api.patches[1:]] == [
        ("d", {"phase": "Staged", "message": "", "bytes": staged_d.bytes})]
