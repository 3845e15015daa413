"""A small async Kubernetes API client for the objects kopf does not patch for us.

kopf patches the object a handler runs for; the operator also writes other objects: the
plan ConfigMap, the serving Deployment and Service, the status of adapters whose
pinning moved because another adapter changed, and the plans' mirrors (listed and deleted
in the mirror namespace alone). This client does just that: GET, list, POST, merge-PATCH,
DELETE, with the same credentials kopf uses (service account in a pod, kubeconfig
outside), over aiohttp, which kopf already depends on.

    kube = KubeClient(login(settings))
    await kube.ensure(desired_config_map)                    # create, patch, or leave alone
    await kube.patch_status(ADAPTERS, "ml", "a", {"pinned": True})
    await kube.list_objects(CONFIG_MAPS, "loraplex-system", "loraplex.io/plan-mirror=true")
    await kube.delete(CONFIG_MAPS.path("loraplex-system", "ml.llama-3-8b-plan"))
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import logging
import ssl
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from loraplex.operator import workloads
from loraplex.operator.specs import GROUP, VERSION

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Resource:
    """Where a kind lives in the API: ("", "v1", "configmaps") -> /api/v1/..."""

    group: str
    version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path; namespace None for cluster-scoped kinds."""
        prefix = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        scope = f"/namespaces/{namespace}" if namespace is not None else ""
        path = f"{prefix}{scope}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


CONFIG_MAPS = Resource("", "v1", "configmaps")
SERVICES = Resource("", "v1", "services")
DEPLOYMENTS = Resource("apps", "v1", "deployments")
AUTOSCALERS = Resource("autoscaling", "v2", "horizontalpodautoscalers")
BASE_MODELS = Resource(GROUP, VERSION, "basemodels")
ADAPTERS = Resource(GROUP, VERSION, "loraadapters")
_BY_KIND = {"ConfigMap": CONFIG_MAPS, "Service": SERVICES, "Deployment": DEPLOYMENTS,
            "HorizontalPodAutoscaler": AUTOSCALERS}
# Kinds whose spec is the operator's whole (workloads.autoscaler): replaced (PUT) when they
# differ, so that a field the desired object no longer has goes; merge-patched otherwise.
REPLACED_KINDS = frozenset({"HorizontalPodAutoscaler"})


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message  # the API server's own words (a Status object's message)


class NotOwned(KubeError):
    """`ensure` found another owner's object under the name it needs; nothing was written."""

    def __init__(self, kind: str, namespace: str, name: str, why: str) -> None:
        message = f"{kind} {namespace}/{name} already exists and is not this BaseModel's ({why})"
        Exception.__init__(self, message)
        self.status, self.message = 409, message


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The same credentials kopf's own login would find: service account, then kubeconfig."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.PermanentError("no Kubernetes credentials: no service account and no kubeconfig")
    return info


class KubeClient:
    """GET / POST / merge-PATCH against one API server. Errors raise `KubeError`."""

    def __init__(self, info: kopf.ConnectionInfo, timeout: float = 30.0,
                 relogin: Callable[[], kopf.ConnectionInfo] | None = None) -> None:
        self._info = info
        self._relogin = relogin  # on a 401: service account tokens are rotated on disk
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._tempfiles: list[Any] = []

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        for f in self._tempfiles:
            f.close()
        self._tempfiles.clear()

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at `path`, or None when it does not exist."""
        try:
            return await self._request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list_objects(self, resource: Resource, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        """The objects of a collection (`namespace` None: every namespace), by label if asked."""
        params = {"labelSelector": label_selector} if label_selector else {}
        body = await self._request("GET", resource.path(namespace), params=params)
        return list(body.get("items") or ())

    async def delete(self, path: str) -> bool:
        """Delete the object at `path`; False when it was gone already."""
        try:
            await self._request("DELETE", path)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, json=body)

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", path, json=body,
                                   headers={"Content-Type": "application/merge-patch+json"})

    async def patch_status(self, resource: Resource, namespace: str, name: str,
                           status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge-patch `status` through the status subresource; None if the object is gone."""
        try:
            return await self.merge_patch(resource.path(namespace, name, "status"), {"status": status})
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def ensure(self, desired: Mapping[str, Any]) -> str:
        """Create `desired` or patch the parts we own (replace it, for REPLACED_KINDS); returns
        "created", "patched", "replaced" or "unchanged".
        Raises `NotOwned`, writing nothing, when the name is taken by an object that is not ours
        (`workloads.foreign_owner`)."""
        resource = _BY_KIND[desired["kind"]]
        meta = desired["metadata"]
        path = resource.path(meta["namespace"], meta["name"])
        existing = await self.get(path)
        if existing is None:
            try:
                await self.create(resource.path(meta["namespace"]), desired)
                return "created"
            except KubeError as exc:
                if exc.status != 409:
                    raise
                existing = await self.get(path)  # created meanwhile: fall through to compare
                if existing is None:
                    raise
        why = workloads.foreign_owner(existing, desired)
        if why is not None:
            raise NotOwned(desired["kind"], meta["namespace"], meta["name"], why)
        if not workloads.needs_update(existing, desired):
            return "unchanged"
        have = existing.get("metadata") or {}
        refs = workloads.owner_references(existing, desired)  # ours, beside others' (kept)
        if desired["kind"] in REPLACED_KINDS:
            # The spec replaced whole; of the metadata, what others put there (labels,
            # annotations, owner references, finalizers) is kept beside ours.
            body = copy.deepcopy(dict(desired))
            body["metadata"] = {**body["metadata"], "resourceVersion": have.get("resourceVersion"),
                                "labels": {**(have.get("labels") or {}), **(meta.get("labels") or {})},
                                "annotations": {**(have.get("annotations") or {}), **(meta.get("annotations") or {})},
                                **({"ownerReferences": refs} if refs is not None else {}),
                                **({"finalizers": have["finalizers"]} if have.get("finalizers") else {})}
            await self._request("PUT", path, json=body)  # a 409 (changed meanwhile): the next run tries again
            return "replaced"
        owned = {key: desired[key] for key in ("spec", "data", "binaryData") if key in desired}
        if desired["kind"] == "ConfigMap":  # a key lives in data or binaryData, never both
            owned = {"data": None, "binaryData": None, **owned}
        patch_meta = {key: meta[key] for key in ("labels", "annotations") if meta.get(key)}
        if refs is not None and refs != (have.get("ownerReferences") or []):
            # A merge patch replaces the list whole: it carries others' entries, and the version
            # they were read at, so that one added meanwhile is not dropped (409: the next run
            # tries again). Left out when ours are in place, the list is not touched.
            patch_meta["ownerReferences"] = refs
            if have.get("resourceVersion"):
                patch_meta["resourceVersion"] = have["resourceVersion"]
        patch = {"metadata": patch_meta, **owned}
        await self.merge_patch(path, patch)
        return "patched"

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            return await self._send(method, path, **kwargs)
        except KubeError as exc:
            if exc.status != 401 or self._relogin is None:
                raise
        logger.info("credentials refused (401): logging in again")
        self._info = self._relogin()
        if self._session is not None:
            await self._session.close()
            self._session = None
        return await self._send(method, path, **kwargs)

    async def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        session = self._session or self._open()
        url = self._info.server.rstrip("/") + path
        headers = dict(kwargs.pop("headers", {}))
        if self._info.token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {self._info.token}"
        async with session.request(method, url, headers=headers, **kwargs) as response:
            if response.status >= 400:
                raise KubeError(response.status, _status_message(await response.text()))
            result: dict[str, Any] = await response.json(content_type=None)
            return result

    def _open(self) -> aiohttp.ClientSession:
        info = self._info
        ctx: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            if info.insecure:
                ctx = False
            else:
                ctx = ssl.create_default_context(
                    cafile=str(info.ca_path) if info.ca_path else None,
                    cadata=_text(info.ca_data) if info.ca_data else None)
                cert = info.certificate_path or self._spill(info.certificate_data)
                key = info.private_key_path or self._spill(info.private_key_data)
                if cert:
                    ctx.load_cert_chain(str(cert), str(key) if key else None)
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        self._session = aiohttp.ClientSession(timeout=self._timeout, auth=auth,
                                              connector=aiohttp.TCPConnector(ssl=ctx if ctx is not None else True))
        return self._session

    def _spill(self, data: str | bytes | None) -> str | None:
        """ssl needs client certs as files; kubeconfigs carry them inline (base64 or PEM)."""
        if not data:
            return None
        f = tempfile.NamedTemporaryFile(suffix=".pem")
        f.write(_pem(data))
        f.flush()
        self._tempfiles.append(f)
        return f.name


def _status_message(text: str) -> str:
    """The message of the `Status` object an API server answers an error with, else the text."""
    try:
        status = json.loads(text)
    except ValueError:
        status = None
    if isinstance(status, dict) and isinstance(status.get("message"), str) and status["message"]:
        return status["message"][:1000]
    return text[:500]


def _text(data: str | bytes) -> str:
    return _pem(data).decode("ascii")


def _pem(data: str | bytes) -> bytes:
    raw = data.encode("ascii") if isinstance(data, str) else data
    return raw if raw.lstrip().startswith(b"-----") else base64.b64decode(raw)
