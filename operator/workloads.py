"""The objects the operator owns for each BaseModel, as plain dicts.

For a BaseModel `llama-3-8b` in namespace `ml`:

    ConfigMap  ml/llama-3-8b-plan   data: {"plan.json": <Plan.to_json()>}  (gzipped if large)
    Deployment ml/llama-3-8b        loraplex-server --model ... --plan-file /etc/loraplex/plan/plan.json
    Service    ml/llama-3-8b        port 8000, named http

and, with a mirror namespace (`loraplex-operator --plan-mirror-namespace loraplex-system`),
a copy of the plan where the node agents find every plan by one label selector:

    ConfigMap  loraplex-system/ml.llama-3-8b-plan   the plan's data; labelled
               loraplex.io/plan-mirror=true, annotated loraplex.io/plan-of: ml/llama-3-8b-plan

The handlers adopt them (`kopf.adopt`: owner reference, namespace) and write them only
when `needs_update` says the part we own differs from what is there, so an adapter change
touches the ConfigMap and never the Deployment.
"""

from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from loraplex.operator.specs import BaseModelSpec, quantity_value
from loraplex.operator.validation import local_path
from loraplex.server.plan_file import (PLAN_BASE_ANNOTATION, PLAN_MIRROR_LABEL, PLAN_NAMESPACE_ANNOTATION,
                                       PLAN_OF_ANNOTATION, config_map_plan_bytes, decode_plan)

MANAGED_BY = "loraplex-operator"
BASE_LABEL = "loraplex.io/base-model"
PLAN_KEY = "plan.json"
PLAN_ENCODING = "loraplex.io/plan-encoding"
# An object is at most 1 MiB in etcd; leave room for metadata. Plans above the plain limit
# are gzipped (10,000 adapters: 2.8 MB of JSON, 0.5 MB gzipped).
CONFIG_MAP_LIMIT = 1_000_000
PLAIN_PLAN_LIMIT = 900_000
PLAN_DIR = "/etc/loraplex/plan"
PLAN_FILE = f"{PLAN_DIR}/{PLAN_KEY}"
ADAPTER_CACHE_DIR = "/var/lib/loraplex/adapters"
# The node agent keeps each namespace's adapters in a folder of their own under its cache
# (node_agent.store): a server pod mounts its namespace's alone, so two namespaces' adapters
# of one name never meet, and no pod reads another namespace's weights.
NAMESPACES_DIR = ".namespaces"
# Triton's compiled kernels, kept on the node so that a restarted or rescheduled server
# does not compile them again. Measured on an H200 (bench/results/
# engine_h200_kv_buckets_notes.md): the start-up warm-up that compiles every kernel took
# 30.5 s with an empty cache (Llama-3-8B, 64 rows, prefills up to 32,768 tokens), and a step
# that compiles (without warm-up) stalls 1.2-2.9 s. Triton writes each entry to a temporary
# file and renames it, so servers on one node share it.
KERNEL_CACHE_DIR = "/var/lib/loraplex/kernel-cache"
# The digest of the spec the operator last wrote into an object it replaces whole (workloads.spec_hash).
SPEC_HASH_ANNOTATION = "loraplex.io/spec-hash"
# serving.apiKeys: the Secrets' keys mounted here, the tenants' keys file as keys.json and the
# admin key as admin-key, whole-folder (not subPath), so the kubelet's in-place update of a
# changed Secret reaches the server, which re-reads both files.
API_KEYS_DIR = "/etc/loraplex/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/keys.json"
ADMIN_KEY_FILE = f"{API_KEYS_DIR}/admin-key"
SERVER_PORT = 8000
# The server opens its port only once the weights are on the GPU and the warm-up has compiled
# its kernels and captured its decode graphs (30.5 s of compiling warm-up for Llama-3-8B on an
# H200 with an empty kernel cache; 43.5 s with the graph captures, another call; on top of
# reading the weights). A startup probe holds the liveness probe off for this long, so a
# slow first start is not killed as a hung server.
STARTUP_SECONDS = 900
# The node agent's API on each node (the DaemonSet's hostPort), reached at the node's IP.
NODE_AGENT_PORT = 8081
# The server's service-account token for the node agent (its --stage-token-audience): a
# projected token of this audience, which the kubelet rotates before it expires; the agent
# stages for the token's namespace alone.
NODE_AGENT_AUDIENCE = "loraplex-node-agent"
NODE_AGENT_TOKEN_DIR = "/var/run/secrets/loraplex/node-agent"
NODE_AGENT_TOKEN_FILE = f"{NODE_AGENT_TOKEN_DIR}/token"
NODE_AGENT_TOKEN_SECONDS = 3600


def namespace_cache_dir(namespace: str) -> str:
    """The host folder of a namespace's adapters in the node agent's cache."""
    return f"{ADAPTER_CACHE_DIR}/{NAMESPACES_DIR}/{namespace}"


def plan_config_map_name(base_name: str) -> str:
    return f"{base_name}-plan"


# The longest object name the API server takes (a DNS subdomain, RFC 1123).
MAX_NAME_LENGTH = 253


def plan_mirror_name(namespace: str, base_name: str) -> str:
    """The name of a plan's mirror in the mirror namespace: `<namespace>.<base>-plan`
    (`ml.llama-3-8b-plan`). One per plan of the cluster: a namespace has no dot, so the first
    dot tells namespace from name. A name past 253 characters is cut and ends in a hash of
    the whole (`<head>-<10 hex digits>`), so two long names that share a head stay two."""
    name = f"{namespace}.{plan_config_map_name(base_name)}"
    if len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    head = name[:MAX_NAME_LENGTH - len(digest) - 1].rstrip(".-")  # a label ends alphanumeric
    return f"{head}-{digest}"


def plan_mirror(plan_map: Mapping[str, Any], base_name: str, mirror_namespace: str) -> dict[str, Any]:
    """The mirror of a plan ConfigMap (`plan_config_map`'s, before adoption) in
    `mirror_namespace`: the same data (and encoding), labelled as a mirror and annotated with
    the plan it copies. No owner reference: one cannot name an owner in another namespace, so
    the operator deletes it when the BaseModel goes (handlers.basemodel_deleted), and its sweep
    deletes one whose BaseModel is gone anyway (Planner.sweep_mirrors)."""
    meta = plan_map["metadata"]
    namespace = meta["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": plan_mirror_name(namespace, base_name),
            "namespace": mirror_namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, PLAN_MIRROR_LABEL: "true"},
            "annotations": {**meta.get("annotations", {}), PLAN_OF_ANNOTATION: f"{namespace}/{meta['name']}",
                            PLAN_NAMESPACE_ANNOTATION: namespace, PLAN_BASE_ANNOTATION: base_name},
        },
        **{key: copy.deepcopy(plan_map[key]) for key in ("data", "binaryData") if key in plan_map},
    }


def labels(base_name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "loraplex-server",
        "app.kubernetes.io/instance": base_name,
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        BASE_LABEL: base_name,
    }


def selector_labels(base_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "loraplex-server", BASE_LABEL: base_name}


class PlanTooLarge(ValueError):
    """Even gzipped, the plan does not fit in one ConfigMap."""


def plan_config_map(base: BaseModelSpec, plan_json: str) -> dict[str, Any]:
    """The plan ConfigMap: `plan.json` as text, or gzipped in binaryData when it is large.

    Both mount as the same file, /etc/loraplex/plan/plan.json. Readers tell them apart by
    the gzip magic bytes (1f 8b) or the annotation `loraplex.io/plan-encoding: gzip`.
    The gzip stream has no timestamp, so the same plan still gives the same bytes.
    """
    meta = {
        "name": plan_config_map_name(base.name),
        "namespace": base.namespace,
        "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, BASE_LABEL: base.name},
        "annotations": {PLAN_ENCODING: "json"},
    }
    raw = plan_json.encode("utf-8")
    if len(raw) <= PLAIN_PLAN_LIMIT:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {PLAN_KEY: plan_json}}
    packed = gzip.compress(raw, compresslevel=9, mtime=0)
    if len(packed) * 4 // 3 > CONFIG_MAP_LIMIT:
        raise PlanTooLarge(f"the plan is {len(raw) / 1e6:.1f} MB ({len(packed) / 1e6:.1f} MB gzipped);"
                           f" a ConfigMap holds {CONFIG_MAP_LIMIT / 1e6:.1f} MB")
    meta["annotations"] = {PLAN_ENCODING: "gzip"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "binaryData": {PLAN_KEY: base64.b64encode(packed).decode("ascii")}}


def read_plan(config_map: Mapping[str, Any]) -> dict[str, Any]:
    """The plan in a ConfigMap as written by `plan_config_map` (either encoding)."""
    raw = config_map_plan_bytes(config_map, PLAN_KEY)
    if raw is None:
        raise KeyError(f"the ConfigMap has no {PLAN_KEY}")
    return decode_plan(raw)


def model_path(base: BaseModelSpec) -> str:
    """`--model`: serving.modelPath, else a local source, else /models/<name>."""
    if base.serving.model_path:
        return base.serving.model_path
    local = local_path(base.source)
    return str(local) if local is not None else f"/models/{base.name}"


def server_args(base: BaseModelSpec, slots: int) -> list[str]:
    """The server listens on every address of both families (--host "": probes and the
    Service reach it at the pod IP, IPv4 or IPv6 as the cluster gives, and 0.0.0.0 would
    leave an IPv6 pod unreachable), finds staged adapters in its namespace's folder of the
    node's cache and asks the node's agent for the others, in that namespace (NODE_IP comes
    from the downward API; Kubernetes expands
    $(NODE_IP) in args, with no brackets around an IPv6 address: the server's
    --node-agent-url reads `http://fd00::5:8081` as `http://[fd00::5]:8081`, so the one
    template serves IPv4 and IPv6 nodes)."""
    return [
        "--model", model_path(base),
        *(["--served-model-name", base.serving.served_model_name] if base.serving.served_model_name else []),
        "--host", "",
        "--port", str(SERVER_PORT),
        "--plan-file", PLAN_FILE,
        "--max-loras", str(max(slots, 1)),
        "--max-lora-rank", str(base.max_lora_rank),
        # The slots hold these projections' groups alone: the packing math counted no others.
        "--lora-target-modules", *base.target_modules,
        "--dtype", base.dtype,
        "--adapter-cache-dir", ADAPTER_CACHE_DIR,
        "--adapter-namespace", base.namespace,
        "--node-agent-url", f"http://$(NODE_IP):{NODE_AGENT_PORT}",
        "--node-agent-token-file", NODE_AGENT_TOKEN_FILE,
        # The engine's rows and lengths size the KV cache the packing math counted.
        *base.serving.engine.args(),
        *(["--api-key-file", ADMIN_KEY_FILE] if base.serving.api_keys.admin_key_secret else []),
        *(["--api-keys-file", API_KEYS_FILE] if base.serving.api_keys.tenant_keys_secret else []),
        *base.serving.extra_args,
    ]


def _api_key_parts(base: BaseModelSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volume mounts, volumes) for serving.apiKeys: one read-only projected volume at
    API_KEYS_DIR holding the admin key's Secret item as admin-key and the tenants' as keys.json
    (a projected volume is updated in place as a Secret volume is)."""
    keys = base.serving.api_keys
    sources = [{"secret": {"name": secret.name, "items": [{"key": secret.key, "path": path.rsplit("/", 1)[1]}]}}
               for secret, path in ((keys.admin_key_secret, ADMIN_KEY_FILE), (keys.tenant_keys_secret, API_KEYS_FILE))
               if secret is not None]
    if not sources:
        return [], []
    return ([{"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}],
            [{"name": "api-keys", "projected": {"sources": sources}}])


def deployment(base: BaseModelSpec, slots: int) -> dict[str, Any]:
    """The serving Deployment: the plan ConfigMap mounted read-only at /etc/loraplex/plan, the
    BaseModel's namespace's folder of the node's adapter cache (where the node agent stages
    its adapters) from the host, read-only, the node's compiled-kernel cache
    (TRITON_CACHE_DIR), read-write, and a service-account token for the node agent (audience
    NODE_AGENT_AUDIENCE), which it stages this namespace's adapters for; with
    serving.apiKeys, the keys from their Secrets (the probes' /healthz and /readyz need none).
    With no room for adapters (slots 0) the server still gets --max-loras 1; the BaseModel's
    status says Failed / NoRoom."""
    serving = base.serving
    key_mounts, key_volumes = _api_key_parts(base)
    container: dict[str, Any] = {
        "name": "server",
        "image": serving.image,
        "command": ["loraplex-server"],
        "args": server_args(base, slots),
        "env": [{"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                {"name": "TRITON_CACHE_DIR", "value": KERNEL_CACHE_DIR},
                *copy.deepcopy(list(serving.env))],
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [
            {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
            {"name": "adapters", "mountPath": ADAPTER_CACHE_DIR, "readOnly": True},
            {"name": "kernel-cache", "mountPath": KERNEL_CACHE_DIR},
            {"name": "node-agent-token", "mountPath": NODE_AGENT_TOKEN_DIR, "readOnly": True},
            *key_mounts,
            *copy.deepcopy(list(serving.volume_mounts)),
        ],
    }
    # Optional parts are null when the BaseModel sets none: a merge patch that omitted them
    # would keep what an earlier spec set, and `needs_update` would not see them go.
    container["resources"] = copy.deepcopy(dict(serving.resources)) or None
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "plan", "configMap": {"name": plan_config_map_name(base.name)}},
            {"name": "adapters", "hostPath": {"path": namespace_cache_dir(base.namespace),
                                              "type": "DirectoryOrCreate"}},
            {"name": "kernel-cache", "hostPath": {"path": KERNEL_CACHE_DIR, "type": "DirectoryOrCreate"}},
            {"name": "node-agent-token", "projected": {"sources": [{"serviceAccountToken": {
                "audience": NODE_AGENT_AUDIENCE, "expirationSeconds": NODE_AGENT_TOKEN_SECONDS, "path": "token"}}]}},
            *key_volumes,
            *copy.deepcopy(list(serving.volumes)),
        ],
    }
    pod_spec["nodeSelector"] = dict(serving.node_selector) or None
    pod_spec["tolerations"] = copy.deepcopy(list(serving.tolerations)) or None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": base.name, "namespace": base.namespace, "labels": labels(base.name)},
        # No replica count when another controller sets it (serving.autoscaling's HPA, or
        # `replicas: null`): left out, a merge patch leaves the count as that one set it.
        "spec": {
            **({"replicas": serving.operator_replicas} if serving.operator_replicas is not None else {}),
            "selector": {"matchLabels": selector_labels(base.name)},
            "template": {
                "metadata": {"labels": labels(base.name)},
                "spec": pod_spec,
            },
        },
    }


def autoscaler(base: BaseModelSpec) -> dict[str, Any] | None:
    """serving.autoscaling's HorizontalPodAutoscaler over the serving Deployment (same name),
    or None without it. Its spec is the operator's whole: written by replacing the object
    (`kube.REPLACED_KINDS`), so a metric or behavior taken out of the BaseModel goes from it
    too, which a merge patch would keep."""
    scaling = base.serving.autoscaling
    if scaling is None:
        return None
    spec: dict[str, Any] = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": base.name},
        "minReplicas": scaling.min_replicas,
        "maxReplicas": scaling.max_replicas,
        "metrics": copy.deepcopy(list(scaling.metrics)),
    }
    if scaling.behavior is not None:
        spec["behavior"] = copy.deepcopy(dict(scaling.behavior))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": base.name, "namespace": base.namespace, "labels": labels(base.name),
                     "annotations": {SPEC_HASH_ANNOTATION: spec_hash(spec)}},
        "spec": spec,
    }


def spec_hash(spec: Mapping[str, Any]) -> str:
    """A digest of a spec as the operator writes it: on the object as SPEC_HASH_ANNOTATION, it
    tells a spec that lost a field (which a subset compare cannot see) from the API server's
    defaults added to it."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def service(base: BaseModelSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": base.name, "namespace": base.namespace, "labels": labels(base.name)},
        "spec": {
            "selector": selector_labels(base.name),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def needs_update(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    """Whether `existing` lacks or differs in any part of `desired` we own.

    Compared: labels and owner references we set (others' references are theirs:
    `owner_references`), and `spec` / `data` as a subset (the API server adds defaults such as
    a Service's clusterIP, which are not ours to fight).
    """
    if existing is None:
        return True
    want_meta, have_meta = desired.get("metadata", {}), existing.get("metadata", {})
    if not _contains(have_meta.get("labels") or {}, want_meta.get("labels") or {}):
        return True
    refs = owner_references(existing, desired)
    if refs is not None and refs != (have_meta.get("ownerReferences") or []):
        return True
    if not _contains(have_meta.get("annotations") or {}, want_meta.get("annotations") or {}):
        return True
    for key in ("spec", "data", "binaryData"):
        if key in desired and not _contains(existing.get(key), desired[key]):
            return True
    return False


def owner_references(existing: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The owner references `existing` is to have: its own, with each of `desired`'s (ours,
    the BaseModel's, as `kopf.adopt` writes it) in place of the entry for the same owner (by
    uid, or by group, kind and name: a BaseModel made again under its name), or after them when
    it has none; None when `desired` sets none (a plan mirror). Others' entries stay as they are,
    where they are: Kubernetes lets an object have several owners (a GitOps tool's, a
    higher-level controller's), one of them its controller, and a merge patch that sets the
    list replaces it whole, so the list written carries theirs.

        existing [Application serving, BaseModel llama-3-8b uid u-1], desired [BaseModel llama-3-8b uid u-2]
        -> [Application serving, BaseModel llama-3-8b uid u-2]
    """
    want = [dict(r) for r in desired.get("metadata", {}).get("ownerReferences") or ()]
    if not want:
        return None
    have = ((existing or {}).get("metadata") or {}).get("ownerReferences") or ()
    merged: list[dict[str, Any]] = []
    placed: set[int] = set()
    for ref in have:
        mine = next((i for i, w in enumerate(want) if _same_owner(ref, w)), None)
        if mine is None:
            merged.append(dict(ref))
        elif mine not in placed:  # a second entry for one owner of ours goes
            merged.append(want[mine])
            placed.add(mine)
    return merged + [w for i, w in enumerate(want) if i not in placed]


def _same_owner(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.get("uid") and a.get("uid") == b.get("uid"):
        return True
    return (str(a.get("apiVersion", "")).split("/")[0] == str(b.get("apiVersion", "")).split("/")[0]
            and a.get("kind") == b.get("kind") and a.get("name") == b.get("name"))


def foreign_owner(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> str | None:
    """Why `existing` (an object under the name `desired` needs) is not ours to write, or None.

    Ours: its controller is a BaseModel of the name `desired` is adopted by (any uid: a
    BaseModel deleted and created again under its name takes its objects back), or it has no
    controller and our labels for that base. A plan mirror (no owner reference can cross
    namespaces) is ours when it is labelled a mirror and annotated with the same plan.
    Anything else belongs to someone else: patched, it would be taken over, and
    garbage-collected with the BaseModel (or, a mirror, deleted with it).
    """
    meta = existing.get("metadata") or {}
    if (desired.get("metadata", {}).get("labels") or {}).get(PLAN_MIRROR_LABEL):
        # A plan mirror: ours if it mirrors the same plan (owner references cannot say so).
        source = desired["metadata"]["annotations"][PLAN_OF_ANNOTATION]
        have_source = (meta.get("annotations") or {}).get(PLAN_OF_ANNOTATION)
        if have_source == source and (meta.get("labels") or {}).get(PLAN_MIRROR_LABEL):
            return None
        return f"the mirror of {have_source}" if have_source else "not a plan mirror of the loraplex operator"
    want = next((r for r in desired.get("metadata", {}).get("ownerReferences") or () if r.get("controller")), None)
    if want is None:
        return None
    have = next((r for r in meta.get("ownerReferences") or () if r.get("controller")), None)
    if have is not None:
        same_group = str(have.get("apiVersion", "")).split("/")[0] == str(want["apiVersion"]).split("/")[0]
        if same_group and have.get("kind") == want["kind"] and have.get("name") == want["name"]:
            return None
        return f"controlled by {have.get('kind')} {have.get('name')}"
    labels = meta.get("labels") or {}
    if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY and labels.get(BASE_LABEL) == want["name"]:
        return None
    return "not made by the loraplex operator"


# Keys whose values are Kubernetes quantities, which the API server keeps in canonical form
# (`nvidia.com/gpu: 1` comes back "1", `cpu: 0.5` as "500m"): ResourceRequirements' requests and
# limits (a container's, an ephemeral volume's claim), a pod's overhead, an HPA metric's target
# (its value and averageValue: `averageValue: 4` comes back "4", "1000" as "1k"; its type and
# averageUtilization are no quantities, and equal only as given), an emptyDir's sizeLimit and a
# resourceFieldRef's divisor.
QUANTITY_MAPS = frozenset({"requests", "limits", "overhead", "target"})
QUANTITY_KEYS = frozenset({"sizeLimit", "divisor"})
# Fields of the built-in kinds (not map entries, which are kept whatever their value) whose ""
# or false the API server leaves out (Go's omitempty): an EnvVar's or a toleration's value, a
# toleration's key, operator and effect, a VolumeMount's (or a volume source's) readOnly,
# subPath and subPathExpr, an emptyDir's medium.
OMITTED_ZERO_KEYS = frozenset({"value", "key", "operator", "effect", "readOnly", "subPath", "subPathExpr",
                               "medium"})


def _contains(have: Any, want: Any, quantity: bool = False) -> bool:
    """Recursive subset: every key of `want` is in `have` with a containing value; a key
    `want` holds as None must be absent or empty in `have` (the API server may show `{}`), and
    one of OMITTED_ZERO_KEYS it holds as "" or false may be absent (the API server writes no
    zero value of an omitempty field: an EnvVar's `value: ""`, a VolumeMount's `readOnly: false`).
    Quantities (`quantity`: under QUANTITY_MAPS or QUANTITY_KEYS) are compared by value."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            not have.get(k) if v is None else
            (k in have or (k in OMITTED_ZERO_KEYS and (v == "" or v is False)))
            and (k not in have or _contains(have[k], v, quantity or k in QUANTITY_MAPS or k in QUANTITY_KEYS))
            for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(
            _contains(h, w) for h, w in zip(have, want))
    if have == want:
        return True
    return quantity and quantity_value(have) is not None and quantity_value(have) == quantity_value(want)
