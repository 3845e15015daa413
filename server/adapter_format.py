"""The PEFT LoRA adapter format, read and checked against a base, with the standard library only.

An adapter directory as `peft` saves it::

    adapter_config.json         {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "use_rslora": false,
                                 "target_modules": ["q_proj", "v_proj"], "rank_pattern": {}, ...}
    adapter_model.safetensors   base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight [r, in]
                                base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight [out, r]

`read_adapter(path, base)` parses both (the safetensors *header* only: 8-byte little-endian
length, then JSON) and returns an `AdapterSpec`, or raises `AdapterError` whose message says
which part does not fit and why. The node agent and the operator import this module, so it
must never import torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Bytes per element of the safetensors dtypes an adapter may use.
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}

# A LoRA weight as peft loads it into a causal LM (PeftModel.from_pretrained, adapter "default"):
# "base_model.model." and the module's name, then lora_A / lora_B, "default." or nothing, weight.
# peft loads no other name: it reports the module's weights missing and runs the base there.
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>0|[1-9]\d*)\.(?P<block>self_attn|mlp)\.(?P<proj>[a-z_]+)"
    r"\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
# A LoRA weight of a decoder layer's projection named some other way (to say why it is refused).
_LOOSE_KEY = re.compile(
    r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<block>[\w-]+)\.(?P<proj>[\w-]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?\.weight$")
# Training-only state of LoRA variants whose inference is plain LoRA (peft's VeLoRA and MonteCLoRA
# forwards are B A x outside training, and merge as plain LoRA): saved beside lora_A / lora_B,
# not read here. {variant's config key: tensor name}
_TRAINING_STATE_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.\d+\.(?:self_attn|mlp)\.[a-z_]+\."
    r"(?:(?P<velora_config>lora_velora_embed(?:\.default)?)|(?P<monteclora_config>lora_monteclora_sampler\.[\w.]+))$")
BLOCKS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


class AdapterError(ValueError):
    """An adapter that cannot be served on this base; the message says which part and why."""


class AdapterNotFoundError(AdapterError):
    """No adapter at the path: no such directory, or one without an adapter_config.json
    (vLLM's "No adapter found", a 404 from load_lora_adapter)."""


@dataclass(frozen=True)
class BaseSpec:
    """What an adapter must fit: the base's projection shapes and the server's limits."""

    num_layers: int
    module_shapes: dict[str, tuple[int, int]]  # {"q_proj": (in_features, out_features), ...}
    max_rank: int
    allowed_modules: tuple[str, ...] = LORA_MODULES


@dataclass(frozen=True)
class ModuleLoRA:
    """One targeted projection of one layer: lora_A [rank, in], lora_B [out, rank]."""

    layer: int
    proj: str
    rank: int
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) with use_rslora
    key_a: str
    key_b: str


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int  # the config's r
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # projections present in the weights, sorted as LORA_MODULES
    modules: tuple[ModuleLoRA, ...]
    max_rank: int  # the largest rank of any module (rank_pattern may raise it above r)
    nbytes: int  # bytes of the LoRA tensors in the file
    base_model_name_or_path: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def module(self, layer: int, proj: str) -> ModuleLoRA | None:
        for m in self.modules:
            if m.layer == layer and m.proj == proj:
                return m
        return None


# peft's LoraConfig defaults for keys an adapter_config.json may leave out (peft loads a config
# with the dataclass's defaults for what it lacks).
PEFT_DEFAULT_R = 8
PEFT_DEFAULT_ALPHA = 8

# PEFT LoraConfig options whose adapters compute something other than y += scaling * B A x on
# the base's own projections: served as plain LoRA they would give wrong outputs, and their
# weights may well be plain lora_A/lora_B tensors of the right shapes. {key: what it is}
UNSUPPORTED_OPTIONS = {
    "alora_invocation_tokens": "activated LoRA (aLoRA: active only from its invocation tokens on)",
    "layer_replication": "layer replication (its layers are a stack the base does not have)",
    "lora_bias": "a trained bias on lora_B",
    "use_qalora": "QA-LoRA (lora_A reads pooled inputs)",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRA on parameters rather than projections",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "KaSA (singular values between A and B, and a truncated base)",
    "use_bdlora": "BD-LoRA (block-diagonal lora_A or lora_B, saved as its blocks)",
}
# init_lora_weights values whose initialisation rewrote the base's weights (W - scaling * B A,
# or a quantized W): such an adapter fits that changed base, not this one. PEFT's
# save_pretrained(path_initial_model_for_weight_conversion=...) converts one into a plain
# LoRA, and writes init_lora_weights = true.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")

# safetensors dtypes and their bytes per element (for checking a header against its file).
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
MAX_HEADER_BYTES = 100 << 20
# adapter_config.json: PEFT writes about a kilobyte; a rank_pattern over every module of a
# 126-layer model is ~100 kB.
MAX_CONFIG_BYTES = 16 << 20

# Serving dtypes (the server's --dtype) and their safetensors names.
SERVING_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def serving_weights_name(dtype: str) -> str:
    """The file name of an adapter's weights converted to a serving dtype once, when the node
    agent staged it (node_agent.convert), beside the original `adapter_model.safetensors`."""
    return f"adapter_model.{dtype}.safetensors"


# Beside a staged version's files: {"name", "sha256", "source"}, the version it is (the node
# agent writes it, node_agent/store.py; so does the server's own http(s) fetch).
STAGED_META_FILE = ".loraplex.json"


def staged_version(directory: str | Path) -> tuple[str | None, str | None]:
    """(sha256, source) of the version staged at `directory` (its STAGED_META_FILE); None for
    what it does not say (a folder that no node agent or fetch staged says nothing)."""
    try:
        meta = json.loads((Path(directory) / STAGED_META_FILE).read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(meta, dict):
        return None, None
    sha, source = meta.get("sha256"), meta.get("source")
    return (sha if isinstance(sha, str) else None), (source if isinstance(source, str) else None)


def serving_weights(directory: str | Path, dtype: str) -> Path:
    """The weights file a server of `dtype` reads: the staged conversion when there is one, else
    `adapter_model.safetensors` (whose tensors it converts as it reads them)."""
    converted = Path(directory) / serving_weights_name(dtype)
    return converted if converted.is_file() else Path(directory) / WEIGHTS_FILE


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype": "F16", "shape": [..], "data_offsets": [..]}} without the data.

    The header is checked against the file: every tensor's byte range fits its dtype and
    shape, and the ranges tile the data to its last byte, so a file cut short (or padded)
    is refused here rather than half-read later.
    """
    path = Path(path)
    raw, data_len = _header_bytes(path)
    return dict(checked_header(raw, data_len, path.name))


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """The safetensors header's JSON bytes and the length of the data after it, both of the
    file opened (not a size stat'ed by path: a new version renamed in between would pair one
    file's header with another's size)."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise AdapterError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise AdapterError(f"{path.name}: header of {n} bytes does not fit a {size}-byte file")
        return f.read(n), size - 8 - n


# Parsing and checking a header is a pure function of its bytes and the data's length, and the
# adapters of one fleet (one base, rank and targets, saved by one tool) share theirs byte for
# byte: a server reads each distinct header once (read_adapter 3.6 against 1.0 ms for a
# Llama-3-8B adapter's 448 tensors, bench/results/disk_read_cpu.json). The
# results are shared: callers must not change them (read_safetensors_header hands out a copy).
#
# Headers are cached (here, in _header_modules and in disk_read.PlanCache) up to this size
# only. A fleet's real ones are tens of KB (a Llama-3-8B adapter's 448 tensors: about 45 KB);
# crafted ones of up to MAX_HEADER_BYTES (a huge __metadata__), kept 32 at a time by each
# cache, would hold gigabytes of host memory.
CACHED_HEADER_BYTES = 1 << 20


def _cache_small_headers(fn):
    """fn(raw, data_len, name), its results cached (32) for headers of at most CACHED_HEADER_BYTES."""
    cached = functools.lru_cache(maxsize=32)(fn)

    @functools.wraps(fn)
    def wrapper(raw: bytes, data_len: int, name: str):
        return cached(raw, data_len, name) if len(raw) <= CACHED_HEADER_BYTES else fn(raw, data_len, name)

    wrapper.cache_clear, wrapper.cache_info = cached.cache_clear, cached.cache_info  # (benches, tests)
    return wrapper


@_cache_small_headers
def checked_header(raw: bytes, data_len: int, name: str) -> dict[str, dict]:
    """A safetensors header's JSON bytes parsed and checked against the data's length (cached)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise AdapterError(f"{name}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{name}: header is not a JSON object")
    header.pop("__metadata__", None)
    ranges = []
    for key, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
                raise ValueError("a shape is a list of non-negative integers")
            want = SAFETENSORS_DTYPE_BYTES[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise AdapterError(f"{name}: tensor {key!r} has a malformed entry {info!r}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len):
            raise AdapterError(f"{name}: tensor {key!r} bytes [{begin}, {end}) outside the "
                               f"{data_len} data bytes (file cut short?)")
        if end - begin != want:
            raise AdapterError(f"{name}: tensor {key!r} has {end - begin} bytes, {dtype} {shape} needs {want}")
        ranges.append((begin, end))
    pos = 0
    for begin, end in sorted(ranges):
        if begin != pos:
            raise AdapterError(f"{name}: tensor data has a gap or overlap at byte {pos}")
        pos = end
    if pos != data_len:
        raise AdapterError(f"{name}: {data_len - pos} bytes after the last tensor")
    return header


def rank_and_alpha(cfg: dict) -> tuple[int, int | float]:
    """The config's `r` and `lora_alpha`, checked; an absent key takes peft's LoraConfig
    default (r 8, lora_alpha 8: not r), as peft loads it. The node agent checks a staged
    config with this too, so that it refuses exactly what the server would."""
    r = cfg.get("r", PEFT_DEFAULT_R)
    alpha = cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not _is_count(r) or r < 1:
        raise AdapterError(f"r={r!r}: expected a positive integer")
    if not _is_number(alpha):
        raise AdapterError(f"lora_alpha={alpha!r}: expected a finite number")
    return r, alpha


def _is_count(x) -> bool:
    """A JSON integer >= 0 (not a bool, a float or a string)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_number(x) -> bool:
    """A finite JSON number that fits a float (Python's json also reads NaN and Infinity)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an integer of 309 digits or more
        return False


@_cache_small_headers
def _header_modules(raw: bytes, data_len: int, name: str) -> tuple[dict, int, dict[str, str]]:
    """The header's LoRA pairs {(layer, proj): {"A"/"B": (key, info)}} and their bytes, each
    tensor name checked, and {variant config key: a tensor of its training state} for the
    variants' tensors (_TRAINING_STATE_KEY) it holds besides (cached as checked_header is)."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, dict]]] = {}
    nbytes = 0
    variants: dict[str, str] = {}
    for key, info in checked_header(raw, data_len, name).items():
        m = _KEY.match(key)
        if m is None:
            state = _TRAINING_STATE_KEY.match(key)
            if state is not None:
                variants.setdefault(state.lastgroup, key)
                continue
            raise AdapterError(_foreign_tensor(key))
        layer, proj, ab = int(m["layer"]), m["proj"], m["ab"]
        if proj not in LORA_MODULES:
            raise AdapterError(f"tensor {key!r} targets {proj!r}, not a LoRA-capable projection")
        if proj not in BLOCKS[m["block"]]:
            raise AdapterError(f"tensor {key!r}: the base has no {m['block']}.{proj} (its {proj} is in "
                               f"{'mlp' if m['block'] == 'self_attn' else 'self_attn'}); peft would not load it")
        if info.get("dtype") not in DTYPE_BYTES:
            raise AdapterError(f"tensor {key!r} has dtype {info.get('dtype')!r}; expected F32, F16 or BF16")
        if len(info.get("shape", [])) != 2:
            raise AdapterError(f"tensor {key!r} has shape {info.get('shape')}; expected 2 dimensions")
        pair = pairs.setdefault((layer, proj), {})
        if ab in pair:  # "lora_A.weight" and "lora_A.default.weight": peft keeps whichever comes last
            raise AdapterError(f"layer {layer} {proj}: lora_{ab} is in the file twice ({pair[ab][0]!r} and {key!r})")
        pair[ab] = (key, info)
        nbytes += math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]
    return pairs, nbytes, variants


def _foreign_tensor(key: str) -> str:
    """Why a tensor that is not a LoRA weight as peft loads it (_KEY) is refused."""
    loose = _LOOSE_KEY.match(key)
    if loose is not None:
        if loose["name"] not in (None, "default"):
            return (f"tensor {key!r} carries the adapter name {loose['name']!r}: peft loads "
                    f"'.lora_A.weight' (or '.lora_A.default.weight') only, and would run the base there")
        return (f"tensor {key!r} is not named as peft saves a causal LM's LoRA weights "
                f"(base_model.model.model.layers.<i>.self_attn|mlp.<proj>.lora_A|lora_B.weight): peft would not "
                f"load it, and would run the base there")
    if "lora_magnitude_vector" in key:
        return f"tensor {key!r} is a DoRA magnitude vector: DoRA adapters are not supported"
    if "lora_embedding_" in key or re.search(r"\b(lm_head|embed_tokens)\.lora_", key):
        return f"tensor {key!r}: LoRA on the embeddings or lm_head is not supported"
    if key.endswith(".bias"):
        return f"tensor {key!r} is a trained bias (bias='all' or 'lora_only'): adapters with trained biases are not supported"
    if ".lora_" not in key:
        return (f"tensor {key!r} is a whole module's weight (modules_to_save?): adapters that replace base "
                f"modules are not supported")
    return f"tensor {key!r} is not a LoRA A/B weight of a decoder layer projection"


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (names made, renamed or removed in it) durable: fsync the
    directory itself, as a rename into place needs after the files' own fsync."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | Path) -> str:
    """sha256 hex digest of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the
    module's name ("model.layers.3.self_attn.q_proj" matches "q_proj", "layers.3.self_attn.q_proj"
    or a regex such as "^model.layers.3.*q_proj")."""
    for key in patterns:
        if re.match(_pattern_regex(key), module_key):
            return patterns[key]
    return default


def _pattern_regex(key: str) -> str:
    """A rank_pattern / alpha_pattern key as the regex PEFT matches module names with."""
    return rf"(.*\.)?({key})$"


def module_name(layer: int, proj: str) -> str:
    """A projection's module name in a Llama-family causal LM, as peft matches target_modules,
    exclude_modules, rank_pattern and alpha_pattern against it: "model.layers.3.self_attn.q_proj"."""
    return f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"


# The other modules of a Llama-family causal LM (transformers' named_modules, {i}: each layer).
# LoRA on one of these is not served: lm_head and embed_tokens peft would adapt, the rest
# (norms, the MLP or attention block as a whole) peft refuses itself.
OTHER_MODULES = ("", "model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
OTHER_LAYER_MODULES = ("model.layers.{i}", "model.layers.{i}.self_attn", "model.layers.{i}.mlp",
                       "model.layers.{i}.mlp.act_fn", "model.layers.{i}.input_layernorm",
                       "model.layers.{i}.post_attention_layernorm")
# peft's target_modules for a config that names none (its default for llama, mistral and qwen2)
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")


def _names(value, key: str) -> list[str] | str | None:
    """A target_modules / exclude_modules value: None, a regex string or a list of names."""
    if value is None or isinstance(value, str):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise AdapterError(f"{key}={value!r} is not a regular expression ({e})") from None
        return value
    if isinstance(value, list) and all(isinstance(t, str) for t in value):
        return value
    raise AdapterError(f"{key}={value!r}: expected module names (a list) or a regular expression (a string)")


def peft_targets(cfg: dict, num_layers: int) -> set[tuple[int, str]]:
    """The (layer, projection) modules peft puts a LoRA layer on for this config, matched as
    peft's check_target_module_exists matches module names (peft 0.21): target_modules a
    list (a name or the end of one after a dot, "q_proj", "self_attn.q_proj" or a full name as
    peft saves "all-linear"), a regex string (fullmatch) or "all-linear"; then
    layers_to_transform / layers_pattern (for a list), and exclude_modules. peft loads an
    adapter's weights into these modules only, and drops any others in the file silently.
    Raises AdapterError for a target that is not a LoRA-capable projection here."""
    targets = _names(cfg.get("target_modules"), "target_modules")
    if targets is None:
        targets = list(PEFT_DEFAULT_TARGETS)
    exclude = _names(cfg.get("exclude_modules"), "exclude_modules")
    layer_indexes = cfg.get("layers_to_transform")
    if not (layer_indexes is None or _is_count(layer_indexes)
            or (isinstance(layer_indexes, list) and all(_is_count(i) for i in layer_indexes))):
        raise AdapterError(f"layers_to_transform={layer_indexes!r}: expected a layer index or a list of them")
    layers_pattern = cfg.get("layers_pattern")
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern] if layers_pattern else []
    if not (layers_pattern is None or (isinstance(layers_pattern, list) and all(isinstance(p, str) for p in layers_pattern))):
        raise AdapterError(f"layers_pattern={cfg.get('layers_pattern')!r}: expected a name or a list of names")
    for pattern in layers_pattern or ():
        try:
            re.compile(pattern)
        except re.error as e:
            raise AdapterError(f"layers_pattern: {pattern!r} is not a regular expression ({e})") from None
    projections = {module_name(i, proj): (i, proj) for i in range(num_layers) for proj in LORA_MODULES}
    all_linear = isinstance(targets, str) and targets.lower() == "all-linear"

    def found(key: str) -> bool:  # peft's check_target_module_exists, exclude_modules aside
        if all_linear:  # every nn.Linear but the output embedding (lm_head): the seven projections
            return key in projections
        if isinstance(targets, str):
            return re.fullmatch(targets, key) is not None
        if key in targets:
            return True
        if not any(key.endswith(f".{t}") for t in targets):
            return False
        if layer_indexes is None or layer_indexes == []:
            return True
        if not layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            match = next((m for p in layers_pattern if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key))),
                         None)
        if match is None:
            return False
        idx = int(match["idx"])
        return idx == layer_indexes if isinstance(layer_indexes, int) else idx in layer_indexes

    def excluded(key: str) -> bool:
        if not exclude:
            return False
        if isinstance(exclude, str):
            return re.fullmatch(exclude, key) is not None
        return key in exclude or any(key.endswith(f".{e}") for e in exclude)

    others = [*OTHER_MODULES, *(m.format(i=i) for i in range(num_layers) for m in OTHER_LAYER_MODULES)]
    wrong = sorted({key or "<the whole model>" for key in others if found(key) and not excluded(key)})
    if wrong:
        raise AdapterError(
            f"target_modules={cfg.get('target_modules')!r} targets {wrong[:4]}{' ...' if len(wrong) > 4 else ''}: "
            f"only the decoder layers' projections {list(LORA_MODULES)} are LoRA-capable here "
            f"(LoRA on lm_head or embed_tokens is not served)")
    if isinstance(targets, list):
        unmatched = sorted(t for t in targets if not any(k == t or k.endswith(f".{t}") for k in projections))
        if unmatched:
            raise AdapterError(
                f"target_modules {unmatched} are not LoRA-capable projections of this base "
                f"(an adapter for another architecture?); supported: {list(LORA_MODULES)}")
    return {module for key, module in projections.items() if found(key) and not excluded(key)}


def read_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise AdapterNotFoundError(f"{path}: not a directory")
    if not cfg_file.is_file():
        raise AdapterNotFoundError(f"{path}: no {CONFIG_FILE}")
    with cfg_file.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CONFIG_BYTES:  # checked before it is read: it would all be in memory
            raise AdapterError(f"{cfg_file}: {size} bytes, too large for an adapter config "
                               f"(at most {MAX_CONFIG_BYTES})")
        raw = f.read(MAX_CONFIG_BYTES + 1)
    try:
        cfg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise AdapterError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file}: not a JSON object")
    return cfg


def read_adapter(path: str | Path, base: BaseSpec) -> AdapterSpec:
    """Parse and check an adapter directory against `base`; raise AdapterError if it does not fit."""
    path = Path(path)
    cfg = read_config(path)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r}: only LORA adapters are served")
    if cfg.get("use_dora"):
        raise AdapterError("use_dora=true: DoRA adapters are not supported")
    # bias "all" / "lora_only" saves the biases it trained beside the LoRA weights; a Llama has
    # none, so its file is a plain LoRA's, as peft runs it. A file with biases is refused by
    # its tensors (_foreign_tensor).
    if cfg.get("bias", "none") not in ("none", "all", "lora_only"):
        raise AdapterError(f"bias={cfg['bias']!r}: expected 'none', 'all' or 'lora_only'")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save={cfg['modules_to_save']!r}: adapters that replace whole base modules are not supported")
    # fan_in_fan_out: peft turns it off for an nn.Linear target (it warns), and every projection
    # here is one: its weights are (out, in) and its A and B the same as without it.
    for key, what in UNSUPPORTED_OPTIONS.items():
        value = cfg.get(key)
        if isinstance(value, dict) or value:  # a sub-config turns its option on even when empty
            raise AdapterError(f"{key}={value!r}: {what} is not supported, only plain LoRA")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise AdapterError(
            f"init_lora_weights={init!r}: that initialisation changed the base's weights, so the adapter "
            f"does not fit the base served here; convert it to a plain LoRA (PEFT's save_pretrained with "
            f"path_initial_model_for_weight_conversion)")
    r, alpha = rank_and_alpha(cfg)
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for key, patterns in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(patterns, dict):
            raise AdapterError(f"{key}={patterns!r}: expected an object of module name patterns")
        for pattern in patterns:
            try:
                re.compile(_pattern_regex(pattern))
            except re.error as e:
                raise AdapterError(f"{key}: {pattern!r} is not a regular expression ({e})") from None
    targeted = peft_targets(cfg, base.num_layers)

    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is not read: re-save with safe_serialization=True)"
            if (path / "adapter_model.bin").is_file() else ""))
    pairs, nbytes, variants = _header_modules(*_header_bytes(weights), weights.name)
    for variant, key in variants.items():
        if not isinstance(cfg.get(variant), dict):
            raise AdapterError(f"tensor {key!r} is a LoRA variant's training state, but the config has no {variant}: "
                               f"not a LoRA A/B weight of a decoder layer projection")
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")

    present = {proj for _, proj in pairs}
    not_allowed = sorted(present - set(base.allowed_modules), key=LORA_MODULES.index)
    if not_allowed:
        raise AdapterError(
            f"target modules {not_allowed} are not allowed on this server "
            f"(allowed: {list(base.allowed_modules)})")

    modules = []
    for (layer, proj), ab in sorted(pairs.items(), key=lambda kv: (kv[0][0], LORA_MODULES.index(kv[0][1]))):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {proj}: lora_{'B' if 'A' in ab else 'A'} is missing")
        if layer >= base.num_layers:
            raise AdapterError(f"layer {layer} {proj}: the base has only {base.num_layers} layers")
        if (layer, proj) not in targeted:
            raise AdapterError(
                f"{ab['A' if 'A' in ab else 'B'][0]!r}: {module_name(layer, proj)} is not targeted by the config "
                f"(target_modules, layers_to_transform, exclude_modules): peft would not load these weights, "
                f"and drops them silently")
        (key_a, info_a), (key_b, info_b) = ab["A"], ab["B"]
        (ra, in_a), (out_b, rb) = info_a["shape"], info_b["shape"]
        want_in, want_out = base.module_shapes[proj]
        if in_a != want_in or out_b != want_out:
            raise AdapterError(
                f"layer {layer} {proj}: LoRA shapes A {info_a['shape']}, B {info_b['shape']} do not fit the "
                f"base's {proj} (in {want_in}, out {want_out}); the adapter was trained for another base"
                + (f" ({cfg['base_model_name_or_path']})" if cfg.get("base_model_name_or_path") else ""))
        if ra != rb:
            raise AdapterError(f"layer {layer} {proj}: lora_A rank {ra} != lora_B rank {rb}")
        if ra < 1:
            raise AdapterError(f"layer {layer} {proj}: rank 0 (empty lora_A and lora_B): expected a positive rank")
        module_key = module_name(layer, proj)
        want_rank = _pattern_value(rank_pattern, module_key, r)
        if ra != want_rank:
            raise AdapterError(
                f"layer {layer} {proj}: weights have rank {ra} but the config says {want_rank}")
        if ra > base.max_rank:
            raise AdapterError(
                f"layer {layer} {proj}: rank {ra} exceeds this server's max LoRA rank {base.max_rank}")
        a = _pattern_value(alpha_pattern, module_key, alpha)
        if not _is_number(a):
            raise AdapterError(f"layer {layer} {proj}: lora_alpha {a!r} (alpha_pattern): expected a finite number")
        a = float(a)
        scaling = a / math.sqrt(ra) if rslora else a / ra
        modules.append(ModuleLoRA(layer, proj, ra, a, scaling, key_a, key_b))

    warnings = []
    missing = targeted - set(pairs)
    if missing:
        projs = sorted({proj for _, proj in missing}, key=LORA_MODULES.index)
        warnings.append(f"target_modules {projs} have no weights in {WEIGHTS_FILE} in {len(missing)} of the "
                        f"targeted modules (e.g. {module_name(*min(missing))}): served without LoRA there")
    return AdapterSpec(
        path=str(path),
        rank=r,
        lora_alpha=float(alpha),
        use_rslora=rslora,
        target_modules=tuple(p for p in LORA_MODULES if p in present),
        modules=tuple(modules),
        max_rank=max(m.rank for m in modules),
        nbytes=nbytes,
        base_model_name_or_path=cfg.get("base_model_name_or_path"),
        warnings=tuple(warnings),
    )


def write_adapter_config(path: str | Path, *, r: int, lora_alpha: float, target_modules: list[str],
                         use_rslora: bool = False, rank_pattern: dict | None = None,
                         alpha_pattern: dict | None = None, base_model_name_or_path: str | None = None) -> None:
    """Write adapter_config.json with the keys `peft` writes for a LoRA adapter."""
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path, "revision": None,
        "inference_mode": True, "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0,
        "target_modules": list(target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": use_rslora, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {},
    }
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))


def peft_key(layer: int, proj: str, ab: str) -> str:
    """The key `peft` saves for one LoRA weight, e.g. peft_key(3, "q_proj", "A") ->
    "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"."""
    block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{proj}.lora_{ab}.weight"
