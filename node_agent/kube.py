"""The few Kubernetes API calls the node agent makes, over aiohttp (no client library).

    KubeAPI        GET JSON / merge-patch with the pod's service-account token and CA
    KubePods       the server pods of a base on this node, and whether they are ready
    PlanConfigMap  the operator's plan ConfigMap, when it cannot be mounted
    PlanMirrors    the plan ConfigMaps of one namespace that a label selector finds (the
                   operator's mirrors of its BaseModels' plans), each naming the plan it copies
    ListedPlan     one of those as a plan source, read from the last listing
    StatusReporter this node's entry under LoRAAdapter status.nodes, e.g.
                   {"status": {"nodes": {"gpu-node-3": {"phase": "Staged", "message": "", "bytes": 41943040}}}}

RBAC (the chart's node-agent ClusterRole): list pods; get the named plan ConfigMaps; get/patch
loraadapters/status; and (a Role in the agent's namespace, with plan discovery) list configmaps there.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loraplex.server.adapter_names import is_namespace
from loraplex.server.plan_file import PLAN_NAMESPACE_ANNOTATION, PLAN_OF_ANNOTATION, config_map_plan_bytes

log = logging.getLogger(__name__)

SERVER_PORT = 8000
SERVER_LABELS = "app.kubernetes.io/name=loraplex-server"
BASE_LABEL = "loraplex.io/base-model"
GROUP_VERSION = "loraplex.io/v1alpha1"


class KubeAPI:
    def __init__(self, api_url: str, session: aiohttp.ClientSession, *,
                 token_file: Path | None = None, ca_file: Path | None = None) -> None:
        self.api_url = api_url.rstrip("/")
        self._session = session
        self._token_file = token_file
        self._ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True

    def _headers(self) -> dict[str, str]:
        if self._token_file is None:
            return {}
        # Re-read each time: projected service-account tokens rotate.
        return {"Authorization": "Bearer " + self._token_file.read_text().strip()}

    async def get_json(self, path: str, params: dict[str, str] | None = None) -> Any:
        url = self.api_url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        async with self._session.get(url, headers=self._headers(), ssl=self._ssl,
                                     timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=(await r.text())[:200])
            return await r.json()

    async def post_json(self, path: str, body: dict) -> tuple[int, Any]:
        """POST a JSON body; (HTTP status, the JSON answer or None)."""
        async with self._session.post(self.api_url + path, json=body, headers=self._headers(), ssl=self._ssl,
                                      timeout=aiohttp.ClientTimeout(total=10)) as r:
            try:
                return r.status, await r.json(content_type=None)
            except ValueError:
                return r.status, None

    async def merge_patch(self, path: str, body: dict) -> int:
        """PATCH with a JSON merge patch; returns the HTTP status."""
        headers = {**self._headers(), "Content-Type": "application/merge-patch+json"}
        async with self._session.patch(self.api_url + path, json=body, headers=headers, ssl=self._ssl,
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status >= 400:
                log.debug("PATCH %s: %d %s", path, r.status, (await r.text())[:200])
            return r.status


class KubePods:
    """Server pods on this node: GET /api/v1/pods?fieldSelector=spec.nodeName=<node>
    [,metadata.namespace=<namespace>]&labelSelector=<server labels>,loraplex.io/base-model=<base>.
    Ready = the pod's Ready condition is True (and it is not being deleted). With a namespace
    (the plan's), only its pods: another namespace's BaseModel of the same name runs other
    tenants' servers, which this plan's pins and prefetches are not for."""

    def __init__(self, api: KubeAPI, node_name: str, port: int = SERVER_PORT, namespace: str | None = None) -> None:
        self.api = api
        self.node_name = node_name
        self.port = port
        self.namespace = namespace

    async def servers(self, base_model: str) -> dict[str, tuple[str, bool]]:
        fields = f"spec.nodeName={self.node_name}"
        if self.namespace is not None:
            fields += f",metadata.namespace={self.namespace}"
        body = await self.api.get_json("/api/v1/pods", {
            "fieldSelector": fields,
            "labelSelector": f"{SERVER_LABELS},{BASE_LABEL}={base_model}",
        })
        out = {}
        for pod in body.get("items", []):
            meta, status = pod.get("metadata", {}), pod.get("status", {})
            ip = status.get("podIP")
            if not ip or meta.get("deletionTimestamp"):
                continue
            if self.namespace is not None and meta.get("namespace") != self.namespace:
                continue  # (a field selector an API server did not apply)
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            host = f"[{ip}]" if ":" in ip else ip
            out[meta.get("uid") or meta.get("name")] = (f"http://{host}:{self.port}", ready)
        return out


class PlanConfigMap:
    """The operator's plan read through the API: GET the ConfigMap `<base>-plan`, key
    plan.json; identity = its resourceVersion. For a DaemonSet in another namespace than
    the BaseModel (a pod can mount ConfigMaps of its own namespace only)."""

    def __init__(self, api: KubeAPI, namespace: str, name: str, key: str = "plan.json") -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.key = key

    def __str__(self) -> str:
        return f"configmap {self.namespace}/{self.name}"

    async def read(self, known: object) -> tuple[object, bytes | None]:
        try:
            body = await self.api.get_json(f"/api/v1/namespaces/{self.namespace}/configmaps/{self.name}")
        except aiohttp.ClientResponseError as e:
            if e.status == 404:
                return None, None
            raise
        return _plan_in(body, known, self.key)


def _plan_in(body: dict, known: object, key: str) -> tuple[object, bytes | None]:
    """(identity, plan bytes) of a plan ConfigMap's body, as PlanSource.read answers: bytes None
    when its resourceVersion is `known`, (None, None) when it holds no plan under `key`."""
    identity = (body.get("metadata") or {}).get("resourceVersion")
    if identity is not None and identity == known:
        return identity, None
    try:
        raw = config_map_plan_bytes(body, key)
    except ValueError as e:  # binascii.Error
        raise ValueError(f"its binaryData {key!r} is not base64 ({e})") from None
    return (identity, raw) if raw is not None else (None, None)


@dataclass(frozen=True)
class FoundPlan:
    """A plan ConfigMap `PlanMirrors` found: the plan it copies (`namespace`/`name`: a BaseModel's
    `<base>-plan`, whose namespace its adapters belong to) and the ConfigMap itself."""

    namespace: str
    name: str
    where: str  # the found ConfigMap's namespace
    mirror: str  # and name
    body: dict

    @property
    def key(self) -> str:
        """The plan followed, as --plan-configmap names it."""
        return f"{self.namespace}/{self.name}"


class PlanMirrors:
    """The plans of one namespace that a label selector finds:
    GET /api/v1/namespaces/<namespace>/configmaps?labelSelector=<selector>.

    Each ConfigMap found is a copy of a plan (the operator's mirror, `loraplex-operator
    --plan-mirror-namespace`), which its annotation loraplex.io/plan-of names as NAMESPACE/NAME:
    that namespace is the plan's, its adapters', its servers'. One without that annotation
    (or with a namespace that is not a Kubernetes namespace name) is skipped, logged once."""

    def __init__(self, api: KubeAPI, namespace: str, selector: str) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self._skipped: set[str] = set()  # ConfigMaps logged as not plans, while they stay so

    def __str__(self) -> str:
        return f"configmaps in {self.namespace} labelled {self.selector}"

    async def list(self) -> dict[str, FoundPlan]:
        """{"namespace/name" of the plan: what was found}. Raises what the API call raises."""
        body = await self.api.get_json(f"/api/v1/namespaces/{self.namespace}/configmaps",
                                       {"labelSelector": self.selector})
        found: dict[str, FoundPlan] = {}
        skipped: set[str] = set()
        for cm in sorted(body.get("items") or [], key=lambda c: str((c.get("metadata") or {}).get("name"))):
            meta = cm.get("metadata") or {}
            mirror = str(meta.get("name"))
            annotations = meta.get("annotations") or {}
            namespace, _, name = str(annotations.get(PLAN_OF_ANNOTATION) or "").partition("/")
            why = None
            if not is_namespace(namespace) or not name or "/" in name:
                why = f"its annotation {PLAN_OF_ANNOTATION} is not NAMESPACE/NAME"
            elif annotations.get(PLAN_NAMESPACE_ANNOTATION, namespace) != namespace:
                why = f"its annotations {PLAN_OF_ANNOTATION} and {PLAN_NAMESPACE_ANNOTATION} disagree"
            elif f"{namespace}/{name}" in found:
                why = f"{found[f'{namespace}/{name}'].mirror} is the plan {namespace}/{name} already"
            if why is not None:
                if mirror not in self._skipped:
                    log.warning("configmap %s/%s is not followed as a plan: %s", self.namespace, mirror, why)
                skipped.add(mirror)
                continue
            found[f"{namespace}/{name}"] = FoundPlan(namespace, name, self.namespace, mirror, cm)
        self._skipped = skipped
        return found


class ListedPlan:
    """A found plan as a PlanSource: its ConfigMap as the latest listing gave it (`update`), so
    one LIST a poll serves every found plan, with no GET of each. Identity: resourceVersion."""

    def __init__(self, found: FoundPlan, key: str = "plan.json") -> None:
        self.found = found
        self.key = key

    def update(self, found: FoundPlan) -> None:
        self.found = found

    def __str__(self) -> str:
        return f"configmap {self.found.where}/{self.found.mirror} (the plan {self.found.key})"

    async def read(self, known: object) -> tuple[object, bytes | None]:
        return _plan_in(self.found.body, known, self.key)


class StatusReporter:
    """Reports this node's staging of each adapter under its LoRAAdapter's status.nodes.

    Callers record states (`staging`, `staged`, `failed`, `removed`) without waiting; `run`
    sends them, latest state per adapter only, and resends after an API failure. A state
    equal to the last one sent is not sent again.
    """

    def __init__(self, api: KubeAPI, namespace: str, node_name: str, *, retry_seconds: float = 5.0) -> None:
        self.api = api
        self.namespace = namespace
        self.node_name = node_name
        self.retry_seconds = retry_seconds
        self._sent: dict[str, dict | None] = {}
        self._sending: dict[str, dict | None] = {}  # the batch `flush` is sending now
        self._pending: dict[str, dict | None] = {}
        self._wake = asyncio.Event()

    def staging(self, name: str) -> None:
        self._record(name, {"phase": "Staging", "message": ""})

    def staged(self, name: str, nbytes: int) -> None:
        self._record(name, {"phase": "Staged", "message": "", "bytes": nbytes})

    def failed(self, name: str, reason: str, message: str) -> None:
        self._record(name, {"phase": "Failed", "message": f"{reason}: {message}"[:1000]})

    def removed(self, name: str) -> None:
        """Not on this node's disk any more: the node's key is deleted (merge patch null)."""
        self._record(name, None)

    def reported(self, name: str) -> bool:
        """Whether the latest state recorded for `name` in this run (pending, on its way or
        sent) is one on this node's entry: Staging, Staged or Failed, not removed."""
        for states in (self._pending, self._sending, self._sent):
            if name in states:
                return states[name] is not None
        return False

    def _record(self, name: str, state: dict | None) -> None:
        # Compared with the state on its way to the API, if any, else the last one sent: a
        # state equal to the one sent before an in-flight one must still be sent after it.
        last = self._sending[name] if name in self._sending else self._sent.get(name, ...)
        if last == state:  # e.g. Staging then the same Failed again
            self._pending.pop(name, None)
            return
        self._pending[name] = state
        self._wake.set()

    @property
    def idle(self) -> bool:
        return not self._pending

    async def flush(self) -> None:
        """Send what is pending now; failed sends stay pending."""
        batch, self._pending = self._pending, {}
        self._sending = batch
        try:
            for name, state in list(batch.items()):
                path = (f"/apis/{GROUP_VERSION}/namespaces/{self.namespace}/loraadapters/"
                        f"{urllib.parse.quote(name)}/status")
                body = {"status": {"nodes": {self.node_name: state}}}
                try:
                    status = await self.api.merge_patch(path, body)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    status, detail = None, str(e)
                else:
                    detail = str(status)
                if status is not None and (status < 300 or status == 404):  # 404: the adapter is gone
                    self._sent[name] = state
                else:
                    log.warning("cannot report %s on %s: %s; will retry", name, self.node_name, detail)
                    self._pending.setdefault(name, state)
                del batch[name]
        finally:
            self._sending = {}

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
            if self._pending:  # some failed: retry later
                await asyncio.sleep(self.retry_seconds)
                self._wake.set()
