"""The node agent's HTTP API (aiohttp) and the object that owns its parts.

    POST /v1/stage     {"name", "source"[, "sha256"][, "dtype"][, "namespace"]}  -> 200 {"adapter": {...}}
                       once on disk (dtype: the server's; a copy of the adapter's F32 tensors in it is
                       staged too; namespace: the server's Kubernetes namespace: staged in the cache's
                       folder for it, <cache>/.namespaces/<namespace>/<name>, apart from other
                       namespaces' adapters of that name)
    POST /v1/sessions  {"model": name[, "namespace"]}  -> 200 {"adapter": {...}, "servers": [...]}
                        stages a plan adapter and prefetches it into this node's servers
                        (namespace: needed only where two followed plans list the name)
    GET  /v1/adapters  -> {"adapters": [{name, namespace, sha256, source, path, bytes, pinned, lastUsed}],
                           "usedBytes", "budgetBytes", "errors": {name: "Reason: message"}}
                           (following several plans, or discovering plans, errors are keyed
                           "namespace/name")
    GET  /healthz      -> 200 while every background loop runs, 500 once one crashed
    GET  /metrics      -> Prometheus text

With an API key (AgentConfig.api_key, --api-key), every endpoint under /v1/ but /v1/stage
needs `Authorization: Bearer KEY` (auth.py); /healthz and /metrics stay open, and /v1/stage
too unless --stage-token-audience makes it take a server's service-account token, for the
token's namespace alone (stage_auth.py).

Errors: {"error": {"reason": "DigestMismatch", "message": "..."}} with 400 (bad request,
unsupported source), 401 (no or a wrong API key, where one is needed), 404 (source or plan adapter not found, or no such endpoint), 405 (wrong
method), 409 (removed from the plan, or superseded by a version asked for later, while it
downloaded; or a version of a plan adapter other than the plan's), 413 (body too large), 422 (digest or adapter files wrong), 502 (source cut the
download, stalled or failed), 507 (disk budget, or the disk itself full).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from loraplex.node_agent.auth import authenticate, holds_key
from loraplex.node_agent.metrics import Metrics
from loraplex.node_agent.server_keys import ServerKeys
from loraplex.node_agent.stage_auth import StageAuth, TokenReviewError
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.tasks import TaskGuard
from loraplex.node_agent.kube import FoundPlan, KubeAPI, KubePods, ListedPlan, PlanConfigMap, PlanMirrors, StatusReporter
from loraplex.node_agent.warmer import PlanFile, PlanSource, ServerDiscovery, StaticServers, Warmer
from loraplex.server.adapter_names import is_namespace
from loraplex.server.api_keys import WatchedFile, bearer_token, read_key_file  # stdlib only

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    """What `create_app` needs; cli.Settings maps onto it (tests build it directly)."""

    cache_dir: Path
    budget_bytes: int
    max_concurrent_downloads: int = 4
    plan_file: Path | None = None
    plan_configmaps: tuple[str, ...] = ()  # "namespace/name" of each plan followed, read through the API
    server_urls: tuple[str, ...] = ()
    node_name: str | None = None
    namespace: str | None = None  # of the plan's LoRAAdapters, for status.nodes reports
    kube_api_url: str | None = None
    kube_token_file: Path | None = None
    kube_ca_file: Path | None = None
    poll_seconds: float = 1.0
    server_poll_seconds: float = 2.0
    plan_selector: str | None = None  # label selector of plan ConfigMaps to follow, found in plan_namespace
    plan_namespace: str | None = None
    download_stall_seconds: float = 60.0  # a download that brings fewer than download_stall_bytes
    download_stall_bytes: int = 64 * 1024  # in this many seconds fails as Stalled
    server_api_key: str | None = field(default=None, repr=False)  # sent to the servers it warms
    server_api_key_file: Path | None = None  # or read from this file, re-read when it changes
    server_api_keys_dir: Path | None = None  # one key file per namespace or BaseModel (server_keys.py)
    api_key: str | None = field(default=None, repr=False)  # this API's own key (auth.py): none, open
    stage_plan_adapters_only: bool = False  # /v1/stage of a name no followed plan lists needs api_key
    # /v1/stage needs a service-account token of this audience, of the namespace it stages for
    # (stage_auth.py; needs kube_api_url); None: open
    stage_token_audience: str | None = None


@dataclass
class _Discovered:
    """A plan followed because `plan_selector` found it: its warmer and that warmer's loops."""

    source: ListedPlan
    warmer: Warmer
    loops: list[asyncio.Task] = field(default_factory=list)


class Agent:
    """The store, one warmer per plan followed (one with no plan when none is named) and their
    background loops, started and stopped together.

    Plans named (--plan-file, --plan-configmap) are followed from start to stop. With a
    plan selector, the plans it finds are followed from when they appear to when they go,
    each as a --plan-configmap of the plan it mirrors (its namespace the plan's: staging
    folder, status reports, servers). A discovered plan always keeps its adapters' record
    in `.plan-adapters.<namespace>.<name>.json`, however many plans are followed, so its
    record is the same file from one run to the next as plans come and go; the named plans
    keep theirs as before (`.plan-adapters.json` for a lone one)."""

    def __init__(self, config: AgentConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        # The servers' admin keys: one for all, as given or as its file holds it now (a Secret's
        # mount: a rotated key reaches the warmers without a restart), and those of the keys
        # folder, per namespace or BaseModel, before it.
        self.server_keys = ServerKeys(
            WatchedFile(config.server_api_key_file, functools.partial(read_key_file, flag="--server-api-key-file"))
            if config.server_api_key_file is not None else config.server_api_key, config.server_api_keys_dir)
        self.metrics = metrics or Metrics()
        self.tasks = TaskGuard(self.metrics)
        self.session: aiohttp.ClientSession | None = None
        self.store: AdapterStore | None = None
        self.warmers: list[Warmer] = []
        self.discovered: dict[str, _Discovered] = {}  # "namespace/name" of a found plan -> it
        self._api: KubeAPI | None = None
        self.stage_auth: StageAuth | None = None
        self._mirrors: PlanMirrors | None = None
        self._reporters: dict[str, StatusReporter] = {}
        self._keyed = False  # errors keyed "namespace/name", task names suffixed (several plans, or discovery)
        self._list_error: str | None = None  # the last failed listing, logged once while it lasts
        # Records of plans an earlier run followed, not yet checked for plans gone meanwhile
        # (with a selector: Agent.retire_orphans), and the listings since the first one.
        self._orphans_pending = False
        self._listings = 0

    @property
    def warmer(self) -> Warmer:
        """The first plan's warmer (the only one, following one plan or none)."""
        return self.warmers[0]

    def warmer_for(self, namespace: str | None, name: str) -> Warmer:
        """The warmer whose plan lists `name` in `namespace`, else one of that namespace's,
        else the first: its rules (the plan guard, status reports) are the ones that apply."""
        ours = [w for w in self.warmers if w.namespace == namespace]
        listed = [w for w in ours if w.plan is not None and name in w.plan.adapters]
        return (listed or ours or self.warmers)[0]

    async def plan_lists(self, namespace: str | None, name: str) -> bool:
        """Whether a plan this agent follows lists `name` in `namespace`, as the plan stands
        now: a server may have read a newer plan than the agent's last poll (the plan loop is
        woken to take it)."""
        ours = [w for w in self.warmers if w.namespace == namespace]
        if any(w.plan is not None and name in w.plan.adapters for w in ours):
            return True
        for w in ours:
            if await w.lists_now(name):
                return True
        return False

    def _listed_elsewhere(self, warmer: Warmer, name: str) -> bool:
        return any(w is not warmer and w.namespace == warmer.namespace and w.plan is not None
                   and name in w.plan.adapters for w in self.warmers)

    def errors(self) -> dict[str, str]:
        if len(self.warmers) == 1 and not self._keyed:
            return self.warmer.errors
        return {(f"{w.namespace}/{k}" if w.namespace else k): v for w in self.warmers for k, v in w.errors.items()}

    async def start(self) -> None:
        c = self.config
        # Downloads may take minutes: no total timeout, but a stalled socket fails.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60))
        self.store = AdapterStore(c.cache_dir, c.budget_bytes, c.max_concurrent_downloads,
                                  session=self.session, metrics=self.metrics,
                                  stall_seconds=c.download_stall_seconds, stall_bytes=c.download_stall_bytes)
        if c.kube_api_url:
            self._api = KubeAPI(c.kube_api_url, self.session, token_file=c.kube_token_file, ca_file=c.kube_ca_file)
        if (c.plan_configmaps or c.plan_selector) and self._api is None:
            raise ValueError("plan_configmaps and plan_selector need kube_api_url")
        if c.stage_token_audience:
            if self._api is None:
                raise ValueError("stage_token_audience needs kube_api_url (its tokens are reviewed by the API)")
            self.stage_auth = StageAuth(self._api, c.stage_token_audience)
        if c.plan_selector and not c.plan_namespace:
            raise ValueError("plan_selector needs plan_namespace")
        # (plan source, its namespace, its record of adapters under the cache, a name for its loops)
        plans: list[tuple[PlanSource | None, str | None, str, str]] = []
        if c.plan_file:
            plans.append((PlanFile(c.plan_file), c.namespace, Warmer.PLAN_ADAPTERS_FILE, ""))
        several = len(c.plan_configmaps) > 1
        self._keyed = several or bool(c.plan_selector)
        for item in c.plan_configmaps:
            namespace, name = item.split("/", 1)
            plans.append((PlanConfigMap(self._api, namespace, name), namespace,
                          self.record_file(namespace, name) if several else Warmer.PLAN_ADAPTERS_FILE,
                          f" {item}" if self._keyed else ""))
        if not plans:  # stage on request only; the node's servers still get warmed (nothing to warm)
            plans.append((None, c.namespace, Warmer.PLAN_ADAPTERS_FILE, ""))
        static_reporters = not c.plan_selector  # their loops named as before: one is "status-report"
        for plan, namespace, record, label in plans:
            warmer, loops = self._follow(plan, namespace, record, label, spawn_reporter=not static_reporters)
            self.warmers.append(warmer)
        self._wire()
        if static_reporters:
            for namespace, reporter in self._reporters.items():
                self.tasks.spawn(reporter.run(),
                                 "status-report" if len(self._reporters) == 1 else f"status-report {namespace}")
        if c.plan_selector:
            assert self._api is not None and c.plan_namespace
            self._orphans_pending = True
            self._mirrors = PlanMirrors(self._api, c.plan_namespace, c.plan_selector)
            self.tasks.spawn(self._discover_plans(), "plan-discovery")

    @staticmethod
    def record_file(namespace: str, name: str) -> str:
        """The record of a plan's adapters, under the cache, where it is one of several."""
        return f".plan-adapters.{namespace}.{name}.json"

    def _follow(self, plan: PlanSource | None, namespace: str | None, record: str, label: str, *,
                spawn_reporter: bool) -> tuple[Warmer, list[asyncio.Task]]:
        """A warmer for one plan, its loops started: the plan's, and its servers'."""
        c = self.config
        assert self.store is not None and self.session is not None
        reporter = self._reporter(namespace, spawn=spawn_reporter)
        discovery: ServerDiscovery | None = None
        if c.server_urls:
            discovery = StaticServers(list(c.server_urls), self.session)
        elif self._api is not None and c.node_name:
            discovery = KubePods(self._api, c.node_name, namespace=namespace)
        warmer = Warmer(self.store, plan, self.session, discovery=discovery, reporter=reporter,
                        metrics=self.metrics, namespace=namespace, record_file=record,
                        poll_seconds=c.poll_seconds, server_poll_seconds=c.server_poll_seconds,
                        server_api_key=self.server_keys)
        loops = []
        if plan is not None:
            loops.append(self.tasks.spawn(warmer.run(), f"plan-watch{label}"))
        if discovery is not None:
            loops.append(self.tasks.spawn(warmer.run_servers(), f"server-watch{label}"))
        return warmer, loops

    def _reporter(self, namespace: str | None, *, spawn: bool) -> StatusReporter | None:
        """The status reporter of `namespace` (made on first use, its loop started if `spawn`);
        None without the API, a node name or a namespace."""
        if self._api is None or not self.config.node_name or not namespace:
            return None
        if namespace not in self._reporters:
            self._reporters[namespace] = StatusReporter(self._api, namespace, self.config.node_name)
            if spawn:
                self.tasks.spawn(self._reporters[namespace].run(), f"status-report {namespace}")
        return self._reporters[namespace]

    def _wire(self) -> None:
        """Every plan's warmer hears of an eviction (each reports the adapters of its plan), and
        none removes from disk an adapter that moved to another plan it follows. (A new Warmer
        takes the store's eviction callback for itself: wired again after each.)"""
        assert self.store is not None
        self.store.on_evict = lambda key: [w._evicted(key) for w in list(self.warmers)]
        for warmer in self.warmers:
            warmer.listed_elsewhere = functools.partial(self._listed_elsewhere, warmer)

    # -- plans found by label -----------------------------------------------------------------

    async def _discover_plans(self) -> None:
        """The discovery loop: list the plans the selector finds every poll_seconds."""
        while True:
            await self.discover()
            await asyncio.sleep(self.config.poll_seconds)

    async def discover(self) -> None:
        """Follow the plans found that are not followed yet, feed the followed ones their
        ConfigMap as listed, and stop following those no longer found. A failed listing
        changes nothing (a plan is let go only when a listing does not have it)."""
        assert self._mirrors is not None
        try:
            found = await self._mirrors.list()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            if str(e) != self._list_error:
                log.error("cannot list the plans (%s): %s", self._mirrors, e)
            self._list_error = str(e)
            return
        if self._list_error is not None:
            log.info("listing the plans (%s) again", self._mirrors)
            self._list_error = None
        named = set(self.config.plan_configmaps)  # followed already, by name: not twice
        for key in [k for k in self.discovered if k not in found]:
            await self._let_go(key)
        for key, plan in found.items():
            if key in named:
                continue
            if key in self.discovered:
                self.discovered[key].source.update(plan)
            else:
                self._take(plan)
        self._listings += 1
        # Once every followed plan has been read (or after ORPHAN_WAIT_LISTINGS listings, for a
        # named plan that never is): an adapter that moved to a plan not read yet stays.
        if self._orphans_pending and (self._listings > self.ORPHAN_WAIT_LISTINGS or all(
                w.plan is not None for w in self.warmers if w.plan_source is not None)):
            self._orphans_pending = False
            await self.retire_orphans()

    # Listings after the first before the orphans are retired even if a followed plan was never read.
    ORPHAN_WAIT_LISTINGS = 30

    def orphan_records(self) -> list[tuple[str, str]]:
        """(namespace, record file) of each plan record under the cache that no followed plan
        keeps: a plan this agent followed in an earlier run, found by label or named among
        several (`.plan-adapters.<namespace>.<name>.json`), and followed no more."""
        assert self.store is not None
        kept = {w.record_file for w in self.warmers}
        out = []
        for path in sorted(self.store.root.glob(".plan-adapters.*.json")):
            namespace = path.name[len(".plan-adapters."):-len(".json")].partition(".")[0]
            if path.name not in kept and path.name != Warmer.PLAN_ADAPTERS_FILE and namespace:
                out.append((namespace, path.name))
        return out

    async def retire_orphans(self) -> None:
        """Plans gone while the agent was down (a BaseModel deleted then): each is retired as
        one that goes while it runs is (Warmer.retire), from the record an earlier run left:
        its adapters off the disk (but those a followed plan of the namespace lists) and their
        status entries, its record removed."""
        for namespace, record in self.orphan_records():
            reporter = self._reporter(namespace, spawn=True)
            assert self.store is not None and self.session is not None
            warmer = Warmer(self.store, None, self.session, reporter=reporter, metrics=self.metrics,
                            namespace=namespace, record_file=record, server_api_key=self.server_keys)
            warmer.listed_elsewhere = functools.partial(self._listed_elsewhere, warmer)
            self._wire()  # a new Warmer takes the store's eviction callback for itself
            await warmer.retire()
            log.info("let go of the plan recorded in %s: not followed any more (gone while the agent was down)", record)

    def _take(self, plan: FoundPlan) -> None:
        source = ListedPlan(plan)
        warmer, loops = self._follow(source, plan.namespace, self.record_file(plan.namespace, plan.name),
                                     f" {plan.key}", spawn_reporter=True)
        self.warmers.append(warmer)
        self._wire()
        self.discovered[plan.key] = _Discovered(source, warmer, loops)
        log.info("following the plan %s, found as %s/%s", plan.key, plan.where, plan.mirror)

    async def _let_go(self, key: str) -> None:
        """Stop following a plan no longer found: its loops stopped, then its adapters left
        as adapters that leave a plan are (those another followed plan of the namespace lists
        stay on disk), its pins released (Warmer.retire)."""
        gone = self.discovered.pop(key)
        for task in gone.loops:
            task.cancel()
        await asyncio.gather(*gone.loops, return_exceptions=True)
        self.warmers.remove(gone.warmer)
        self._wire()
        await gone.warmer.retire()
        log.info("not following the plan %s any more: it is no longer found", key)

    async def stop(self) -> None:
        await self.tasks.close()
        if self.session is not None:
            await self.session.close()


def create_app(config: AgentConfig, metrics: Metrics | None = None) -> web.Application:
    agent = Agent(config, metrics)
    app = web.Application(middlewares=[authenticate(config.api_key), json_errors])
    app[AGENT] = agent

    async def lifespan(app: web.Application):
        await agent.start()
        yield
        await agent.stop()

    app.cleanup_ctx.append(lifespan)
    app.add_routes([
        web.post("/v1/stage", stage),
        web.post("/v1/sessions", start_session),
        web.get("/v1/adapters", list_adapters),
        web.get("/healthz", healthz),
        web.get("/metrics", metrics_endpoint),
    ])
    return app


AGENT = web.AppKey("agent", Agent)


def _agent(request: web.Request) -> Agent:
    return request.app[AGENT]


def error(reason: str, message: str, status: int) -> web.Response:
    return web.json_response({"error": {"reason": reason, "message": message}}, status=status)


# aiohttp's own errors (no route, wrong method, body over client_max_size), by status.
HTTP_REASONS = {404: "NotFound", 405: "MethodNotAllowed", 413: "RequestTooLarge"}


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp answers an unknown path, a wrong method or a body too large in plain text;
    give those the API's error shape too, so a client reads every error the same way."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400 or e.content_type == "application/json":  # redirects; our own errors
            raise
        if isinstance(e, web.HTTPMethodNotAllowed):
            message = f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(e.allowed_methods))}"
        elif isinstance(e, web.HTTPNotFound):
            message = f"no such endpoint: {request.path}"
        else:
            message = e.text or e.reason
        resp = error(HTTP_REASONS.get(e.status, "InvalidRequest"), message, e.status)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp


def _store_error(e: StoreError) -> web.Response:
    return error(e.reason, str(e), e.status)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested too deep for the decoder
        raise web.HTTPBadRequest(
            text='{"error": {"reason": "InvalidRequest", "message": "body is not JSON"}}',
            content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text='{"error": {"reason": "InvalidRequest", "message": "body is not a JSON object"}}',
            content_type="application/json")
    return body


async def stage(request: web.Request) -> web.Response:
    body = await _json_body(request)
    missing = [k for k in ("name", "source") if k not in body]
    if missing:
        return error("InvalidRequest", f"missing fields: {', '.join(missing)}", 400)
    agent = _agent(request)
    ref = AdapterRef(body["name"], body["source"], body.get("sha256"), body.get("dtype"), body.get("namespace"))
    refused = await _stage_refusal(request, agent, ref.namespace)  # who asks, before what is asked
    if refused is not None:
        return refused
    try:
        ref.validate()
        if (agent.config.stage_plan_adapters_only and not holds_key(request, agent.config.api_key)
                and not await agent.plan_lists(ref.namespace, ref.name)):
            where = f" of namespace {ref.namespace!r}" if ref.namespace else ""
            return error("NotInPlan", f"{ref.name!r} is in no plan{where} this node follows: this agent stages "
                         "plan adapters alone (--stage-plan-adapters-only), other names with its API key", 403)
        staged = await agent.warmer_for(ref.namespace, ref.name).stage_on_request(ref)
    except StoreError as e:
        return _store_error(e)
    return web.json_response({"adapter": staged.as_json()})


async def _stage_refusal(request: web.Request, agent: "Agent", namespace: str | None) -> web.Response | None:
    """With --stage-token-audience: a 401 for a request without a service-account token of
    that audience (or the agent's API key), a 403 for one of another namespace than the one
    it stages for (the request's, else the agent's --namespace), a 503 when the API cannot
    review it; None: it may stage."""
    auth = agent.stage_auth
    if auth is None or holds_key(request, agent.config.api_key):
        return None
    def unauthorized(message: str) -> web.Response:
        refusal = error("Unauthorized", message, 401)
        refusal.headers["WWW-Authenticate"] = "Bearer"
        return refusal

    token = bearer_token(request.headers.get("Authorization"))
    if token is None:
        return unauthorized(f"staging needs a service-account token of audience {auth.audience!r} as "
                            "'Authorization: Bearer TOKEN' (a server's --node-agent-token-file)")
    try:
        caller = await auth.namespace_of(token)
    except TokenReviewError as e:
        return error("TokenReviewFailed", f"{e}; try again", 503)
    if caller is None:
        return unauthorized(f"the token is no service-account token of audience {auth.audience!r}")
    wanted = namespace or agent.config.namespace
    if caller != wanted:
        where = f"namespace {wanted!r}" if wanted else "the cache's top folder (no namespace)"
        return error("Forbidden", f"a pod of namespace {caller!r} stages its own namespace's adapters, not {where}",
                     403)
    return None


async def start_session(request: web.Request) -> web.Response:
    body = await _json_body(request)
    name, namespace = body.get("model"), body.get("namespace")
    if not isinstance(name, str) or not name:
        return error("InvalidRequest", "field 'model' (the adapter name) is required", 400)
    if namespace is not None and not is_namespace(namespace):  # as /v1/stage refuses it
        return error("InvalidRequest", f"namespace {namespace!r} is not a Kubernetes namespace name "
                     "(a DNS-1123 label: 1-63 lowercase letters, digits and '-')", 400)
    agent = _agent(request)
    listing = [w for w in agent.warmers if w.plan is not None and name in w.plan.adapters
               and (namespace is None or w.namespace == namespace)]
    if len({w.namespace for w in listing}) > 1:
        namespaces = sorted(str(w.namespace) for w in listing)
        return error("InvalidRequest", f"{name!r} is in the plans of namespaces {namespaces}: give 'namespace'", 400)
    if not listing and namespace is not None:
        return error("UnknownAdapter", f"adapter {name!r} is in no plan of namespace {namespace!r} this node follows",
                     404)
    try:
        staged, results = await (listing[0] if listing else agent.warmer).start_session(name)
    except StoreError as e:
        return _store_error(e)
    return web.json_response({"adapter": staged.as_json(), "servers": [r.as_json() for r in results]})


async def list_adapters(request: web.Request) -> web.Response:
    agent = _agent(request)
    store = agent.store
    return web.json_response({
        "adapters": [a.as_json() for a in store.list()],
        "usedBytes": store.used_bytes,
        "budgetBytes": store.budget_bytes,
        "errors": agent.errors(),
    })


async def healthz(request: web.Request) -> web.Response:
    tasks = _agent(request).tasks
    if tasks.crashed:
        return web.json_response({"status": "crashed", "crashed": tasks.crashed}, status=500)
    return web.json_response({"status": "ok", "tasks": tasks.running})


# generate_latest writes the 0.0.4 text format; prometheus-client's CONTENT_TYPE_LATEST now
# says version=1.0.0, which Prometheus 2 scrapers do not ask for (as the server's /metrics).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = generate_latest(_agent(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})
