"""The server's settings: one dataclass, one command-line flag per field.

Each field's docstring (the string literal under it) is its help text and gives the unit
and the default; `build_parser` reads those docstrings from this file's source, so the
flags, their help and the dataclass cannot drift apart. The environment is read only in
`ServerSettings.from_env_and_args` (``LORAPLEX_<FIELD>`` overrides a default; a Kubernetes
service link ``LORAPLEX_PORT=tcp://...``, from a Service named ``loraplex``, is not a port).

Example::

    loraplex-server --model /models/llama-3-8b --max-loras 32 --max-lora-rank 16
    # -> ServerSettings(model="/models/llama-3-8b", max_loras=32, max_lora_rank=16, ...)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import ipaddress
import json
import os
import re
import textwrap
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from .adapter_names import InvalidAdapterName, check_adapter_name, is_namespace

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The levels both `logging` and uvicorn's `log_level` take (in any case).
LOG_LEVELS = ("debug", "info", "warning", "error")
# --tool-call-parser: the ways of writing a tool call that api/tools.py reads.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# vLLM's names for settings of ours, taken as flags beside our own (the field's flag first).
FLAG_ALIASES = {"max_prefill_tokens": ("--max-num-batched-tokens",)}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names
# Kubernetes puts `<SERVICE>_PORT=tcp://10.96.0.12:8000` into every pod of a namespace for each
# Service there: a Service named `loraplex` sets LORAPLEX_PORT so. That is no --port.
SERVICE_LINK = re.compile(r"^(tcp|udp|sctp)://\S+:\d+$")


@dataclass
class ServerSettings:
    model: str | None = None
    """HF model directory (config.json, *.safetensors, tokenizer.json). Default: none."""

    dummy_weights: str | None = None
    """Named shape (e.g. llama-3-8b, tiny) to build with random weights instead of
    --model's weights; with --model, the shape is read from its config.json. Default: none."""

    demo: bool = False
    """Build a tiny random model, tokenizer and adapters in --demo-dir, serve them on the
    CPU and send them a few requests. Default: off."""

    demo_dir: str | None = None
    """Folder for --demo's files. Default: $XDG_CACHE_HOME/loraplex/demo."""

    host: str = "127.0.0.1"
    """Address to listen on; an empty string listens on every address of both families,
    IPv4 and IPv6 (0.0.0.0 is IPv4's only, :: IPv6's only). Default: 127.0.0.1."""

    port: int = 8000
    """TCP port to listen on. Default: 8000."""

    served_model_name: str | None = None
    """Name of the base model in the API. Default: the --model folder's name."""

    lora_modules: list[str] = field(default_factory=list)
    """Adapters to load at start, as NAME=PATH (repeatable), or as vLLM's JSON form
    {"name": NAME, "path": PATH}; a NAME is ASCII letters, digits, '.', '_', '-', '@' and
    '+', starting with a letter or digit (server/adapter_names.py). Default: none."""

    device: str = "auto"
    """Torch device: cpu, cuda, cuda:N or auto (cuda when present). Default: auto."""

    dtype: str = "auto"
    """Weights and activations dtype: float32, float16, bfloat16 or auto (bfloat16 on
    CUDA, float32 on the CPU); vLLM's half and float are float16 and float32. Default: auto."""

    seed: int = 0
    """Seed for random dummy weights and for requests without a seed. Default: 0."""

    max_num_seqs: int = 16
    """Rows of the running batch (requests decoded together), in sequences. Default: 16."""

    max_model_len: int = 2048
    """Longest sequence (prompt + output) in tokens; capped by the model's
    max_position_embeddings. Default: 2048."""

    max_prefill_tokens: int = 4096
    """Prompt tokens prefilled in one step, at most (one prompt may exceed it alone); also
    taken as vLLM's --max-num-batched-tokens. Default: 4096."""

    enable_chunked_prefill: bool = False
    """Prefill a prompt longer than the step's --max-prefill-tokens budget in chunks over
    several steps, decoding the running requests between chunks, so a long prompt does not
    stall them; a prompt that asks for prompt logprobs (echo) is never chunked. Default: off."""

    enable_prefix_caching: bool = True
    """Prefix caching: a prompt whose first tokens a KV row holds already (a running or
    finished request of the same adapter, or of the base, whose prompt, or prompt and answer,
    began the same way: a system prompt, the turns of a chat so far) has them copied from that
    row instead of prefilled; at least 16 tokens, matched in blocks of 16. Off: every prompt is
    prefilled whole. Default: on (as in vLLM)."""

    kv_offloading_size: float = 0.0
    """GiB of host memory for the prefix cache's second tier, as vLLM's flag of this name: a
    finished request's prefix that its KV row is about to lose (the row given to another
    request) is copied there first, in blocks of 16 tokens held once, and a prompt the host
    holds further than any row has those blocks copied back into its row instead of
    prefilled; least recently used first out. Needs prefix caching. Default: 0.0 (off)."""

    enable_prompt_tokens_details: bool = False
    """Add `prompt_tokens_details: {"cached_tokens": N}` to a response's usage, as vLLM's flag
    of this name does: N of the prompt tokens were found in the prefix cache, not prefilled (0,
    or 16 and more; a prompt's once with n choices). Default: off."""

    enable_auto_tool_choice: bool = False
    """Let a chat request with tools and tool_choice "auto" (OpenAI's default with tools)
    have the model decide whether to call them, its reply read by --tool-call-parser (as in
    vLLM; "required" and a named tool need neither). Default: off."""

    tool_call_parser: str | None = None
    """How a reply under tool_choice "auto" calls tools: hermes (<tool_call>{"name",
    "arguments"}</tool_call> blocks: Qwen2.5, Hermes) or llama3_json (a JSON object
    {"name", "parameters"}, several joined by ";": Llama 3.1 and later). Default: none."""

    enable_lora: bool = True
    """vLLM's flag that turns adapters on, taken so that vLLM's command lines run: this server
    always serves them, and --no-enable-lora is refused. Default: on."""

    max_loras: int = 0
    """Adapter slots in the device buffers (the GPU tier): adapters resident at once; 0 sizes
    them from the device's free memory after weights and KV cache (8 on the CPU). Default: 0."""

    max_lora_rank: int = 16
    """Largest adapter rank the slot buffers hold; larger adapters are refused. Default: 16."""

    tensor_parallel_size: int = 1
    """vLLM's flag, taken so that its command lines run: a server runs on one GPU, so only 1
    is taken (more GPUs: more replicas, each its own server). Default: 1."""

    gpu_memory_utilization: float | None = None
    """The fraction of the GPU's memory this server may hold (weights, KV cache, adapter
    slots), memory other processes hold counted against it, as vLLM's flag of this name: at
    start these must fit in it, and --max-loras 0 sizes the slots to what it leaves. Not set:
    the memory free at start (and the slots 0.8 of what is left). Not used on the CPU.
    Default: none."""

    max_cpu_loras: int = 0
    """Adapters kept in host memory (pinned on CUDA), the host tier; its byte bound is this
    many slot-sized copies; 0 means as many as --max-loras. Default: 0."""

    max_concurrent_loads: int = 4
    """Adapter loads (disk -> host -> slot) running at once; more wait their turn. Default: 4."""

    session_lease_seconds: int = 60
    """Seconds a session start (POST /v1/sessions) holds its adapter resident for the session's
    first request, unless that request comes first; a lease yields when every idle slot is
    leased, and 0 turns leases off. Default: 60."""

    eviction_policy: str = "lru"
    """GPU slot eviction policy: lru, lfu-aged (aged frequency counts that forget on a
    popularity shift) or wtinylfu (W-TinyLFU, adaptive window). Default: lru."""

    adapter_cache_dir: str | None = None
    """Local disk tier: a folder of PEFT adapters, <dir>/<name>/ (the node agent's cache, or
    its namespace's folder); a request for a name found there loads it (with --plan-file, a
    name the plan lists: the folder holds other bases' adapters too). Default: none."""

    plan_file: str | None = None
    """The operator's plan (JSON, usually a mounted ConfigMap key): its adapters are
    registered and its pinned set pinned, re-read when it changes. Default: none."""

    node_agent_url: str | None = None
    """The node agent that stages adapters missing from --adapter-cache-dir, which it needs
    (e.g. http://127.0.0.1:8081); an IPv6 host may come without brackets, as Kubernetes expands
    http://$(NODE_IP):8081 (http://fd00::5:8081 is read as [fd00::5], port 8081); without it a
    plan source is fetched directly. Default: none."""

    node_agent_token_file: str | None = None
    """A service-account token to send the node agent as 'Authorization: Bearer TOKEN' when
    it stages an adapter (a projected token of the audience the agent reviews tokens for,
    which the operator mounts into each server pod); re-read for each staging, as the kubelet
    rotates it. Default: none."""

    adapter_namespace: str | None = None
    """The Kubernetes namespace of this server's adapters: the node agent stages those it is
    asked for in its cache's folder for that namespace (<cache>/.namespaces/<namespace>/, which
    the operator mounts as --adapter-cache-dir), apart from other namespaces' adapters of the
    same names. Default: none (the cache's top folder)."""

    lora_target_modules: list[str] = field(default_factory=lambda: list(TARGET_MODULES))
    """Projections that may carry LoRA (subset of q/k/v/o/gate/up/down_proj); adapters
    targeting others are refused. Default: all seven."""

    kernel_backend: str = "auto"
    """add_lora backend: auto, triton or torch. Default: auto."""

    cuda_graphs: bool = True
    """Replay decode steps, and prefill steps of up to 1,024 tokens, as CUDA graphs (CUDA
    devices only; --no-cuda-graphs turns them off). Default: on."""

    decode_look_ahead: bool = True
    """Launch each decode step before the tokens of the step before it reach the host (they
    stay on the GPU), so the host's work between steps (sampling's results, stop strings,
    streaming, scheduling) runs while the GPU decodes (CUDA devices only, where a launch is
    asynchronous; --no-decode-look-ahead waits for each step's tokens first). Default: on."""

    warmup: bool = True
    """Before serving, run one prefill per LoRA launch configuration a prefill can reach and
    one decode step per batch and adapter bucket, capturing its CUDA graph, so no serving step
    stalls on a compile or a capture (CUDA only; --no-warmup skips it). Default: on."""

    fused_ops: bool = True
    """Run the decode step's small ops (attention, RoPE + K/V write, add + RMSNorm,
    silu*mul) as the Triton kernels of server/ops (CUDA devices only; --no-fused-ops
    runs them as torch ops). Default: on."""

    triton_gemm: bool = True
    """Run the projections of steps up to 64 rows (decode) as loraplex's Triton GEMM, the
    LoRA shrink beside it and the expand launched under it (kernels.linear; CUDA devices and
    the Triton backend only; --no-triton-gemm runs cuBLAS, then add_lora). Default: on, where
    the GPU has programmatic dependent launch (Hopper and later), which the overlap needs."""

    kv_block: int = 256
    """Granularity, in tokens, of the KV length that an eager decode step reads (whole
    blocks). With CUDA graphs a step is bounded by the cache's whole length instead, one graph
    key, and the attention reads only each row's own keys. Default: 256."""

    api_key: str | None = field(default=None, repr=False)
    """An admin API key: every request under /v1/ must then send one (Authorization: Bearer
    KEY), as with vLLM's --api-key; this one may use every adapter and the admin endpoints
    (load, unload, pin, unpin). Give it as LORAPLEX_API_KEY (from a Secret) rather than on the
    command line, where any process listing shows it. /healthz, /readyz and /metrics stay
    open. Default: none."""

    api_key_file: str | None = None
    """A file that holds an admin API key (a Secret's value mounted as a file), taken as
    --api-key is, and re-read when it changes, so the key rotates without a restart (the
    operator gives serving.apiKeys.adminKeySecret so). Default: none."""

    api_keys_file: str | None = None
    """Tenants' API keys, a JSON object {"KEY": "TENANT", ...} (usually a mounted Secret), re-read
    when it changes: a tenant's key may use the base and the adapters the plan gives that
    tenant (a LoRAAdapter's spec.tenant) or no tenant; any other adapter is a 404 to it, as if
    unknown. A key of tenant "*" is an admin key. Default: none."""

    max_request_bytes: int = 32 << 20
    """Largest HTTP request body taken; a larger one is a 413, refused before it is read whole
    (a 128k-token prompt as token ids is about 1 MB). Default: 33554432."""

    log_level: str = "info"
    """Logging level: debug, info, warning, error. Default: info."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not (self.model or self.dummy_weights or self.demo):
            raise ValueError("one of --model, --dummy-weights or --demo is required")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype {self.dtype!r}: use auto, float32, float16 or bfloat16")
        if self.kernel_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"--kernel-backend {self.kernel_backend!r}: use auto, triton or torch")
        for name, low in (("max_num_seqs", 1), ("max_model_len", 2), ("max_prefill_tokens", 1),
                          ("max_loras", 0), ("max_lora_rank", 1), ("kv_block", 1), ("max_cpu_loras", 0),
                          ("max_concurrent_loads", 1), ("max_request_bytes", 1024),
                          ("session_lease_seconds", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {low}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: a loraplex server runs on one GPU; "
                             "serve more traffic with more replicas (a BaseModel's serving.replicas or serving.autoscaling)")
        if not self.enable_lora:
            raise ValueError("--no-enable-lora: loraplex always serves adapters (it is a multi-LoRA server); "
                             "requests for the base model need no flag")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: a fraction of the GPU's "
                             "memory, above 0 and at most 1")
        if self.kv_offloading_size < 0:
            raise ValueError("--kv-offloading-size must be at least 0 (GiB; 0: off)")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size holds the prefix cache's second tier: it needs prefix caching "
                             "(leave out --no-enable-prefix-caching)")
        if self.eviction_policy not in ("lru", "lfu-aged", "wtinylfu"):
            raise ValueError(f"--eviction-policy {self.eviction_policy!r}: use lru, lfu-aged or wtinylfu")
        if not 0 < self.port < 65536 and self.port != 0:
            raise ValueError(f"--port {self.port} is not a TCP port")
        bad = sorted(set(self.lora_target_modules) - set(TARGET_MODULES))
        if bad:
            raise ValueError(f"--lora-target-modules: unknown {bad}; allowed {list(TARGET_MODULES)}")
        self.lora_modules = [_lora_module(item) for item in self.lora_modules]
        names = set()
        for item in self.lora_modules:
            name, eq, path = item.partition("=")
            if not (name and eq and path):
                raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
            try:
                check_adapter_name(name)
            except InvalidAdapterName as e:
                raise ValueError(f"--lora-modules {item!r}: {e}") from None
            if name in names:
                raise ValueError(f"--lora-modules: {name!r} is given twice")
            names.add(name)
        # The base's name in the API, as the engine derives it; an adapter of that name could
        # never be asked for (POST /v1/load_lora_adapter refuses one as well).
        base = self.served_model_name or (Path(self.model).name if self.model else self.dummy_weights)
        if base in names:
            raise ValueError(f"--lora-modules: {base!r} is the base model's name in the API "
                             f"(--served-model-name, else the --model folder's name); name the adapter otherwise")
        if self.adapter_namespace is not None and not is_namespace(self.adapter_namespace):
            raise ValueError(f"--adapter-namespace {self.adapter_namespace!r} is not a Kubernetes namespace name "
                             "(1-63 lowercase letters, digits and '-', starting and ending with a letter or digit)")
        if self.node_agent_url is not None:
            self.node_agent_url = http_url(self.node_agent_url, "--node-agent-url")
            if not self.adapter_cache_dir:  # the agent stages into its cache: the server reads it there
                raise ValueError("--node-agent-url needs --adapter-cache-dir, the agent's cache folder as this "
                                 "server sees it (without it the agent would never be asked)")
        if self.node_agent_token_file is not None and self.node_agent_url is None:
            raise ValueError("--node-agent-token-file needs --node-agent-url (the agent it is sent to)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: use {', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model's replies call tools)")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: use {', '.join(LOG_LEVELS)}")

    @classmethod
    def from_env_and_args(cls, argv: list[str] | None = None) -> "ServerSettings":
        parser = build_parser()
        ns = parser.parse_args(argv)
        if ns.model_dir is not None:
            if ns.model is not None and ns.model != ns.model_dir:
                raise ValueError(f"the model is given twice: {ns.model_dir!r} and --model {ns.model!r}")
            ns.model = ns.model_dir
        values = {}
        for f in dataclasses.fields(cls):
            arg = getattr(ns, f.name)
            env = os.environ.get(f"LORAPLEX_{f.name.upper()}")
            if arg is not None:
                values[f.name] = arg
            elif env is not None and not (f.name == "port" and SERVICE_LINK.match(env)):
                values[f.name] = _parse_env(f, env)
        return cls(**values)


_URL = re.compile(r"^(https?)://([^/?#]*)(.*)$", re.S)


def http_url(url: str, flag: str) -> str:
    """`url`, an http(s) URL, with an IPv6 host put in brackets; ValueError if it is none.

    The operator gives its servers `http://$(NODE_IP):8081`, and the kubelet expands
    $(NODE_IP) to the node's address as it is: on an IPv6 node `http://fd00::5:8081`, which
    no URL parser reads (httpx: "Invalid port"). An unbracketed host with colons is read the
    way that template writes it: the last `:digits` is the port when what comes before is an
    IPv6 address (`fd00::5:8081` -> `[fd00::5]:8081`), else the whole is the address with no
    port. IPv4 addresses and names are left as they are.
    """
    m = _URL.match(url)
    if m is None:
        raise ValueError(f"{flag} {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    scheme, netloc, rest = m.groups()
    if netloc.count(":") > 1 and not netloc.startswith("[") and "@" not in netloc:
        host, _, port = netloc.rpartition(":")
        if port.isdigit() and _is_ipv6(host):
            netloc = f"[{host}]:{port}"
        elif _is_ipv6(netloc):
            netloc = f"[{netloc}]"
        else:
            raise ValueError(f"{flag} {url!r}: {netloc!r} is neither HOST:PORT nor an IPv6 address")
    url = f"{scheme}://{netloc}{rest}"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError as e:
        raise ValueError(f"{flag} {url!r}: {e}") from None
    if not parts.hostname:
        raise ValueError(f"{flag} {url!r}: no host")
    return url


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def field_docs(cls: type = ServerSettings) -> dict[str, str]:
    """{field name: its docstring}, read from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _lora_module(item: str) -> str:
    """NAME=PATH of a --lora-modules item given as vLLM's JSON {"name", "path"} (its other keys,
    base_model_name, name the base this server serves anyway); any other item as it is."""
    if not item.lstrip().startswith("{"):
        return item
    try:
        spec = json.loads(item)
    except ValueError as e:
        raise ValueError(f"--lora-modules {item!r}: not JSON ({e})") from None
    if not (isinstance(spec, dict) and isinstance(spec.get("name"), str) and isinstance(spec.get("path"), str)):
        raise ValueError(f"--lora-modules {item!r}: the JSON form is {{\"name\": NAME, \"path\": PATH}}")
    return f"{spec['name']}={spec['path']}"


def _kind(f: dataclasses.Field) -> str:
    hint = typing.get_type_hints(ServerSettings)[f.name]
    if hint is bool:
        return "bool"
    if hint is int:
        return "int"
    if hint is float or hint == float | None:
        return "float"
    if typing.get_origin(hint) is list:
        return "list"
    return "str"


def _parse_env(f: dataclasses.Field, raw: str):
    kind = _kind(f)
    if kind == "bool":
        value = raw.strip().lower()
        if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"LORAPLEX_{f.name.upper()}={raw!r}: use 1/true/yes/on or 0/false/no/off")
        return value in ("1", "true", "yes", "on")
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LORAPLEX_{f.name.upper()}={raw!r}: not an integer") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"LORAPLEX_{f.name.upper()}={raw!r}: not a number") from None
    if kind == "list":
        return [x for x in raw.replace(",", " ").split() if x]
    return raw


def build_parser() -> argparse.ArgumentParser:
    """One flag per ServerSettings field; every default is None so that the dataclass
    (or the environment) supplies it."""
    parser = argparse.ArgumentParser(
        prog="loraplex-server",
        description="OpenAI-compatible multi-LoRA server: one base model, many adapters.",
    )
    # vLLM's `vllm serve MODEL`: the model folder may come first, without --model.
    parser.add_argument("model_dir", nargs="?", default=None, metavar="MODEL",
                        help="the model folder, in place of --model (as vLLM's `vllm serve MODEL`)")
    docs = field_docs()
    for f in dataclasses.fields(ServerSettings):
        flags = ["--" + f.name.replace("_", "-"), *FLAG_ALIASES.get(f.name, ())]
        kind = _kind(f)
        help_text = docs.get(f.name, "")
        if kind == "bool":
            parser.add_argument(*flags, dest=f.name, default=None,
                                action=argparse.BooleanOptionalAction, help=help_text)
        elif kind in ("int", "float"):
            parser.add_argument(*flags, dest=f.name, default=None, type=int if kind == "int" else float, help=help_text)
        elif kind == "list":
            parser.add_argument(*flags, dest=f.name, default=None, nargs="+", action="extend", help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, default=None, help=help_text)
    return parser
