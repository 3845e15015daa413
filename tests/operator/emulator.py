"""A Kubernetes API emulator that kopf and kubectl can run against, over real HTTP.

kmock 0.8's `KubernetesEmulator` (by kopf's author) serves discovery and keeps objects in
memory, but does not run a kopf operator as shipped. This subclass keeps its HTTP server,
request DSL (a test's own reactions, e.g. `emulator["get", "/api/..."][:1] << 401`, still
win), discovery, and object store (`emulator.objects[...]` keeps every version, so a test
can count writes), and replaces its fallback handlers to close these gaps:

    kmock 0.8                                    here
    no resourceVersion/uid/generation/           set on create; resourceVersion on every change,
      creationTimestamp                            generation on spec changes (kopf's finalizer
                                                   JSON-patch tests resourceVersion)
    create answers 200                           201
    failed JSON-patch `test` gives 500           422 Invalid (kopf retries on 422)
    GET /api/v1/namespaces fails                 namespaces are a cluster-scoped resource
    no PUT                                       PUT replaces (with resourceVersion preconditions)
    a /status patch can change spec              /status changes only status; the main resource
                                                   never changes status (when it has /status)
    lists lack kind, fake resourceVersion        <Kind>List, the real resourceVersion
    watch streams never close, replay all        ?timeoutSeconds closes them; ?resourceVersion
                                                   replays only later events
    no label/field selectors                     equality / existence labelSelector, metadata.name
                                                   and metadata.namespace fieldSelector
    CRDs applied are not served                  creating a CRD serves its resource (discovery),
                                                   Established at once
    core group written "/v1" in discovery        "v1" (kubectl maps kinds by it)
    no /openapi/v3 (kubectl validates with it)   per group-version PATCH paths advertising
                                                   fieldValidation, and the CRDs' schemas
    no Table output                              `kubectl get` gets the CRD's printer columns
    no garbage collection                        owner references followed on deletion (background)
    every patch is a write                       a patch that changes nothing writes nothing

What it still cannot prove (tests that pass here can fail on a cluster): the API server's
schema validation, pruning and defaulting of CRs (kubectl sends fieldValidation=Strict and
nothing checks it); admission; RBAC and authentication (any token is accepted); server-side
apply and strategic merge patches (both treated as JSON merge patches); protobuf bodies
(`kubectl create` of built-in kinds sends them: answered 415, use `kubectl apply`); pods ever
running (Deployment status is whatever a test patches); watch semantics under load
(bookmarks, 410 Gone, compaction).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import secrets
import traceback
import uuid
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import apps, parsing, rendering

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?(?:/(status|finalize))?/?$")


class ApiError(Exception):
    """An error answered as a Kubernetes `Status` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _label_match(labels: Mapping[str, str], selector: str) -> bool:
    """`a=b,c!=d,e,!f` (equality and existence; set-based `in` is not supported)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field_match(obj: Mapping[str, Any], selector: str) -> bool:
    meta = obj.get("metadata", {})
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        actual = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}.get(key.strip())
        if (actual == value.strip()) == negate:
            return False
    return True


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _json_path(obj: Any, path: str) -> Any:
    """The `.a.b` paths printer columns use (no filters, no wildcards)."""
    for part in path.strip().lstrip(".").split("."):
        if not isinstance(obj, Mapping) or part not in obj:
            return None
        obj = obj[part]
    return obj


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the semantics kopf and kubectl rely on (see the module doc)."""

    base_url: str = attrs.field(default="", init=False)  # set once a kmock.Server serves it
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _tick: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    _crd_columns: dict[kmock.resource, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    _crd_schemas: dict[kmock.resource, tuple[str, dict[str, Any]]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()  # the built-in kinds: configmaps, deployments, events, ...
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.fallback["get", re.compile(r"/openapi/v3(/.*)?")] << self._serve_openapi

    # Discovery: kmock writes the core group as "/v1" and gives subresources the short names
    # of their resource (kubectl then warns "short name could also match ...").

    async def _serve_version(self, request: rendering.Request) -> dict[str, Any]:
        assert request.resource is not None
        group, version = request.resource.group, request.resource.version
        entries = []
        for resource in sorted(self.resources, key=lambda r: str(r.plural)):
            if resource.group != group or resource.version != version:
                continue
            info = self.resources[resource]
            entry = {"name": resource.plural, "singularName": info.singular or "", "kind": info.kind,
                     "namespaced": bool(info.namespaced), "verbs": sorted(info.verbs)}
            if info.shortnames:
                entry["shortNames"] = sorted(info.shortnames)
            if info.categories:
                entry["categories"] = sorted(info.categories)
            entries.append(entry)
            entries += [{"name": f"{resource.plural}/{sub}", "singularName": "", "kind": info.kind,
                         "namespaced": bool(info.namespaced), "verbs": ["get", "patch", "update"]}
                        for sub in sorted(info.subresources)]
        if not entries and group != "":
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{version})")
        return {"apiVersion": "v1", "kind": "APIResourceList",
                "groupVersion": f"{group}/{version}" if group else str(version), "resources": entries}

    # Parsing: kmock takes `/api/v1/namespaces` for "namespace <missing>".

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        await raw_request.read()
        try:
            request = await self._parse(raw_request)
            self._requests.append(request)
            return await self._handle(request)
        except ApiError as exc:
            return self._status(exc.code, exc.reason, exc.message)
        except kmock.KubernetesError as exc:  # kmock's own, e.g. an unknown endpoint
            return self._status(exc.status, "NotFound" if exc.status == 404 else str(exc.reason), str(exc.message))
        except Exception as exc:  # answered as 500 with the traceback, and kept for assertions
            if self._errors:
                self._errors[-1].append(exc)
            return self._status(500, "InternalError", "".join(traceback.format_exception(exc)))

    async def _parse(self, raw_request: aiohttp.web.BaseRequest) -> rendering.Request:
        match = _NAMESPACE_PATH.match(raw_request.path)
        if not match:
            return await rendering.Request._parse(raw_request, id=len(self._requests))
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            raise ApiError(415, "UnsupportedMediaType", "only JSON bodies are understood here") from None
        name, subresource = match.groups()
        method = kmock.method(raw_request.method)
        path = parsing.ParsedPath("", "v1", "namespaces", None, name, subresource)
        return rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=raw_request.method,
            params=dict(raw_request.query), headers=dict(raw_request.headers), data=data, body=body,
            text=body.decode("utf-8", "replace"), action=parsing.guess_k8s(path, method, dict(raw_request.query)),
            resource=NAMESPACES, namespace=None, name=name, subresource=subresource,
        )

    # Serving: kmock routes requests through its DSL, so reactions a test adds (errors,
    # delays) take precedence; what is left falls back to these methods. KubernetesEmulator's
    # own state keeping in `_handle` is skipped: the fallbacks below keep the state.

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.resource.plural is not None and \
                request.resource not in list(self.resources):
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({request.url.path})")
        return await apps.RawHandler._handle(self, request)

    async def _serve_list(self, request: rendering.Request) -> dict[str, Any]:
        return self._json(self._list(request), request)

    async def _serve_fetch(self, request: rendering.Request) -> dict[str, Any]:
        return self._json(self._get(request), request)

    async def _serve_create(self, request: rendering.Request) -> rendering.Response:
        return rendering.Response(status=201, payload=self._create(request))

    async def _serve_update(self, request: rendering.Request) -> dict[str, Any]:
        return self._patch(request)

    async def _serve_replace(self, request: rendering.Request) -> dict[str, Any]:
        if request.resource is None or request.resource.plural is None or request.name is None:
            raise ApiError(405, "MethodNotAllowed", f"PUT is not supported on {request.url.path}")
        return self._replace(request)

    async def _serve_delete(self, request: rendering.Request) -> dict[str, Any]:
        return self._delete(request)

    async def _serve_openapi(self, request: rendering.Request) -> dict[str, Any]:
        return self._openapi(request.url.path)

    # Reads.

    def _key(self, request: rendering.Request, name: str | None = None) -> tuple[kmock.resource, str | None, str]:
        assert request.resource is not None
        namespaced = self.resources[request.resource].namespaced
        namespace = request.namespace if namespaced else None
        return request.resource, namespace, name or request.name or ""

    def _current(self, key: tuple[kmock.resource, str | None, str]) -> dict[str, Any] | None:
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else copy.deepcopy(obj.raw)

    def _get(self, request: rendering.Request) -> dict[str, Any]:
        found = self._current(self._key(request))
        if found is None:
            raise ApiError(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')  # type: ignore[union-attr]
        return found

    def _matching(self, request: rendering.Request) -> list[dict[str, Any]]:
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        items = []
        for (resource, namespace, _), obj in self.objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = obj.raw
            if labels and not _label_match(raw.get("metadata", {}).get("labels") or {}, labels):
                continue
            if fields and not _field_match(raw, fields):
                continue
            items.append(copy.deepcopy(raw))
        return sorted(items, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _list(self, request: rendering.Request) -> dict[str, Any]:
        assert request.resource is not None
        info = self.resources[request.resource]
        return {
            "apiVersion": self._api_version(request.resource),
            "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": self._matching(request),
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        """Events as JSON lines: after ?resourceVersion (else the current state as ADDED
        first), until ?timeoutSeconds has passed (else until the client goes away)."""
        since = request.params.get("resourceVersion") or "0"
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        yield b""  # send the headers now, as the API server does
        if since in ("", "0"):
            for obj in self._matching(request):
                yield {"type": "ADDED", "object": obj}
            position = len(self._log)
        else:
            position = next((i for i, (rv, _, _) in enumerate(self._log) if rv > int(since)), len(self._log))
        while True:
            while position < len(self._log):
                _, resource, event = self._log[position]
                position += 1
                if resource == request.resource and self._event_matches(request, event["object"]):
                    yield event
            tick = self._tick
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                await asyncio.wait_for(tick.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                return

    def _event_matches(self, request: rendering.Request, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        return (not labels or _label_match(meta.get("labels") or {}, labels)) and \
            (not fields or _field_match(obj, fields))

    # Writes.

    def _create(self, request: rendering.Request) -> dict[str, Any]:
        assert request.resource is not None
        body = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if body is None:
            raise ApiError(400, "BadRequest", "the body of a create must be a JSON object")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        info = self.resources[request.resource]
        if info.namespaced:
            if meta.get("namespace") and request.namespace and meta["namespace"] != request.namespace:
                raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
            meta["namespace"] = request.namespace or meta.get("namespace") or "default"
        key = self._key(request, meta["name"])
        key = (key[0], meta.get("namespace") if info.namespaced else None, key[2])
        if self._current(key) is not None:
            raise ApiError(409, "AlreadyExists", f'{request.resource.plural} "{meta["name"]}" already exists')
        body["apiVersion"] = self._api_version(request.resource)
        body["kind"] = info.kind
        if self._has_status(request.resource):
            body.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
        meta.pop("deletionTimestamp", None)
        if request.params.get("dryRun"):
            return body
        return self._store(key, body, "ADDED")

    def _patch(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        old = self._get(request)
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip()
        if content_type == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(old, request.data, in_place=False)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiError(422, "Invalid", f"the JSON patch test failed: {exc}") from exc
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiError(422, "Invalid", f"the JSON patch cannot be applied: {exc}") from exc
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            new = merge_patch(old, request.data)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"patch type {content_type!r} is not supported here")
        return self._update(request, key, old, new)

    def _replace(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        old = self._get(request)
        new = copy.deepcopy(request.data)
        if not isinstance(new, dict):
            raise ApiError(400, "BadRequest", "the body of a replace must be a JSON object")
        wanted_rv = new.get("metadata", {}).get("resourceVersion")
        if not wanted_rv:
            raise ApiError(422, "Invalid", "metadata.resourceVersion: must be specified for an update")
        return self._update(request, key, old, new)

    def _update(self, request: rendering.Request, key: Any, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        assert request.resource is not None
        old_meta, new_meta = old["metadata"], new.setdefault("metadata", {})
        wanted_rv = new_meta.get("resourceVersion")
        if wanted_rv is not None and wanted_rv != old_meta.get("resourceVersion"):
            raise ApiError(409, "Conflict", "the object has been modified; please apply your changes to the"
                                            " latest version and try again")
        for field in ("uid", "name", "namespace", "creationTimestamp", "generation", "deletionTimestamp"):
            if field in old_meta:
                new_meta[field] = old_meta[field]
            else:
                new_meta.pop(field, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if self._has_status(request.resource):
            if request.subresource == "status":  # only status changes through /status
                new = {**old, "status": new.get("status")} if new.get("status") is not None else \
                    {k: v for k, v in old.items() if k != "status"}
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new_meta = new["metadata"]
        if old_meta.get("deletionTimestamp"):  # no new finalizers on an object being deleted
            new_meta["finalizers"] = [f for f in new_meta.get("finalizers") or [] if f in (old_meta.get("finalizers") or [])]
        new_meta["resourceVersion"] = old_meta.get("resourceVersion")
        if new == old:
            return old  # a no-op writes nothing, like the API server
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                {k: v for k, v in old.items() if k not in ("metadata", "status")}:
            new_meta["generation"] = int(old_meta.get("generation") or 1) + 1
        if request.params.get("dryRun"):
            return new
        if new_meta.get("deletionTimestamp") and not new_meta.get("finalizers"):
            return self._remove(key, new)
        return self._store(key, new, "MODIFIED")

    def _delete(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        old = self._get(request)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return old
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = now_rfc3339()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self._store(key, new, "MODIFIED")
        return self._remove(key, old)

    def _store(self, key: Any, body: dict[str, Any], kind: str) -> dict[str, Any]:
        self._rv += 1
        body["metadata"]["resourceVersion"] = str(self._rv)
        if key[0] == CRDS:
            self._serve_crd(body)
        if key in self.objects and not self.objects[key].deleted:
            self.objects[key].history.append(copy.deepcopy(body))
        elif key in self.objects:
            self.objects[key].create(copy.deepcopy(body))
        else:
            self.objects[key] = copy.deepcopy(body)
        self._emit(key[0], kind, body)
        return body

    def _remove(self, key: Any, body: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        body["metadata"]["resourceVersion"] = str(self._rv)
        self.objects[key].history.append(copy.deepcopy(body))
        self.objects[key].delete()
        if key[0] == CRDS:
            self._unserve_crd(body)
        self._emit(key[0], "DELETED", body)
        self._collect_garbage(body["metadata"]["uid"])
        return body

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background deletion: dependents whose every owner is gone are deleted."""
        live = {obj.raw["metadata"].get("uid") for obj in self.objects.values() if not obj.deleted}
        for key, obj in list(self.objects.items()):
            if obj.deleted:
                continue
            owners = obj.raw["metadata"].get("ownerReferences") or []
            if owners and any(o.get("uid") == owner_uid for o in owners) and \
                    not any(o.get("uid") in live for o in owners):
                request = rendering.Request(resource=key[0], namespace=key[1], name=key[2])
                self._delete(request)

    def _emit(self, resource: kmock.resource, kind: str, body: dict[str, Any]) -> None:
        self._log.append((self._rv, resource, {"type": kind, "object": copy.deepcopy(body)}))
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    # CRDs: served once created, with their printer columns and schemas.

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                namespaced=spec.get("scope") == "Namespaced", kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(), shortnames=names.get("shortNames", []),
                categories=names.get("categories", []),
                verbs=["create", "delete", "get", "list", "patch", "update", "watch"],
                subresources=["status"] if "status" in (version.get("subresources") or {}) else [],
            )
            self._crd_columns[resource] = list(version.get("additionalPrinterColumns") or [])
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
            self._crd_schemas[resource] = (names["kind"], schema)
        # Established at once: `kubectl wait --for=condition=Established` works.
        if not (crd.get("status") or {}).get("conditions"):
            crd["status"] = {"acceptedNames": names, "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now_rfc3339()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": now_rfc3339()},
            ]}

    def _unserve_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        for version in spec.get("versions", []):
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            if resource in list(self.resources):
                del self.resources[resource]

    def _has_status(self, resource: kmock.resource) -> bool:
        return "status" in self.resources[resource].subresources

    @staticmethod
    def _api_version(resource: kmock.resource) -> str:
        return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)

    # Responses.

    def _json(self, payload: dict[str, Any], request: rendering.Request) -> dict[str, Any]:
        """The object or list, or a Table of it when kubectl asks for one (`kubectl get`)."""
        if "as=Table" in request.headers.get("Accept", ""):
            items = payload["items"] if "items" in payload else [payload]
            payload = self._table(request, items)
        return payload

    def _table(self, request: rendering.Request, items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        assert request.resource is not None
        columns = self._crd_columns.get(request.resource, [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}])
        definitions = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
        definitions += [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                         "description": c.get("description", ""), "priority": c.get("priority", 0)} for c in columns]
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for column in columns:
                value = _json_path(obj, column["jsonPath"])
                cells.append(_age(value) if column.get("type") == "date" else value)
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                    "metadata": obj["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(self._rv)},
                "columnDefinitions": definitions, "rows": rows}

    def _openapi(self, path: str) -> dict[str, Any]:
        """OpenAPI v3: per group-version, each kind's PATCH path with the `fieldValidation`
        parameter (so kubectl leaves validation to the server, which here does none) and
        the CRDs' schemas as components."""
        by_gv: dict[str, dict[str, Any]] = {}
        for resource in list(self.resources):
            info = self.resources[resource]
            if not info.kind or "patch" not in info.verbs:
                continue
            gv = f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"
            doc = by_gv.setdefault(gv, {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"},
                                        "paths": {}, "components": {"schemas": {}}})
            gvk = {"group": resource.group, "version": resource.version, "kind": info.kind}
            scope = "/namespaces/{namespace}" if info.namespaced else ""
            doc["paths"][f"/{gv}{scope}/{resource.plural}/{{name}}"] = {"patch": {
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK"}},
            }}
            if resource in self._crd_schemas:
                kind, schema = self._crd_schemas[resource]
                name = ".".join(reversed(str(resource.group).split("."))) + f".{resource.version}.{kind}"
                doc["components"]["schemas"][name] = {**schema, "x-kubernetes-group-version-kind": [gvk]}
        if path.rstrip("/") == "/openapi/v3":
            return {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={self._rv}"} for gv in by_gv}}
        gv = path[len("/openapi/v3/"):].strip("/")
        if gv not in by_gv:
            raise ApiError(404, "NotFound", f"no OpenAPI document for {gv}")
        return by_gv[gv]

    @staticmethod
    def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                          "code": code, "reason": reason, "message": message}, status=code)
