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
                           (following several plans, errors are keyed "namespace/name")
    GET  /healthz      -> 200 while every background loop runs, 500 once one crashed
    GET  /metrics      -> Prometheus text

Errors: {"error": {"reason": "DigestMismatch", "message": "..."}} with 400 (bad request,
unsupported source), 404 (source or plan adapter not found, or no such endpoint), 405 (wrong
method), 409 (removed from the plan, or superseded by a version asked for later, while it
downloaded; or a version of a plan adapter other than the plan's), 413 (body too large), 422 (digest or adapter files wrong), 502 (source cut the
download or failed), 507 (disk budget, or the disk itself full).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from loraplex.node_agent.metrics import Metrics
from loraplex.node_agent.store import AdapterRef, AdapterStore, StoreError
from loraplex.node_agent.tasks import TaskGuard
from loraplex.node_agent.kube import KubeAPI, KubePods, PlanConfigMap, StatusReporter
from loraplex.node_agent.warmer import PlanFile, PlanSource, ServerDiscovery, StaticServers, Warmer

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


class Agent:
    """The store, one warmer per plan followed (one with no plan when none is) and their
    background loops, started and stopped together."""

    def __init__(self, config: AgentConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.tasks = TaskGuard(self.metrics)
        self.session: aiohttp.ClientSession | None = None
        self.store: AdapterStore | None = None
        self.warmers: list[Warmer] = []

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

    def _listed_elsewhere(self, warmer: Warmer, name: str) -> bool:
        return any(w is not warmer and w.namespace == warmer.namespace and w.plan is not None
                   and name in w.plan.adapters for w in self.warmers)

    def errors(self) -> dict[str, str]:
        if len(self.warmers) == 1:
            return self.warmer.errors
        return {(f"{w.namespace}/{k}" if w.namespace else k): v for w in self.warmers for k, v in w.errors.items()}

    async def start(self) -> None:
        c = self.config
        # Downloads may take minutes: no total timeout, but a stalled socket fails.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=15, sock_read=60))
        self.store = AdapterStore(c.cache_dir, c.budget_bytes, c.max_concurrent_downloads,
                                  session=self.session, metrics=self.metrics)
        api = None
        if c.kube_api_url:
            api = KubeAPI(c.kube_api_url, self.session, token_file=c.kube_token_file, ca_file=c.kube_ca_file)
        # (plan source, its namespace, its record of adapters under the cache, a name for its loops)
        plans: list[tuple[PlanSource | None, str | None, str, str]] = []
        if c.plan_file:
            plans.append((PlanFile(c.plan_file), c.namespace, Warmer.PLAN_ADAPTERS_FILE, ""))
        if c.plan_configmaps and api is None:
            raise ValueError("plan_configmaps needs kube_api_url")
        several = len(c.plan_configmaps) > 1
        for item in c.plan_configmaps:
            namespace, name = item.split("/", 1)
            plans.append((PlanConfigMap(api, namespace, name), namespace,
                          f".plan-adapters.{namespace}.{name}.json" if several else Warmer.PLAN_ADAPTERS_FILE,
                          f" {item}" if several else ""))
        if not plans:  # stage on request only; the node's servers still get warmed (nothing to warm)
            plans.append((None, c.namespace, Warmer.PLAN_ADAPTERS_FILE, ""))
        reporters: dict[str, StatusReporter] = {}
        for plan, namespace, record, label in plans:
            reporter = None
            if api is not None and c.node_name and namespace:
                if namespace not in reporters:
                    reporters[namespace] = StatusReporter(api, namespace, c.node_name)
                reporter = reporters[namespace]
            discovery: ServerDiscovery | None = None
            if c.server_urls:
                discovery = StaticServers(list(c.server_urls), self.session)
            elif api is not None and c.node_name:
                discovery = KubePods(api, c.node_name, namespace=namespace)
            warmer = Warmer(self.store, plan, self.session, discovery=discovery, reporter=reporter,
                            metrics=self.metrics, namespace=namespace, record_file=record,
                            poll_seconds=c.poll_seconds, server_poll_seconds=c.server_poll_seconds)
            self.warmers.append(warmer)
            if plan is not None:
                self.tasks.spawn(warmer.run(), f"plan-watch{label}")
            if discovery is not None:
                self.tasks.spawn(warmer.run_servers(), f"server-watch{label}")
        # Every plan's warmer hears of an eviction (each reports the adapters of its plan), and
        # none removes from disk an adapter that moved to another plan it follows.
        self.store.on_evict = lambda key: [w._evicted(key) for w in self.warmers]
        for warmer in self.warmers:
            warmer.listed_elsewhere = functools.partial(self._listed_elsewhere, warmer)
        for namespace, reporter in reporters.items():
            self.tasks.spawn(reporter.run(), "status-report" if len(reporters) == 1 else f"status-report {namespace}")

    async def stop(self) -> None:
        await self.tasks.close()
        if self.session is not None:
            await self.session.close()


def create_app(config: AgentConfig, metrics: Metrics | None = None) -> web.Application:
    agent = Agent(config, metrics)
    app = web.Application(middlewares=[json_errors])
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
    except ValueError:
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
    try:
        ref.validate()
        staged = await agent.warmer_for(ref.namespace, ref.name).stage_on_request(ref)
    except StoreError as e:
        return _store_error(e)
    return web.json_response({"adapter": staged.as_json()})


async def start_session(request: web.Request) -> web.Response:
    body = await _json_body(request)
    name, namespace = body.get("model"), body.get("namespace")
    if not isinstance(name, str) or not name:
        return error("InvalidRequest", "field 'model' (the adapter name) is required", 400)
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


async def metrics_endpoint(request: web.Request) -> web.Response:
    body = generate_latest(_agent(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
