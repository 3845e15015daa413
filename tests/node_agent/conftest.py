"""Fixtures for the node agent: real adapter files and a real HTTP object store on 127.0.0.1.

`make_adapter(dir)` writes a tiny PEFT adapter with safetensors' numpy API and returns the
sha256 of its weights. `object_store` serves adapters from memory over HTTP, and can
misbehave per adapter: cut the body half way, send no Content-Length, or hold every
weights request until a gate opens (to count concurrent downloads).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraplex.node_agent.adapter_files import CONFIG_FILE, WEIGHTS_FILE

from .helpers import make_adapter


@dataclass
class ServedAdapter:
    files: dict[str, bytes]
    sha256: str  # of the weights as served
    mode: str = "ok"  # ok | cut | chunked


@dataclass
class ObjectStore:
    """An HTTP object store: GET /adapters/<name>/<file>."""

    url: str = ""
    adapters: dict[str, ServedAdapter] = field(default_factory=dict)
    gets: Counter = field(default_factory=Counter)  # path -> GETs
    order: list[str] = field(default_factory=list)  # adapter names, in the order weights were asked
    active: int = 0
    max_active: int = 0
    gate: asyncio.Event | None = None  # when set up, weights wait for it
    authorizations: list = field(default_factory=list)  # each GET's Authorization header (None: none)

    def add(self, name: str, tmp: Path, *, seed: int = 0, mode: str = "ok", rank: int = 4) -> str:
        """Serve a fresh adapter `name`; returns its source URL."""
        sha = make_adapter(tmp / "src" / name, seed=seed, rank=rank)
        files = {f: (tmp / "src" / name / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)}
        self.adapters[name] = ServedAdapter(files, sha, mode)
        return self.source(name)

    def source(self, name: str) -> str:
        return f"{self.url}/adapters/{name}/"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name, filename = request.match_info["name"], request.match_info["file"]
        self.gets[f"{name}/{filename}"] += 1
        self.authorizations.append(request.headers.get("Authorization"))
        served = self.adapters.get(name)
        if served is None or filename not in served.files:
            raise web.HTTPNotFound()
        body = served.files[filename]
        if filename != WEIGHTS_FILE:
            return web.Response(body=body)
        self.order.append(name)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            resp = web.StreamResponse()
            if served.mode == "chunked":
                resp.enable_chunked_encoding()
            else:
                resp.content_length = len(body)
            await resp.prepare(request)
            if served.mode == "cut":
                await resp.write(body[: len(body) // 2])
                await asyncio.sleep(0.01)
                request.transport.close()  # the connection drops mid-body
                return resp
            for i in range(0, len(body), 4096):
                await resp.write(body[i : i + 4096])
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1


@dataclass
class FakeServer:
    """A loraplex server as the warmer sees it: /readyz and the adapter admin endpoints."""

    url: str = ""
    ready: bool = False
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (action, name, query)
    fail: set[tuple[str, str]] = field(default_factory=set)
    authorizations: list = field(default_factory=list)  # each admin call's Authorization header

    async def readyz(self, request):
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def admin(self, request):
        name, action = request.match_info["name"], request.match_info["action"]
        self.calls.append((action, name, request.query_string))
        self.authorizations.append(request.headers.get("Authorization"))
        if (action, name) in self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        return web.json_response({"name": name, "status": "loading" if action == "prefetch" else "pinned"},
                                 status=202 if action == "prefetch" else 200)


@pytest.fixture
async def session():
    """An aiohttp client session for the test (the agent's own, as a test builds its parts)."""
    async with aiohttp.ClientSession() as s:
        yield s


@contextlib.asynccontextmanager
async def serving_fake_server():
    srv = FakeServer()
    app = web.Application()
    app.router.add_get("/readyz", srv.readyz)
    app.router.add_post("/v1/adapters/{name}/{action}", srv.admin)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    srv.url = str(server.make_url("")).rstrip("/")
    try:
        yield srv
    finally:
        await server.close()


@pytest.fixture
async def fake_server():
    async with serving_fake_server() as srv:
        yield srv


@pytest.fixture
async def other_fake_server():
    """A second server (another namespace's, say)."""
    async with serving_fake_server() as srv:
        yield srv


@pytest.fixture
async def object_store():
    store = ObjectStore()
    app = web.Application()
    app.router.add_get("/adapters/{name}/{file}", store.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    store.url = str(server.make_url("")).rstrip("/")
    yield store
    if store.gate is not None:
        store.gate.set()
    await server.close()


@dataclass
class FakeKubeAPI:
    """GET /api/v1/pods, GET of a ConfigMap, a list of ConfigMaps by label (equality terms
    alone, `a=b,c=d`) and PATCH of LoRAAdapter status, as the node agent uses them."""

    url: str = ""
    pods: list = field(default_factory=list)
    requests: list = field(default_factory=list)  # (query, Authorization) of pod lists
    patches: list = field(default_factory=list)  # (namespace, name, body, content type), accepted
    log: list = field(default_factory=list)  # (namespace, name, body, outcome), every PATCH
    fail_next: int = 0  # answer 500 to this many PATCHes first
    missing: set = field(default_factory=set)  # adapters that answer 404
    configmaps: dict = field(default_factory=dict)  # (namespace, name) -> ConfigMap
    lists: list = field(default_factory=list)  # (namespace, query) of ConfigMap lists
    fail_lists: int = 0  # answer 500 to this many ConfigMap lists first
    tokens: dict = field(default_factory=dict)  # service-account token -> (username, audiences)
    reviews: list = field(default_factory=list)  # the TokenReview bodies asked for
    fail_reviews: int = 0  # answer 500 to this many TokenReviews first
    rv: int = 0

    def put_configmap(self, ns: str, name: str, data: dict, binary: dict | None = None, *,
                      labels: dict | None = None, annotations: dict | None = None) -> None:
        self.rv += 1
        meta = {"namespace": ns, "name": name, "resourceVersion": str(self.rv)}
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        self.configmaps[(ns, name)] = {"metadata": meta, "data": data, "binaryData": binary or {}}

    async def get_configmap(self, request):
        cm = self.configmaps.get((request.match_info["ns"], request.match_info["name"]))
        if cm is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response(cm)

    async def list_configmaps(self, request):
        ns = request.match_info["ns"]
        self.lists.append((ns, dict(request.query)))
        if self.fail_lists:
            self.fail_lists -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        terms = [t.split("=", 1) for t in request.query.get("labelSelector", "").split(",") if t]
        items = [cm for (cm_ns, _), cm in sorted(self.configmaps.items()) if cm_ns == ns
                 and all((cm["metadata"].get("labels") or {}).get(k) == v for k, v in terms)]
        return web.json_response({"kind": "ConfigMapList", "metadata": {"resourceVersion": str(self.rv)},
                                  "items": items})


    async def token_review(self, request):
        """As the API server answers: authenticated with the user, for a known token whose
        audiences include one asked for; else authenticated false."""
        body = await request.json()
        self.reviews.append(body)
        if self.fail_reviews:
            self.fail_reviews -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        known = self.tokens.get(body["spec"]["token"])
        asked = body["spec"].get("audiences") or []
        if known is None or not set(asked) & set(known[1]):
            status = {"authenticated": False, "error": "invalid bearer token"}
        else:
            status = {"authenticated": True, "user": {"username": known[0]}, "audiences": sorted(set(asked) & set(known[1]))}
        return web.json_response({"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                                  "spec": body["spec"], "status": status}, status=201)

    async def list_pods(self, request):
        self.requests.append((dict(request.query), request.headers.get("Authorization")))
        return web.json_response({"kind": "PodList", "items": self.pods})

    async def patch_status(self, request):
        ns, name = request.match_info["ns"], request.match_info["name"]
        body = await request.json()
        if self.fail_next:
            self.fail_next -= 1
            self.log.append((ns, name, body, "500"))
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        if name in self.missing:
            self.log.append((ns, name, body, "404"))
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        self.log.append((ns, name, body, "ok"))
        self.patches.append((ns, name, body, request.headers.get("Content-Type")))
        return web.json_response({"metadata": {"name": name}, "status": body["status"]})


@pytest.fixture
async def kube_api():
    api = FakeKubeAPI()
    app = web.Application()
    app.router.add_get("/api/v1/pods", api.list_pods)
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", api.token_review)
    app.router.add_get("/api/v1/namespaces/{ns}/configmaps/{name}", api.get_configmap)
    app.router.add_get("/api/v1/namespaces/{ns}/configmaps", api.list_configmaps)
    app.router.add_patch("/apis/loraplex.io/v1alpha1/namespaces/{ns}/loraadapters/{name}/status", api.patch_status)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    api.url = str(server.make_url("")).rstrip("/")
    yield api
    await server.close()


@dataclass
class FakeClock:
    t: float = 1_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def client_factory():
    """Starts agents (the whole app, its background loops too) on 127.0.0.1; closed after the test."""
    from aiohttp.test_utils import TestClient

    from loraplex.node_agent.app import AgentConfig, create_app

    clients = []

    async def make(config: AgentConfig) -> TestClient:
        client = TestClient(TestServer(create_app(config), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()
