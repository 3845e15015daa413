"""Custom resources in, small frozen records out.

The planning functions never see raw Kubernetes dicts: the handlers turn each BaseModel
and LoRAAdapter body into one of these records (defaults applied the way the CRD schemas
default them, so a record is the same whether or not the API server defaulted the body),
and everything downstream is pure.

    body = {"metadata": {"name": "llama-3-8b", ...}, "spec": {"maxLoraRank": 64, ...}}
    base = BaseModelSpec.from_body(body)       # BaseModelSpec(name="llama-3-8b", ...)
"""

from __future__ import annotations

import dataclasses
import datetime
import posixpath
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from loraplex.server.settings import FLAG_ALIASES, build_parser  # the server's own command line (no torch)

GROUP = "loraplex.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Modules a Llama-family server can put LoRA on, in the server's order.
ALL_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_names(modules: Any) -> tuple[str, ...]:
    """An adapter's target modules as the server names them, sorted and once each: PEFT's
    target_modules match a module path's suffix, so "self_attn.q_proj" and
    "model.layers.0.self_attn.q_proj" both name q_proj."""
    return tuple(sorted({str(module).rsplit(".", 1)[-1] for module in modules}))


DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
# The longest warmupLeadSeconds (a year), as the CRD's maximum.
MAX_WARMUP_LEAD_SECONDS = 365 * 24 * 3600
PIN_POLICIES: tuple[str, ...] = ("Auto", "Always", "Never")

# Kubernetes quantities: "80Gi", "16G", "40M", "1.5Gi", or a plain number of bytes.
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([kMGTPE]|[KMGTPE]i)?$")
_SUFFIX: dict[str, int] = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


# A quantity is an int64 in Kubernetes, as the CRDs' integer fields are.
_MAX_QUANTITY = 2**63 - 1


class SpecError(ValueError):
    """A body the CRD schema should have refused (or an older operator wrote)."""


def parse_quantity(value: int | str | None) -> int | None:
    """Bytes from a Kubernetes quantity: parse_quantity("40M") == 40_000_000."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SpecError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SpecError(f"negative quantity: {value}")
        if value > _MAX_QUANTITY:
            raise SpecError(f"quantity {value} is too large (at most {_MAX_QUANTITY} bytes)")
        return value
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise SpecError(f"not a quantity: {value!r} (use bytes or e.g. 80Gi, 16G, 40M)")
    number, suffix = match.groups()
    # In integers, not floats: exact (as Kubernetes quantities are), and no overflow on long
    # numbers; a fraction of a byte is dropped.
    whole, _, fraction = number.partition(".")
    scale = _SUFFIX[suffix or ""]
    parsed = int(whole) * scale + int(fraction or "0") * scale // 10 ** len(fraction)
    if parsed > _MAX_QUANTITY:
        raise SpecError(f"quantity {value!r} is too large (at most {_MAX_QUANTITY} bytes)")
    return parsed


# A Kubernetes resource.Quantity in full (apimachinery's grammar): a signed decimal, then a
# binary SI suffix (Ki..Ei), a decimal SI one (m, k, M..E) or a decimal exponent (e3, E-2).
_K8S_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"  # the number
                           r"(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E))?$")  # exponent or suffix
_SCALE: dict[str, Fraction] = {"m": Fraction(1, 1000), **{k: Fraction(v) for k, v in _SUFFIX.items()}}
_MAX_EXPONENT = 100  # far past any quantity an int64 of nanos holds; keeps 1e999999999 cheap


def quantity_value(value: Any) -> Fraction | None:
    """The exact value of a Kubernetes quantity as the API server reads it, or None for what is
    not one: quantity_value("500m") == quantity_value(0.5) == Fraction(1, 2), and "1Gi",
    "1024Mi" and 1073741824 are one value. The API server keeps a quantity in its canonical
    form ("1" for 1, "500m" for 0.5), so a live object is compared with the desired one by this."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value)) if value == value and abs(value) != float("inf") else None
    if not isinstance(value, str):
        return None
    match = _K8S_QUANTITY.match(value.strip())
    if not match:
        return None
    number, exponent, suffix = match.groups()
    if exponent is not None:
        if abs(int(exponent)) > _MAX_EXPONENT:
            return None
        return Fraction(number) * Fraction(10) ** int(exponent)
    return Fraction(number) * _SCALE[suffix or ""]


def parse_time(value: str | None) -> datetime.datetime | None:
    """An RFC 3339 time (`2026-12-01T08:00:00Z`, or with a lower-case t and z, as RFC 3339 and
    the API server's date-time format allow) as an aware UTC datetime."""
    if value is None:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(str(value).upper().replace("Z", "+00:00"))
    except ValueError as exc:
        raise SpecError(f"not an RFC 3339 time: {value!r}") from exc
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.timezone.utc)
    try:
        return parsed.astimezone(datetime.timezone.utc)
    except OverflowError as exc:  # e.g. 0001-01-01T00:00:00+01:00: before year 1 in UTC
        raise SpecError(f"time {value!r} is out of range") from exc


def format_time(value: datetime.datetime) -> str:
    """RFC 3339 in UTC with a Z, to the second: the form Kubernetes writes."""
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The shape of a Llama-family base, as in its config.json (GQA when kv heads < heads)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Architecture:
        heads = int(spec["numAttentionHeads"])
        hidden = int(spec["hiddenSize"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(spec["intermediateSize"]),
            num_layers=int(spec["numLayers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(spec.get("numKeyValueHeads") or heads),
            head_dim=int(spec.get("headDim") or hidden // heads),
            vocab_size=int(spec.get("vocabSize") or 0),
            tie_word_embeddings=bool(spec.get("tieWordEmbeddings", False)),
        )


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-GPU byte figures for the packing math; None where the spec leaves them out."""

    gpu_memory: int | None = None
    base_weights: int | None = None
    kv_cache_reserve: int = 0
    overhead: int = 0
    adapter_bytes: int | None = None
    slots: int | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Memory:
        slots = spec.get("slots")
        return cls(
            gpu_memory=parse_quantity(spec.get("gpuMemory")),
            base_weights=parse_quantity(spec.get("baseWeights")),
            kv_cache_reserve=parse_quantity(spec.get("kvCacheReserve")) or 0,
            overhead=parse_quantity(spec.get("overhead")) or 0,
            adapter_bytes=parse_quantity(spec.get("adapterBytes")),
            slots=int(slots) if slots is not None else None,
        )


EVICTION_POLICIES: tuple[str, ...] = ("lru", "lfu-aged", "wtinylfu")

# Server flags the operator sets from the rest of the spec (or from the plan and the node):
# `serving.extraArgs` may not name them, or the Deployment would contradict the packing math
# (--max-loras, --max-num-seqs, --max-model-len size GPU memory), the plan (adapters come
# from LoRAAdapters, not --lora-modules) or the probes and the Service (--host, --port).
_SET_FLAGS: frozenset[str] = frozenset({
    "--model", "--served-model-name", "--dummy-weights", "--demo", "--demo-dir", "--host", "--port",
    "--device", "--dtype", "--plan-file", "--max-loras", "--max-lora-rank", "--lora-target-modules",
    "--lora-modules", "--adapter-cache-dir", "--adapter-namespace", "--node-agent-url", "--node-agent-token-file",
    "--max-num-seqs",
    "--max-model-len",
    "--max-prefill-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-cpu-loras",
    "--max-concurrent-loads", "--eviction-policy",
    # serving.apiKeys: the keys come from Secrets, never from the command line (`ps` shows it).
    "--api-key", "--api-key-file", "--api-keys-file",
})
# ... and the other spellings the server takes for them (vLLM's --max-num-batched-tokens for
# --max-prefill-tokens): refused as well, or the alias would override serving.engine.
OPERATOR_FLAGS: frozenset[str] = _SET_FLAGS | frozenset(
    alias for field, aliases in FLAG_ALIASES.items() if "--" + field.replace("_", "-") in _SET_FLAGS
    for alias in aliases)
# OPERATOR_FLAGS that serving.apiKeys sets, named in the refusal so it points there.
API_KEY_FLAGS: frozenset[str] = frozenset({"--api-key", "--api-key-file", "--api-keys-file"})


@dataclasses.dataclass(frozen=True)
class Engine:
    """The server's engine settings (`loraplex-server` flags); max_num_seqs * max_model_len
    tokens of KV cache is what the server allocates, and what the packing math counts."""

    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_prefill_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    eviction_policy: str | None = None
    max_cpu_loras: int | None = None
    max_concurrent_loads: int | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Engine:
        def optional_int(key: str, low: int) -> int | None:
            value = spec.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or int(value) != value or value < low:
                raise SpecError(f"serving.engine.{key} must be an integer >= {low}, got {value!r}")
            return int(value)

        policy = spec.get("evictionPolicy")
        if policy is not None and policy not in EVICTION_POLICIES:
            raise SpecError(f"serving.engine.evictionPolicy {policy!r} is not one of {list(EVICTION_POLICIES)}")
        chunked = spec.get("enableChunkedPrefill")
        if chunked is not None and not isinstance(chunked, bool):
            raise SpecError(f"serving.engine.enableChunkedPrefill must be true or false, got {chunked!r}")
        return cls(
            max_num_seqs=optional_int("maxNumSeqs", 1) or cls.max_num_seqs,
            max_model_len=optional_int("maxModelLen", 2) or cls.max_model_len,
            max_prefill_tokens=optional_int("maxPrefillTokens", 1),
            enable_chunked_prefill=chunked,
            eviction_policy=policy,
            max_cpu_loras=optional_int("maxCpuLoras", 0),
            max_concurrent_loads=optional_int("maxConcurrentLoads", 1),
        )

    def args(self) -> list[str]:
        """The flags, in `loraplex-server --help` order; unset optional ones are left to the server."""
        args = ["--max-num-seqs", str(self.max_num_seqs), "--max-model-len", str(self.max_model_len)]
        if self.max_prefill_tokens is not None:
            args += ["--max-prefill-tokens", str(self.max_prefill_tokens)]
        if self.enable_chunked_prefill is not None:
            args.append("--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill")
        for flag, value in (("--max-cpu-loras", self.max_cpu_loras),
                            ("--max-concurrent-loads", self.max_concurrent_loads),
                            ("--eviction-policy", self.eviction_policy)):
            if value is not None:
                args += [flag, str(value)]
        return args


def _extra_args(value: Any) -> tuple[str, ...]:
    """serving.extraArgs: strings, none of them a flag the operator sets (OPERATOR_FLAGS), that
    the server's command line takes (the server's own parser: an unknown flag, a flag without
    its value or a value of the wrong kind is refused here, not in a crash loop of pods)."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) for a in value):
        raise SpecError(f"serving.extraArgs must be a list of strings, got {value!r}")
    # argparse also takes a flag's unique prefix (--max-num for --max-num-seqs): refused too.
    owned = sorted({flag for a in value if a.startswith("--") and len(a.split("=", 1)[0]) > 2
                    for flag in OPERATOR_FLAGS if flag.startswith(a.split("=", 1)[0])})
    if owned:
        use = "serving.apiKeys" if set(owned) <= API_KEY_FLAGS else "serving.engine and the rest of the spec"
        raise SpecError(f"serving.extraArgs may not set {', '.join(owned)}: the operator sets them (use {use})")
    _check_server_args(list(value))
    return tuple(value)


def _check_server_args(args: list[str]) -> None:
    """SpecError unless loraplex-server's parser takes `args` (flags only: the model folder, its
    one positional, is the operator's --model)."""
    if any(a in ("-h", "--help") for a in args):
        raise SpecError("serving.extraArgs may not ask for --help: the server would print it and exit")
    parser = build_parser()

    def refuse(message: str):
        raise SpecError(f"serving.extraArgs {args!r}: {message} (loraplex-server's command line)")

    parser.error = refuse
    try:
        ns = parser.parse_args(args)
    except SystemExit as e:  # argparse's other ways out (--version, say)
        raise SpecError(f"serving.extraArgs {args!r}: the server would exit ({e.code})") from None
    if ns.model_dir is not None:
        raise SpecError(f"serving.extraArgs may not name the model folder ({ns.model_dir!r}): the operator "
                        "sets --model")


# Environment variables the operator sets on the server container (workloads.deployment), and
# the server's environment forms of the flags it sets: the server reads LORAPLEX_<FIELD> for a
# flag its command line leaves out (--served-model-name without serving.servedModelName,
# --lora-modules, --device, ... always), so LORAPLEX_SERVED_MODEL_NAME would rename the base the
# status and the adapter-name check go by, and LORAPLEX_LORA_MODULES serve adapters outside the
# plan. API keys come through serving.apiKeys alone.
API_KEY_ENV: frozenset[str] = frozenset({"LORAPLEX_API_KEY", "LORAPLEX_API_KEY_FILE", "LORAPLEX_API_KEYS_FILE"})
FLAG_ENV: frozenset[str] = frozenset("LORAPLEX_" + flag[2:].upper().replace("-", "_") for flag in _SET_FLAGS
                                     if not flag.startswith("--no-"))  # (the off form of a flag: no variable)
OPERATOR_ENV: frozenset[str] = frozenset({"NODE_IP", "TRITON_CACHE_DIR"}) | FLAG_ENV


def _env(value: Any) -> tuple[Mapping[str, Any], ...]:
    """serving.env: Kubernetes EnvVars ({name, value} or {name, valueFrom}), none of OPERATOR_ENV."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(e, Mapping) and isinstance(e.get("name"), str) and e["name"] for e in value):
        raise SpecError("serving.env must be a list of EnvVars, each with a name")
    owned = sorted({e["name"] for e in value} & OPERATOR_ENV)
    if owned:
        use = " (use serving.apiKeys)" if set(owned) <= API_KEY_ENV else \
            " (use serving.engine and the rest of the spec)" if set(owned) <= FLAG_ENV else ""
        raise SpecError(f"serving.env may not set {', '.join(owned)}: the operator sets them{use}")
    return tuple(dict(e) for e in value)


# The pod volumes the operator gives every server (workloads.deployment) and where it mounts
# them: the plan, the node's adapter cache, the node's kernel cache, the node agent's token
# and (with serving.apiKeys.tenantKeysSecret) the tenants' keys. A serving.volumes entry of one of these
# names, or a serving.volumeMounts entry naming one or mounted at (or under) one of these
# paths, would make a Deployment the API server refuses (a duplicate volume name or mount
# path) or a server that reads the user's files as the operator's.
OPERATOR_VOLUMES: tuple[str, ...] = ("plan", "adapters", "kernel-cache", "node-agent-token", "api-keys")
OPERATOR_MOUNT_PATHS: tuple[str, ...] = ("/etc/loraplex/plan", "/var/lib/loraplex/adapters",
                                         "/var/lib/loraplex/kernel-cache", "/var/run/secrets/loraplex/node-agent",
                                         "/etc/loraplex/api-keys")


def _named_list(value: Any, field: str, what: str, keys: tuple[str, ...]) -> tuple[Mapping[str, Any], ...]:
    """A list of Kubernetes objects each with a non-empty string under every one of `keys`."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(e, Mapping) and all(isinstance(e.get(k), str) and e[k] for k in keys) for e in value):
        raise SpecError(f"{field} must be a list of {what}, each with {' and '.join('a ' + k for k in keys)}")
    return tuple(dict(e) for e in value)


def _clean_path(path: str) -> str:
    """A mount path as the container sees it: "/etc/loraplex/plan/" and "//etc/./loraplex/plan"
    are /etc/loraplex/plan (normpath alone keeps two leading slashes)."""
    return posixpath.normpath("/" + path.lstrip("/")) if path.startswith("/") else posixpath.normpath(path)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _volumes(value: Any) -> tuple[Mapping[str, Any], ...]:
    """serving.volumes: Kubernetes Volumes, each name once and none of OPERATOR_VOLUMES."""
    volumes = _named_list(value, "serving.volumes", "Volumes", ("name",))
    names = [v["name"] for v in volumes]
    owned = sorted(set(names) & set(OPERATOR_VOLUMES))
    if owned:
        raise SpecError(f"serving.volumes may not name a volume {', '.join(owned)}: the operator's pods have"
                        f" their own of that name (the operator's are {', '.join(OPERATOR_VOLUMES)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"serving.volumes names {', '.join(twice)} more than once")
    return volumes


def _volume_mounts(value: Any) -> tuple[Mapping[str, Any], ...]:
    """serving.volumeMounts: VolumeMounts of serving.volumes, none of an operator's volume
    (OPERATOR_VOLUMES) nor at or under a path the operator mounts (OPERATOR_MOUNT_PATHS),
    each path once."""
    mounts = _named_list(value, "serving.volumeMounts", "VolumeMounts", ("name", "mountPath"))
    owned = sorted({m["name"] for m in mounts} & set(OPERATOR_VOLUMES))
    if owned:
        raise SpecError(f"serving.volumeMounts may not mount {', '.join(owned)}: the operator mounts its"
                        f" volumes of that name itself")
    paths = [_clean_path(m["mountPath"]) for m in mounts]
    clashes = sorted({m["mountPath"] for m, path in zip(mounts, paths)
                      if any(_under(path, root) for root in OPERATOR_MOUNT_PATHS)})
    if clashes:
        raise SpecError(f"serving.volumeMounts may not mount at {', '.join(clashes)}: the operator mounts its"
                        f" own volumes at {', '.join(OPERATOR_MOUNT_PATHS)}")
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise SpecError(f"serving.volumeMounts mounts more than one volume at {', '.join(twice)}")
    return mounts


# A Secret's name (a DNS-1123 subdomain) and a key of its data, as the API server checks them.
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


@dataclasses.dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the BaseModel's namespace (a SecretKeySelector)."""

    name: str
    key: str

    @classmethod
    def from_spec(cls, value: Any, field: str, default_key: str) -> SecretKey | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise SpecError(f"serving.apiKeys.{field} must be an object with a name and a key, got {value!r}")
        name, key = value.get("name"), value.get("key", default_key)
        if not isinstance(name, str) or len(name) > 253 or not _SECRET_NAME.match(name):
            raise SpecError(f"serving.apiKeys.{field}.name must be a Secret's name (a DNS subdomain), got {name!r}")
        if not isinstance(key, str) or len(key) > 253 or not _SECRET_KEY.match(key):
            raise SpecError(f"serving.apiKeys.{field}.key must be a key of a Secret (letters, digits, -._),"
                            f" got {key!r}")
        return cls(name=name, key=key)


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """serving.apiKeys: the servers' API keys from Secrets, both mounted as files in one
    volume, the admin key for --api-key-file and the tenants' keys for --api-keys-file, which
    the servers re-read when the kubelet updates a Secret (a key rotates without a restart);
    None: no such keys."""

    admin_key_secret: SecretKey | None = None
    tenant_keys_secret: SecretKey | None = None

    @classmethod
    def from_spec(cls, spec: Any) -> ApiKeys:
        if spec is None:
            return cls()
        if not isinstance(spec, Mapping):
            raise SpecError(f"serving.apiKeys must be an object, got {spec!r}")
        return cls(admin_key_secret=SecretKey.from_spec(spec.get("adminKeySecret"), "adminKeySecret", "api-key"),
                   tenant_keys_secret=SecretKey.from_spec(spec.get("tenantKeysSecret"), "tenantKeysSecret",
                                                          "keys.json"))


# The metric kinds of an autoscaling/v2 MetricSpec (its `type`), each with its own key.
METRIC_TYPES: dict[str, str] = {"Pods": "pods", "Object": "object", "Resource": "resource",
                                "ContainerResource": "containerResource", "External": "external"}


@dataclasses.dataclass(frozen=True)
class Autoscaling:
    """serving.autoscaling: a HorizontalPodAutoscaler (autoscaling/v2) the operator keeps over
    the serving Deployment, which then has no replica count of the operator's (the HPA's
    is the one). `metrics` and `behavior` are the HPA's own fields, kept as given. No
    metrics is refused: an HPA without them scales on CPU, which says nothing of a GPU
    server's load (a queue-length metric such as loraplex_requests_waiting does)."""

    min_replicas: int = 1
    max_replicas: int = 1
    metrics: tuple[Mapping[str, Any], ...] = ()
    behavior: Mapping[str, Any] | None = None

    @classmethod
    def from_spec(cls, spec: Any) -> Autoscaling | None:
        if spec is None:
            return None
        if not isinstance(spec, Mapping):
            raise SpecError(f"serving.autoscaling must be an object, got {spec!r}")

        def count(key: str, default: int | None, low: int) -> int:
            value = spec.get(key, default)
            if value is None or isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise SpecError(f"serving.autoscaling.{key} must be an integer >= {low}, got {value!r}")
            return value

        low = count("minReplicas", 1, 1)
        high = count("maxReplicas", None, low)
        metrics = spec.get("metrics")
        if not isinstance(metrics, (list, tuple)) or not metrics:
            raise SpecError("serving.autoscaling.metrics must list at least one autoscaling/v2 metric (e.g. a Pods "
                            "metric of loraplex_requests_waiting): without one an HPA scales on CPU")
        for i, metric in enumerate(metrics):
            kind = metric.get("type") if isinstance(metric, Mapping) else None
            if kind not in METRIC_TYPES or not isinstance(metric.get(METRIC_TYPES[kind]), Mapping):
                raise SpecError(f"serving.autoscaling.metrics[{i}] must be an autoscaling/v2 MetricSpec: a type of "
                                f"{sorted(METRIC_TYPES)} and the object of that type, got {metric!r}")
        behavior = spec.get("behavior")
        if behavior is not None and not isinstance(behavior, Mapping):
            raise SpecError(f"serving.autoscaling.behavior must be an object, got {behavior!r}")
        return cls(min_replicas=low, max_replicas=high, metrics=tuple(dict(m) for m in metrics),
                   behavior=dict(behavior) if behavior is not None else None)


def _served_model_name(value: Any) -> str | None:
    """serving.servedModelName: the server's --served-model-name, a `model` a client sends as
    it is (vLLM takes a Hugging Face id such as meta-llama/Meta-Llama-3-8B): 1-256 printable
    ASCII characters, no space (the CRD's pattern)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= 256 or not all("!" <= c <= "~" for c in value):
        raise SpecError(f"serving.servedModelName must be 1-256 printable ASCII characters with no space, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Serving:
    """The serving Deployment's template; free-form Kubernetes parts kept as given."""

    replicas: int | None = 1  # None: left to someone else (an HPA or KEDA of the user's)
    image: str = "loraplex/server:0.1.0"
    model_path: str | None = None
    served_model_name: str | None = None  # the base's name in the API; None: model_path's folder name
    resources: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    engine: Engine = Engine()
    extra_args: tuple[str, ...] = ()  # after the operator's flags
    env: tuple[Mapping[str, Any], ...] = ()  # EnvVars, after the operator's
    api_keys: ApiKeys = ApiKeys()
    autoscaling: Autoscaling | None = None  # an HPA of the operator's over the Deployment

    @property
    def operator_replicas(self) -> int | None:
        """The replica count the operator writes into the Deployment; None when another
        controller sets it (serving.autoscaling's HPA, or a `replicas: null` left to the user's)."""
        return None if self.autoscaling is not None else self.replicas

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Serving:
        replicas = spec.get("replicas", 1)
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
            raise SpecError(f"serving.replicas must be an integer >= 0 or null, got {replicas!r}")
        return cls(
            replicas=replicas,
            image=str(spec.get("image") or cls.image),
            model_path=spec.get("modelPath"),
            served_model_name=_served_model_name(spec.get("servedModelName")),
            resources=dict(spec.get("resources") or {}),
            node_selector=dict(spec.get("nodeSelector") or {}),
            tolerations=tuple(spec.get("tolerations") or ()),
            volumes=_volumes(spec.get("volumes")),
            volume_mounts=_volume_mounts(spec.get("volumeMounts")),
            engine=Engine.from_spec(spec.get("engine") or {}),
            extra_args=_extra_args(spec.get("extraArgs")),
            env=_env(spec.get("env")),
            api_keys=ApiKeys.from_spec(spec.get("apiKeys")),
            autoscaling=Autoscaling.from_spec(spec.get("autoscaling")),
        )


@dataclasses.dataclass(frozen=True)
class BaseModelSpec:
    """One BaseModel CR: what the pool's adapters must fit, and how to size its slots."""

    name: str
    namespace: str
    source: str
    max_lora_rank: int
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    dtype: str = "bfloat16"
    architecture: Architecture | None = None
    memory: Memory = Memory()
    pinned_percent: int = 50
    warmup_lead_seconds: int = 600
    serving: Serving = Serving()
    generation: int = 0
    uid: str = ""

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> BaseModelSpec:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        try:
            dtype = str(spec.get("dtype") or "bfloat16")
            if dtype not in DTYPE_BYTES:
                raise SpecError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
            modules = tuple(spec.get("targetModules") or DEFAULT_TARGET_MODULES)
            unknown = sorted(set(modules) - set(ALL_TARGET_MODULES))
            if unknown:
                raise SpecError(f"unknown target modules {unknown}")
            arch = spec.get("architecture")
            lead = int(spec.get("warmupLeadSeconds", 600))
            if not 0 <= lead <= MAX_WARMUP_LEAD_SECONDS:
                raise SpecError(f"warmupLeadSeconds {lead} is not within 0..{MAX_WARMUP_LEAD_SECONDS}")
            base = cls(
                name=str(meta["name"]),
                namespace=str(meta.get("namespace") or "default"),
                source=str(spec["source"]),
                max_lora_rank=int(spec["maxLoraRank"]),
                target_modules=modules,
                dtype=dtype,
                architecture=Architecture.from_spec(arch) if arch else None,
                memory=Memory.from_spec(spec.get("memory") or {}),
                pinned_percent=int(spec.get("pinnedPercent", 50)),
                warmup_lead_seconds=lead,
                serving=Serving.from_spec(spec.get("serving") or {}),
                generation=int(meta.get("generation") or 0),
                uid=str(meta.get("uid") or ""),
            )
            from loraplex.operator.packing import out_of_range  # (packing imports this module)

            problem = out_of_range(base)
            if problem is not None:
                raise SpecError(problem)
            return base
        except KeyError as exc:
            raise SpecError(f"missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise SpecError(str(exc)) from exc


@dataclasses.dataclass(frozen=True)
class Warmup:
    """A campaign window: prefetch the adapter before `start`, keep it warm until `end`."""

    start: datetime.datetime
    end: datetime.datetime


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One LoRAAdapter CR. `rank` / `target_modules` are None when not known (yet)."""

    name: str
    namespace: str
    base_model: str
    source: str
    sha256: str | None = None
    tenant: str = "default"
    priority: int = 0
    pin_policy: str = "Auto"
    rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    warmup: Warmup | None = None
    generation: int = 0
    deleting: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> AdapterSpec:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        try:
            policy = str(spec.get("pinPolicy") or "Auto")
            if policy not in PIN_POLICIES:
                raise SpecError(f"pinPolicy {policy!r} is not one of {list(PIN_POLICIES)}")
            window = spec.get("warmup")
            warmup = None
            if window:
                start, end = parse_time(window["start"]), parse_time(window["end"])
                assert start is not None and end is not None
                if end <= start:
                    raise SpecError("warmup.end must be after warmup.start")
                warmup = Warmup(start=start, end=end)
            modules = spec.get("targetModules")
            rank = spec.get("rank")
            return cls(
                name=str(meta["name"]),
                namespace=str(meta.get("namespace") or "default"),
                base_model=str(spec["baseModel"]),
                source=str(spec["source"]),
                sha256=spec.get("sha256"),
                tenant=str(spec.get("tenant") or "default"),
                priority=int(spec.get("priority") or 0),
                pin_policy=policy,
                rank=int(rank) if rank is not None else None,
                target_modules=module_names(modules) if modules else None,
                warmup=warmup,
                generation=int(meta.get("generation") or 0),
                deleting=bool(meta.get("deletionTimestamp")),
            )
        except KeyError as exc:
            raise SpecError(f"missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise SpecError(str(exc)) from exc

    def with_metadata(self, rank: int | None, target_modules: tuple[str, ...] | None) -> AdapterSpec:
        """The same adapter with rank / modules filled in from its adapter_config.json."""
        return dataclasses.replace(
            self,
            rank=self.rank if self.rank is not None else rank,
            target_modules=self.target_modules if self.target_modules is not None
            else (tuple(sorted(target_modules)) if target_modules else None),
        )
