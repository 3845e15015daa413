"""add_lora against the peers' Triton LoRA kernels, on the same inputs, in one run (bf16, one GPU).

    bench/fetch_peers.sh                      # once, where pip can download: fills .peers/
    python3 bench/peer_kernels.py --out peers.json [--quick] [--ranks 16] [--phases decode,prefill]
    python3 bench/peer_kernels.py --out peers.json --phases decode --layer   # and the layer measure
    python3 bench/peer_kernels.py --smoke     # CPU, Triton's interpreter: every path checked, none timed

The peers are the op files of vLLM and SGLang, extracted from their wheels into `.peers/`
(VERSIONS names the releases) and loaded here by file path; the few names they import from
the rest of their packages are shim modules defined below (no peer file is edited):

  vllm            lora_shrink then lora_expand (Punica SGMV; what PunicaWrapperGPU.add_lora_linear
                  runs): per-slice A [S, r, in] and B [S, out_i, r], the float32 [n, T, r] buffer
                  zeroed by the shrink, LoRAKernelMeta over max_loras = S slots, the default
                  (unspecialised) grid of S + 1 LoRA ids;
  sglang_triton   SGLang's classic "triton" backend: sgemm_lora_a, then qkv_lora_b (q/k/v),
                  gate_up_lora_b (gate/up) or sgemm_lora_b (o, down); decode segments merged by
                  adapter over the sorted tokens, prefill one segment per request;
  sglang_csgmv    the "csgmv" backend (SGLang's default): chunked_sgmv_shrink / _expand over the
                  tokens sorted by adapter in chunks of 16 (its default --max-lora-chunk-size);
                  sglang_csgmv_chunk128 with --max-lora-chunk-size 128 where that changes the
                  chunk (its heuristic: 32 from 64 tokens, 128 from 256);
  sglang_v2       the "triton_v2" backend: DenseLoraRunner's shrink then expand (routing, grouped /
                  per-row / all-slots families, tiles and split-K from its sm90 plan table), as
                  run_a then run_b, i.e. without the side-stream overlap its plans may ask for
                  (--layer times that overlap, in the layer: below).

Every path adds the same LoRA term into y: ours with its float32 [S, n] scaling; the peers
take one scale (vLLM) or one per slot (SGLang), so each slice's scaling is folded into their
copy of B (bf16, as vLLM folds it at load time) and their scale is 1. Weight copies, layouts
and each step's metadata (the peers' routing, our LoRABatch) are built outside the timed
region, as they are once per forward for every layer. Each path is checked against the
float32 reference first (relative error of the term, bf16 under 2e-2); a path that fails
the check or raises is recorded and not timed. Then each is timed as kernels_bench.py times
ours: CUDA-graph replays, L2 flushed before each, the median of --reps; beside the base GEMM.
Per case: us per path, the best peer, ours / best peer and the fastest path.

--layer (JSON key `layer_results`, beside `results`, which it leaves as they were): the whole
decode layer y = x W^T + LoRA term, on the decode cases up to the rows where the engine runs
lora_linear (server/model.py's TRITON_GEMM_MAX_TOKENS; --layer-tokens all: every decode case),
on the same case tensors, each path writing the whole output into a buffer:
  ours_layer          what the engine runs for that many rows: lora_linear (our GEMM with the
                      shrink beside it and the expand after it, chained by PDL) up to the rule's
                      rows, torch.matmul then add_lora above;
  cublas_then_ours    torch.matmul (cuBLAS) then add_lora;
  cublas_then_<peer>  torch.matmul then that peer path's LoRA term, one after the other, one stream;
  sglang_v2_overlap   SGLang's own DenseLoraRunner.apply (what TritonV2LoRABackend.forward_with_base
                      calls for a linear layer) with its table's plan: with overlap "a" (every sm90
                      decode plan) the shrink on a side stream beside the base GEMM, the expand after
                      it on the caller's stream, through LoraWorkspace.run_parallel's two events;
                      captured in the same CUDA graph as the rest (the events fork the side stream
                      into the capture and join it back); a plan with no overlap runs, and is
                      timed, in apply's sequential order; the note records the plan's overlap.
Each is checked against the float32 x W^T + term (relative error of the whole output, under
2e-2) before timing and again on what the timed replays left; timed as above (CUDA-graph
replays, L2 flushed; a path whose capture fails is timed by CUDA events over eager launches,
and `timers` says which). Per case the base GEMM alone (and our GEMM alone where ours runs
lora_linear), ours_layer over the best peer layer, SGLang's overlap over its sequential layer;
a short table at the end. --layer-only skips the LoRA-term table.
"""

from __future__ import annotations

import sys
import os

if "--smoke" in sys.argv or ("--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]):
    # Triton reads it when a kernel is decorated: before ours or any peer file is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import enum  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_bench import (  # noqa: E402  (bench/ is sys.path[0]; it maps the checkout)
    LAYERS, PREFILL, GraphTimer, copy_bandwidth, fewest_bytes, launch_floor, loop_per_adapter, make_case,
    rel_error, timing_meta,
)
from loraplex.kernels import LoRABatch, add_lora  # noqa: E402
from loraplex.kernels.linear import gemm, gemm_config, lora_linear  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("LORAPLEX_PEERS", ROOT / ".peers"))
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
DECODE_ADAPTERS = (1, 8, 32, "per-token")
PEER_NAMES = ("vllm", "sglang_triton", "sglang_csgmv", "sglang_v2")
TOLERANCE = 2e-2
CSGMV_DEFAULT_CHUNK = 16  # SGLang's default --max-lora-chunk-size
CSGMV_MAX_CHUNK = 128  # the largest it accepts
log = logging.getLogger("peer_kernels")


# --------------------------------------------------------------------------------------
# Shim modules: the names the peer files import from the rest of their packages.
# --------------------------------------------------------------------------------------

def _module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    """A module registered in sys.modules (a package when `path` is given: its own files
    then import from there), attached to its parent."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if path is not None:
        mod.__path__ = [str(path)]
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


def _load(name: str, path: Path) -> types.ModuleType:
    """A peer file, loaded by path under its own module name."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run bench/fetch_peers.sh")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    setattr(sys.modules[parent], child, mod)
    return mod


def _capability() -> int:
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


class _Logger(logging.LoggerAdapter):
    """vllm.logger's loggers: plus warning_once / info_once."""

    def __init__(self, name):
        super().__init__(logging.getLogger(name), {})
        self._seen = set()

    def _once(self, level, msg, *args, **kwargs):
        kwargs.pop("scope", None)
        if (level, msg) not in self._seen:
            self._seen.add((level, msg))
            self.log(level, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)


class _Platform:
    """vllm.platforms.current_platform: what the LoRA ops ask of it."""

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def has_device_capability(self, capability) -> bool:
        want = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability
        return self.is_cuda() and _capability() >= want

    def is_device_capability(self, capability) -> bool:
        want = capability[0] * 10 + capability[1] if isinstance(capability, tuple) else capability
        return self.is_cuda() and _capability() == want


def _async_tensor_h2d(data, device=None, dtype=None, out=None):
    """vllm.utils.torch_utils.async_tensor_h2d: a host list copied to the device."""
    pin = torch.cuda.is_available()
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype, device="cpu", pin_memory=pin)
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device=device, non_blocking=True)


def _direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None,
                               dispatch_key=None, tags=()):
    """Registers nothing: the op files then bind their Python function (their own
    `except AttributeError` branch), and this bench calls that function itself. The
    dispatcher hop only costs host time, which graph replays do not include."""


def install_vllm_shims(root: Path) -> None:
    _module("vllm", root / "vllm")
    # vllm.envs at vLLM's defaults (each read from the environment as vLLM reads it).
    _module("vllm.envs",
            VLLM_BATCH_INVARIANT=_env_flag("VLLM_BATCH_INVARIANT", False),
            VLLM_TUNED_CONFIG_FOLDER=os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
            VLLM_LORA_DISABLE_PDL=_env_flag("VLLM_LORA_DISABLE_PDL", False),
            VLLM_LORA_ENABLE_DUAL_STREAM=_env_flag("VLLM_LORA_ENABLE_DUAL_STREAM", False))
    _module("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)
    _module("vllm.platforms", current_platform=_Platform())
    _module("vllm.logger", init_logger=_Logger)
    _module("vllm.utils", root / "vllm" / "utils")
    _module("vllm.utils.math_utils", next_power_of_2=lambda n: 1 if n < 1 else 1 << (n - 1).bit_length())
    _module("vllm.utils.torch_utils", direct_register_custom_op=_direct_register_custom_op,
            async_tensor_h2d=_async_tensor_h2d)
    _module("vllm.lora", root / "vllm" / "lora")
    _module("vllm.lora.ops", root / "vllm" / "lora" / "ops")
    _module("vllm.lora.ops.triton_ops", root / "vllm" / "lora" / "ops" / "triton_ops")


class SGLangPhase(str, enum.Enum):  # sglang.srt.lora.utils.Phase
    DECODE = "decode"
    PREFILL = "prefill"


@dataclasses.dataclass
class LoRABatchInfo:
    """sglang.srt.lora.utils.LoRABatchInfo, its fields in its order."""

    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: int | None
    seg_lens: torch.Tensor | None
    permutation: torch.Tensor | None = None
    expected_tokens: int | None = None
    has_active_lora: bool = False
    is_prefill: bool = False
    req_seg_indptr: torch.Tensor | None = None
    req_weight_indices: torch.Tensor | None = None
    moe_lora_info: object | None = None


def _architecture_for_capability(major: int) -> str:  # sglang.srt.lora.utils
    return "sm90" if major == 9 else "sm100" if major >= 10 else "default"


class _SGLangEnv:
    def __init__(self, name, default):
        self.name, self.default = name, default

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self):
        if not self.is_set():
            return self.default
        return _env_flag(self.name, False) if isinstance(self.default, bool) else os.environ[self.name]


class _SGLangEnvs:
    """sglang.srt.environ.envs: only the variables the extracted files read, at SGLang's defaults."""

    DEFAULTS = {"SGLANG_ENABLE_LORA_CSGMV_SPLIT_K": False, "SGLANG_ENABLE_DETERMINISTIC_INFERENCE": False,
                "SGLANG_LORA_DENSE_CONFIG_DIR": None}

    def __getattr__(self, name):
        if name not in self.DEFAULTS:
            raise AttributeError(f"the sglang envs shim has no {name}")
        return _SGLangEnv(name, self.DEFAULTS[name])


def _cached_triton_kernel(key_fn=None):
    """sglang.srt.utils.cached_triton_kernel: the kernel itself (Triton's own cache, which
    SGLang falls back to off CUDA). Its wrapper only trims host-side launch cost, which
    graph replays do not include; the compiled kernel is the same."""
    return lambda fn: fn


def _device_name(device_id: int = 0) -> str:
    return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def _align_block_size(topk_ids, block_size, num_experts, scratch=None, *, return_inactive_prefix_count=False,
                      map_invalid_experts_to_sentinel=True):
    """moe.virtual_experts._align_block_size_jit (a CUDA JIT kernel, not carried) as SGLang's own
    torch fallback computes it: rows sorted into buckets padded to `block_size`, pads = the row
    count, the invalid-id bucket last with block id -1. Only routes of 769..16383 rows take it
    (prefill here); routes are built outside the timed region."""
    if return_inactive_prefix_count:
        raise NotImplementedError("the route shim returns no inactive prefix count")
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    sentinel = num_experts
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, sentinel))
    buckets = num_experts + 1
    capacity = (n + buckets * (block_size - 1) + block_size - 1) // block_size * block_size
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=device)
    block_ids = torch.full((capacity // block_size,), -1, dtype=torch.int32, device=device)
    if n == 0:
        return sorted_ids, block_ids, torch.zeros(1, dtype=torch.int32, device=device)
    order = torch.argsort(ids, stable=True)
    ordered = ids[order]
    bucket_range = torch.arange(buckets, device=device, dtype=torch.int64)
    starts = torch.searchsorted(ordered, bucket_range)
    counts = torch.searchsorted(ordered, bucket_range, right=True) - starts
    padded = (counts + block_size - 1) // block_size * block_size
    total = padded.sum().to(torch.int32).reshape(1)
    padded_starts = torch.cumsum(padded, 0) - padded
    ranks = torch.arange(n, device=device) - starts[ordered]
    sorted_ids.scatter_(0, padded_starts[ordered] + ranks, order.to(torch.int32))
    real_blocks = padded // block_size
    real_blocks[sentinel] = 0
    ends = torch.cumsum(real_blocks, 0)
    positions = torch.arange(block_ids.numel(), device=device)
    block_ids.copy_(torch.where(positions < ends[-1], torch.searchsorted(ends, positions, right=True),
                                -1).to(torch.int32))
    return sorted_ids, block_ids, total


def _is_arch_support_pdl() -> bool:  # sglang.kernels.jit.utils
    return _capability() >= 90


def _msgspec_shim() -> types.ModuleType:
    """msgspec.Struct as a dataclass (RouteView: frozen, keyword-only fields)."""

    class Struct:
        def __init_subclass__(cls, frozen=False, kw_only=False, **kwargs):
            super().__init_subclass__(**kwargs)
            dataclasses.dataclass(frozen=frozen, kw_only=kw_only, eq=False)(cls)

    mod = types.ModuleType("msgspec")
    mod.Struct = Struct
    return mod


_MISSING = object()


def _pydantic_shim() -> types.ModuleType:
    """What plan.py asks of pydantic, used only where pydantic is not installed: BaseModel
    with typed fields (enums, nested models, lists, dicts, optionals), Field(default_factory),
    ConfigDict(extra="forbid"), model_validator(mode="after"), model_validate, model_dump.
    --smoke checks it resolves every plan of the table as pydantic does."""

    class FieldInfo:
        def __init__(self, default=_MISSING, default_factory=None):
            self.default, self.default_factory = default, default_factory

    def Field(default=_MISSING, *, default_factory=None, **_):  # noqa: N802
        return FieldInfo(default, default_factory)

    def ConfigDict(**kwargs):  # noqa: N802
        return dict(kwargs)

    def model_validator(*, mode):
        def mark(fn):
            fn.__shim_validator__ = mode
            return fn
        return mark

    def coerce(tp, value):
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is typing.Any:
            return value
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            for arg in args:
                if arg is type(None):
                    continue
                try:
                    return coerce(arg, value)
                except (TypeError, ValueError):
                    pass
            raise ValueError(f"{value!r} is none of {args}")
        if origin is list:
            return [coerce(args[0], v) for v in value]
        if origin is dict:
            if not isinstance(value, dict):
                raise TypeError(f"{value!r} is not a dict")
            return {coerce(args[0], k): coerce(args[1], v) for k, v in value.items()}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return tp(value)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return tp.model_validate(value)
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{value!r} is not an int")
            return value
        if tp is str:
            if not isinstance(value, str):
                raise TypeError(f"{value!r} is not a str")
            return value
        return value

    class BaseModel:
        model_config = {}

        def __init__(self, **data):
            self.__dict__.update(type(self).model_validate(data).__dict__)

        @classmethod
        def _fields(cls) -> dict:
            return typing.get_type_hints(cls)  # each class's annotations in its own module

        @classmethod
        def model_validate(cls, raw):
            if isinstance(raw, cls):
                return raw
            if not isinstance(raw, dict):
                raise TypeError(f"{cls.__name__} needs a dict, got {type(raw).__name__}")
            fields = cls._fields()
            extra = set(raw) - set(fields)
            if extra and cls.model_config.get("extra") == "forbid":
                raise ValueError(f"{cls.__name__}: unknown fields {sorted(extra)}")
            obj = object.__new__(cls)
            for name, tp in fields.items():
                if name in raw:
                    value = coerce(tp, raw[name])
                else:
                    default = getattr(cls, name, _MISSING)
                    if isinstance(default, FieldInfo):
                        default = default.default_factory() if default.default_factory else default.default
                    if default is _MISSING:
                        raise ValueError(f"{cls.__name__}: {name} is required")
                    value = default
                obj.__dict__[name] = value
            for attr in dir(cls):
                if getattr(getattr(cls, attr, None), "__shim_validator__", None) == "after":
                    getattr(obj, attr)()
            return obj

        def model_dump(self) -> dict:
            return {k: (v.model_dump() if isinstance(v, BaseModel) else v)
                    for k, v in self.__dict__.items() if k in self._fields()}

    mod = types.ModuleType("pydantic")
    mod.BaseModel, mod.Field, mod.ConfigDict, mod.model_validator = BaseModel, Field, ConfigDict, model_validator
    return mod


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def install_sglang_shims(root: Path) -> dict:
    """Returns which third-party modules are shims (msgspec, pydantic: real ones when installed)."""
    used = {}
    for name, make in (("msgspec", _msgspec_shim), ("pydantic", _pydantic_shim)):
        used[name] = "installed" if _importable(name) else "shim"
        if used[name] == "shim":
            sys.modules[name] = make()
    s = root / "sglang"
    _module("sglang", s)
    _module("sglang.srt", s / "srt")
    _module("sglang.srt.utils", cached_triton_kernel=_cached_triton_kernel, get_device_name=_device_name)
    _module("sglang.srt.environ", envs=_SGLangEnvs())
    _module("sglang.srt.lora", s / "srt" / "lora")
    _module("sglang.srt.lora.utils", LoRABatchInfo=LoRABatchInfo, Phase=SGLangPhase,
            architecture_for_capability=_architecture_for_capability)
    _module("sglang.srt.lora.dense", s / "srt" / "lora" / "dense")
    _module("sglang.kernels", s / "kernels")
    _module("sglang.kernels.jit")
    _module("sglang.kernels.jit.utils", is_arch_support_pdl=_is_arch_support_pdl)
    _module("sglang.kernels.ops", s / "kernels" / "ops")
    _module("sglang.kernels.ops.lora", s / "kernels" / "ops" / "lora")
    _module("sglang.kernels.ops.lora.dense", s / "kernels" / "ops" / "lora" / "dense")
    _module("sglang.kernels.ops.lora.common", s / "kernels" / "ops" / "lora" / "common")
    _module("sglang.kernels.ops.lora.moe")
    _module("sglang.kernels.ops.lora.moe.virtual_experts", _align_block_size_jit=_align_block_size)
    return used


class Peers:
    """The peers' entry points, each group loaded on its own: a group that fails to load is
    recorded in `errors` and its paths are skipped."""

    def __init__(self, root: Path = PEERS_DIR):
        self.root = root
        self.errors: dict[str, str] = {}
        self.third_party: dict[str, str] = {}
        versions = root / "VERSIONS"
        self.versions = dict(line.split("==", 1) for line in versions.read_text().split()) if versions.is_file() else {}
        if not root.is_dir():
            for name in PEER_NAMES:
                self.errors[name] = f"{root} is missing: run bench/fetch_peers.sh"
            return
        install_vllm_shims(root)
        self.third_party = install_sglang_shims(root)
        self._try("vllm", self._load_vllm)
        self._try("sglang_triton", self._load_sglang_triton)
        self._try("sglang_csgmv", self._load_sglang_csgmv)
        self._try("sglang_v2", self._load_sglang_v2)

    def _try(self, name, load):
        try:
            load()
        except Exception as exc:  # one peer that will not load must not stop the others
            self.errors[name] = f"load: {exc!r}"[:500]

    def has(self, name: str) -> bool:
        return name not in self.errors

    def _load_vllm(self):
        d = self.root / "vllm" / "lora" / "ops" / "triton_ops"
        p = "vllm.lora.ops.triton_ops."
        _load(p + "kernel_utils", d / "kernel_utils.py")
        self.vllm_utils = _load(p + "utils", d / "utils.py")
        self.LoRAKernelMeta = _load(p + "lora_kernel_metadata", d / "lora_kernel_metadata.py").LoRAKernelMeta
        self.lora_shrink = _load(p + "lora_shrink_op", d / "lora_shrink_op.py")._lora_shrink
        self.lora_expand = _load(p + "lora_expand_op", d / "lora_expand_op.py")._lora_expand

    def _dense(self, name):
        return _load("sglang.kernels.ops.lora.dense." + name,
                     self.root / "sglang" / "kernels" / "ops" / "lora" / "dense" / f"{name}.py")

    def _load_sglang_triton(self):
        self._dense("kernel_utils")
        self.sgemm_lora_a = self._dense("sgemm_lora_a").sgemm_lora_a_fwd
        self.sgemm_lora_b = self._dense("sgemm_lora_b").sgemm_lora_b_fwd
        self.qkv_lora_b = self._dense("qkv_lora_b").qkv_lora_b_fwd
        self.gate_up_lora_b = self._dense("gate_up_lora_b").gate_up_lora_b_fwd

    def _load_sglang_csgmv(self):
        self._dense("lora_tuning_config")
        self.csgmv_shrink = self._dense("chunked_sgmv_shrink").chunked_sgmv_lora_shrink_forward
        self.csgmv_expand = self._dense("chunked_sgmv_expand").chunked_sgmv_lora_expand_forward

    def _load_sglang_v2(self):
        common = self.root / "sglang" / "kernels" / "ops" / "lora" / "common"
        for name in ("route_view", "routing", "lora_a", "lora_b"):
            _load(f"sglang.kernels.ops.lora.common.{name}", common / f"{name}.py")
        lora = self.root / "sglang" / "srt" / "lora"
        workspace = _load("sglang.srt.lora.workspace", lora / "workspace.py")
        self.v2_plan = _load("sglang.srt.lora.dense.plan", lora / "dense" / "plan.py")
        self.v2_runner = _load("sglang.srt.lora.dense.runner", lora / "dense" / "runner.py")

        class OneStreamWorkspace(workspace.LoraWorkspace):
            """SGLang keys its scratch (and cached routes) by the calling stream and expects
            warm-up on the stream it captures on; GraphTimer warms up on a side stream and
            captures on another, so here every stream shares one set of buffers."""

            @staticmethod
            def _caller(device):
                return 0

        class SideStreamWorkspace(OneStreamWorkspace):
            """For runner.apply's overlap (--layer): scratch and routes shared by every stream as
            above, but the side stream and its two events keyed by the calling stream, as
            LoraWorkspace.side_stream / .event key them. Its side stream is then never the
            stream it serves (side_stream's own check), the capturing one included: with one
            side stream for every caller, the stream pool could hand back the stream that
            later captures, and the overlap would silently be one stream."""

            def side_stream(self, device):
                return self._keyed_by_caller(workspace.LoraWorkspace.side_stream, device)

            def event(self, device, name):
                return self._keyed_by_caller(workspace.LoraWorkspace.event, device, name)

            def _keyed_by_caller(self, method, *args):
                self._caller = workspace.LoraWorkspace._caller  # shadows the override for this call
                try:
                    return method(self, *args)
                finally:
                    del self._caller

        self.V2Workspace = OneStreamWorkspace
        self.V2SideStreamWorkspace = SideStreamWorkspace


# --------------------------------------------------------------------------------------
# Paths: each converts the case's weights into the layout it wants (outside the timed
# region) and returns fn(y), which adds the LoRA term into y, and a note of what it runs.
# --------------------------------------------------------------------------------------

def folded_b(c) -> torch.Tensor:
    """B [S, out, r] with each slice's scaling multiplied in, rounded to the case's dtype."""
    b = c["lora_b"].float().clone()
    offset = 0
    for i, width in enumerate(c["slices"]):
        b[:, offset : offset + width] *= c["scaling"][:, i, None, None].float()
        offset += width
    return b.to(c["lora_b"].dtype).contiguous()


def slice_offsets(slices) -> list[int]:
    offsets = [0]
    for width in slices:
        offsets.append(offsets[-1] + width)
    return offsets


def ours_path(c, P=None, backend="auto"):
    S, slots = c["num_slots"], c["token_slots"]
    distinct = int(torch.unique(slots[slots >= 0]).numel())
    batch = LoRABatch.build(slots, S, max_adapters=max(distinct, 1))
    x, a, b, sc, slices = c["x"], c["lora_a"], c["lora_b"], c["scaling"], c["slices"]
    return (lambda y: add_lora(y, x, a, b, sc, batch, backend=backend, output_slices=slices)), {
        "block_m": batch.block_m, "blocks": batch.num_blocks}


def vllm_path(c, P):
    x, slots, S, r, slices = c["x"], c["token_slots"], c["num_slots"], c["rank"], c["slices"]
    T, n = x.shape[0], len(slices)
    # vLLM caches its stacked-pointer tables by data_ptr: a freed case's addresses may come back.
    P.vllm_utils._LORA_A_PTR_DICT.clear()
    P.vllm_utils._LORA_B_PTR_DICT.clear()
    a = tuple(c["lora_a"][:, i * r : (i + 1) * r].contiguous() for i in range(n))
    b_all, offsets = folded_b(c), slice_offsets(slices)
    b = tuple(b_all[:, offsets[i] : offsets[i + 1]].contiguous() for i in range(n))
    del b_all
    meta = P.LoRAKernelMeta.make(S, T, device=x.device)
    meta.prepare_tensors(slots)
    args = meta.meta_args(T, False)  # vLLM's default: specialize_active_lora=False

    def fn(y):
        buffer = torch.empty((n, T, r), dtype=torch.float32, device=x.device)  # as add_lora_linear
        P.lora_shrink(x, a, buffer, *args, 1.0)
        P.lora_expand(buffer, b, y, *args, offset_start=0, add_inputs=True)

    return fn, {"max_loras": S, "grid_loras": int(args[-1].item())}


def _sglang_inputs(c):
    """SGLang's pool: A [S', n*r, in] and B folded [S', out, r], a rank per slot; rows without
    an adapter use an extra slot of rank 0 (its convention for base-only requests)."""
    slots, S, r = c["token_slots"], c["num_slots"], c["rank"]
    dev = slots.device
    a, b = c["lora_a"].contiguous(), folded_b(c)
    ranks = torch.full((S,), r, dtype=torch.int32, device=dev)
    if bool((slots < 0).any()):
        a = torch.cat([a, torch.zeros_like(a[:1])])
        b = torch.cat([b, torch.zeros_like(b[:1])])
        ranks = torch.cat([ranks, torch.zeros(1, dtype=torch.int32, device=dev)])
        slots = torch.where(slots < 0, S, slots)
    scalings = torch.ones(ranks.numel(), dtype=torch.float32, device=dev)  # folded into B
    return a, b, ranks, scalings, slots.to(torch.int32)


def _sglang_segments(c, wi):
    """Requests (start, length) of the case: one row each at decode, the sequences at prefill."""
    T = wi.numel()
    if c["phase"] == "prefill":
        per_seq = T // c["seqs"]
        return [(s * per_seq, per_seq) for s in range(c["seqs"])]
    return [(t, 1) for t in range(T)]


def sglang_triton_path(c, P):
    x, slices, n = c["x"], c["slices"], len(c["slices"])
    a, b, ranks, scalings, wi = _sglang_inputs(c)
    dev, T, mlpb = x.device, x.shape[0], ranks.numel()
    if c["phase"] == "decode":
        # TritonLoRABackend._build_sgemm_routing: tokens sorted by adapter, one segment per slot.
        perm = torch.argsort(wi, stable=True).to(torch.int32)
        sorted_wi = wi[perm]
        ids = torch.arange(mlpb, dtype=torch.int32, device=dev)
        seg_lens = (torch.searchsorted(sorted_wi, ids, right=True) - torch.searchsorted(sorted_wi, ids)).to(torch.int32)
        indptr = torch.zeros(mlpb + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(seg_lens, 0)
        info = LoRABatchInfo(use_cuda_graph=False, bs=mlpb, num_segments=mlpb, seg_indptr=indptr, weight_indices=ids,
                             lora_ranks=ranks, scalings=scalings, max_len=T, seg_lens=seg_lens, permutation=perm)
    else:
        # prepare_lora_batch at extend: one segment per request, in token order.
        segs = _sglang_segments(c, wi)
        starts = torch.tensor([s for s, _ in segs], device=dev)
        seg_lens = torch.tensor([n_ for _, n_ in segs], dtype=torch.int32, device=dev)
        indptr = torch.zeros(len(segs) + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(seg_lens, 0)
        info = LoRABatchInfo(use_cuda_graph=False, bs=len(segs), num_segments=len(segs), seg_indptr=indptr,
                             weight_indices=wi[starts].contiguous(), lora_ranks=ranks, scalings=scalings,
                             max_len=max(n_ for _, n_ in segs), seg_lens=seg_lens, permutation=None)
    offsets = slice_offsets(slices)
    if n == 3:  # QKVParallelLinearWithLoRA -> run_qkv_lora
        out_offset = torch.tensor(offsets, dtype=torch.int32, device=dev)

        def fn(y):
            v = P.sgemm_lora_a(x, a, info, stack_num=3)
            P.qkv_lora_b(v, b, info, out_offset, max(slices), y, n_slices=3)
        kernels = "sgemm_lora_a + qkv_lora_b"
    elif n == 2:  # MergedColumnParallelLinearWithLoRA, equal halves -> run_gate_up_lora
        def fn(y):
            v = P.sgemm_lora_a(x, a, info, stack_num=2)
            P.gate_up_lora_b(v, b, info, slices[0], y)
        kernels = "sgemm_lora_a + gate_up_lora_b"
    else:  # RowParallelLinearWithLoRA -> run_lora_a_sgemm, run_lora_b_sgemm
        def fn(y):
            v = P.sgemm_lora_a(x, a, info)
            P.sgemm_lora_b(v, b, info, y)
        kernels = "sgemm_lora_a + sgemm_lora_b"
    return fn, {"kernels": kernels, "segments": info.num_segments, "max_len": info.max_len}


def csgmv_chunk(num_tokens: int, max_chunk: int) -> int:
    """ChunkedSgmvLoRABackend._determine_chunk_size_for_tokens."""
    if max_chunk <= 16:
        return 16
    return min(max_chunk, 128 if num_tokens >= 256 else 32 if num_tokens >= 64 else 16)


def sglang_csgmv_path(c, P, max_chunk=CSGMV_DEFAULT_CHUNK):
    x, slices, n = c["x"], c["slices"], len(c["slices"])
    a, b, ranks, scalings, wi = _sglang_inputs(c)
    dev, T = x.device, x.shape[0]
    chunk = csgmv_chunk(T, max_chunk)
    # _get_permutation / _get_segments_info: rows sorted by adapter (stable), cut in chunks.
    wi_host = wi.cpu()
    perm = torch.argsort(wi_host, stable=True)
    reordered = wi_host[perm]
    weights, counts = torch.unique_consecutive(reordered, return_counts=True)
    seg_w, seg_l = [], []
    for w, count in zip(weights.tolist(), counts.tolist()):
        k = (count + chunk - 1) // chunk
        seg_w += [w] * k
        seg_l += [chunk] * (k - 1) + [count - (k - 1) * chunk]
    indptr = torch.zeros(len(seg_l) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(seg_l, dtype=torch.int32), 0)
    segs = _sglang_segments(c, wi)
    info = LoRABatchInfo(use_cuda_graph=False, bs=len(segs), num_segments=len(seg_w), seg_indptr=indptr.to(dev),
                         weight_indices=torch.tensor(seg_w, dtype=torch.int32, device=dev), lora_ranks=ranks,
                         scalings=scalings, max_len=chunk, seg_lens=None, permutation=perm.to(torch.int32).to(dev))
    offsets = slice_offsets(slices)
    out_offset = torch.tensor(offsets, dtype=torch.int32, device=dev)
    out_offset_cpu = torch.tensor(offsets, dtype=torch.int32)
    max_slice = max(slices)

    def fn(y):
        v = P.csgmv_shrink(x, a, info, num_slices=n)
        P.csgmv_expand(v, b, info, out_offset, max_slice, y, slice_offsets_cpu=out_offset_cpu)

    return fn, {"chunk": chunk, "segments": len(seg_w)}


def v2_plan_note(plan) -> dict:
    return {"a": plan.a_family.value, "b": plan.b_family.value, "overlap": plan.overlap.value,
            "block_size": plan.block_size, "a_split_k": plan.a_tiles.get("SPLIT_K", 1),
            "a_split_mode": plan.a_tiles.get("SPLIT_MODE", "serial") if plan.a_tiles.get("SPLIT_K", 1) > 1 else None}


def _sglang_v2_runner(c, P, workspace, plan=None, architecture=None):
    """A DenseLoraRunner bound to the case's batch, its weights (B folded), the slice offsets
    and the plan (by default the one its table picks for a linear layer)."""
    slices, r = c["slices"], c["rank"]
    slots, S = c["token_slots"], c["num_slots"]
    dev, T = c["x"].device, c["x"].shape[0]
    a, b = c["lora_a"].contiguous(), folded_b(c)
    ranks = torch.full((S,), r, dtype=torch.int32, device=dev)
    scalings = torch.ones(S, dtype=torch.float32, device=dev)  # folded into B
    runner = P.v2_runner.DenseLoraRunner(workspace, max_loras=S, device=dev, architecture=architecture)
    phase = SGLangPhase.PREFILL if c["phase"] == "prefill" else SGLangPhase.DECODE
    runner.begin_batch(token_slots=slots.to(torch.int32), lora_ranks=ranks, scalings=scalings, num_tokens=T,
                       phase=phase, graph_mode=False)
    offsets = tuple(slice_offsets(slices))
    if plan is None:  # what TritonV2LoRABackend.forward_with_base asks for a linear layer
        plan = runner.plan_for(P.v2_plan.DenseLoraKind.LINEAR, b.shape[-1], a.shape[-1], offsets[-1], num_tokens=T)
    return runner, a, b, offsets, plan


def sglang_v2_path(c, P, plan=None, architecture=None):
    x, n = c["x"], len(c["slices"])
    runner, a, b, offsets, plan = _sglang_v2_runner(c, P, P.V2Workspace(), plan, architecture)

    def fn(y):
        bridge = runner.run_a(x, a, stack=n, plan=plan)
        runner.run_b(bridge, b, y, offsets=offsets, plan=plan, add_inplace=True)

    return fn, {"plan": v2_plan_note(plan), "architecture": runner.architecture}


PATHS = {
    "vllm": vllm_path,
    "sglang_triton": sglang_triton_path,
    "sglang_csgmv": sglang_csgmv_path,
    "sglang_v2": sglang_v2_path,
}


def peer_paths(c, P, wanted):
    """(name, builder) of every peer path to run on this case."""
    out = []
    for name in wanted:
        if not P.has(name):
            continue
        out.append((name, lambda c, P, f=PATHS[name]: f(c, P)))
        if name == "sglang_csgmv" and csgmv_chunk(c["x"].shape[0], CSGMV_MAX_CHUNK) != CSGMV_DEFAULT_CHUNK:
            out.append((f"sglang_csgmv_chunk{CSGMV_MAX_CHUNK}",
                        lambda c, P: sglang_csgmv_path(c, P, max_chunk=CSGMV_MAX_CHUNK)))
    return out


# --------------------------------------------------------------------------------------
# One case: reference, checks, timings.
# --------------------------------------------------------------------------------------

def reference(c, start: torch.Tensor | None = None) -> torch.Tensor:
    """float32 `start` (by default y) plus the LoRA term."""
    slots, S = c["token_slots"], c["num_slots"]
    groups = [(s, torch.nonzero(slots == s).flatten()) for s in range(S)]
    groups = [(s, rows) for s, rows in groups if rows.numel()]
    expected = c["y"].float() if start is None else start
    loop_per_adapter(expected, c["x"].float(), c["lora_a"].float(), c["lora_b"].float(), c["scaling"], groups,
                     c["slices"], c["rank"])
    return expected


def check_and_time(c, paths, P, timer, expected) -> dict:
    """paths: [(name, builder)]; each is built, checked, then timed (timer None: checks only)."""
    y0 = c["y"]
    row = {"errors": {}, "us": {}, "failures": {}, "notes": {}}
    for name, build in paths:
        try:
            fn, note = build(c, P)
            row["notes"][name] = note
            y = y0.clone()
            fn(y)
            if y.is_cuda:
                torch.cuda.synchronize()
            err = rel_error(y, y0, expected)
            row["errors"][name] = err
            if not err < TOLERANCE:
                row["failures"][name] = f"relative error {err:.3g} >= {TOLERANCE}"
                row["us"][name] = None
                continue
            if timer is not None:
                y = y0.clone()
                row["us"][name] = timer(lambda: fn(y))
                del y
        except Exception as exc:  # record and go on: one peer's refusal must not lose the case
            row["failures"][name] = repr(exc)[:500]
            row["us"][name] = None
        finally:
            fn = None  # noqa: F841  (drop the path's weight copies before the next one)
    return row


def summarize(row: dict) -> None:
    us = row["us"]
    peers = {k: v for k, v in us.items() if k not in ("ours", "base_gemm") and v}
    lora = {k: v for k, v in us.items() if k != "base_gemm" and v}
    if peers:
        best = min(peers, key=peers.get)
        row["best_peer"] = best
        row["best_peer_us"] = peers[best]
        if us.get("ours"):
            row["ours_over_best_peer"] = us["ours"] / peers[best]
    if lora:
        row["fastest"] = min(lora, key=lora.get)


def run_case(c, P, timer, bandwidth, wanted) -> dict:
    expected = reference(c)
    paths = [("ours", ours_path)] + peer_paths(c, P, wanted)
    row = check_and_time(c, paths, P, timer, expected)
    out = torch.empty_like(c["y"])
    x, w = c["x"], c["weight"]
    row["us"]["base_gemm"] = timer(lambda: torch.matmul(x, w.T, out=out))
    row["peer_load_errors"] = {k: v for k, v in P.errors.items() if k in wanted}
    summarize(row)
    nbytes = fewest_bytes(c)
    row["fewest_bytes"] = nbytes
    for key, name in (("ours", "ours"), ("best_peer", row.get("best_peer"))):
        if name and row["us"].get(name):
            row[f"{key}_bandwidth_fraction"] = nbytes / (row["us"][name] * 1e-6) / bandwidth
    return row


# --------------------------------------------------------------------------------------
# The layer measure (--layer): the whole decode layer y = x W^T + LoRA term per path.
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineRule:
    """What the engine runs a decode projection as (server/model.py, LlamaModel._linear and
    _uses_gemm): kernels.linear's lora_linear up to TRITON_GEMM_MAX_TOKENS rows where its
    triton_gemm is on (CUDA, a Triton backend, a device with PDL: model._overlaps), cuBLAS
    then add_lora above."""

    max_tokens: int
    source: str
    gemm_device: typing.Callable[[torch.device], bool]

    def runs_lora_linear(self, device: torch.device, num_tokens: int) -> bool:
        return self.gemm_device(device) and num_tokens <= self.max_tokens

    def meta(self) -> dict:
        return {"triton_gemm_max_tokens": self.max_tokens, "source": self.source}


def engine_rule(smoke: bool = False) -> EngineRule:
    """The rule read from server/model.py: imported (loraplex.server.model), or where that
    package will not import here, its constant read from the source and the device check
    restated (compute capability 9.0 and later). `smoke`: the GPU rule on the CPU (the
    interpreter runs lora_linear's three kernels one after the other)."""
    try:
        from loraplex.server.model import TRITON_GEMM_MAX_TOKENS as max_tokens, _overlaps as gemm_device
        source = "loraplex.server.model"
    except ImportError as exc:
        found = re.search(r"^TRITON_GEMM_MAX_TOKENS = (\d+)", (ROOT / "server" / "model.py").read_text(), re.M)
        if found is None:
            raise
        max_tokens = int(found.group(1))
        gemm_device = lambda d: d.type == "cuda" and torch.cuda.get_device_capability(d)[0] >= 9  # noqa: E731
        source = f"server/model.py read as text ({exc!r:.120})"
    if smoke:
        return EngineRule(max_tokens, source + "; smoke: as on a GPU with PDL", lambda d: True)
    return EngineRule(max_tokens, source, gemm_device)


def layer_reference(c) -> torch.Tensor:
    """The whole float32 output: x W^T plus the LoRA term."""
    return reference(c, start=c["x"].float() @ c["weight"].float().T)


# Layer paths: builders as above, returning fn(out), which writes the whole layer output into
# `out` (and returns it), and a note.

def ours_layer_path(c, P, rule: EngineRule, backend="auto"):
    """Exactly what the engine runs for this many rows: lora_linear (its GEMM configuration
    for the shape, as _linear leaves it to gemm_config) or cuBLAS then add_lora; output
    slices only for a fused projection, as _linear passes them."""
    x, w, a, b, sc, slices = c["x"], c["weight"], c["lora_a"], c["lora_b"], c["scaling"], c["slices"]
    S, slots, T = c["num_slots"], c["token_slots"], c["x"].shape[0]
    distinct = int(torch.unique(slots[slots >= 0]).numel())
    batch = LoRABatch.build(slots, S, max_adapters=max(distinct, 1))
    out_slices = slices if len(slices) > 1 else None
    if rule.runs_lora_linear(x.device, T):
        config = gemm_config(T, w)

        def fn(out):
            return lora_linear(x, w, a, b, sc, batch, output_slices=out_slices, out=out, config=config)

        return fn, {"runs": "lora_linear", "gemm_config": dataclasses.asdict(config)}

    def fn(out):
        torch.matmul(x, w.T, out=out)
        return add_lora(out, x, a, b, sc, batch, backend=backend, output_slices=out_slices)

    return fn, {"runs": "cublas then add_lora", "backend": backend}


def cublas_then(build):
    """A LoRA-term builder as a layer: torch.matmul (cuBLAS) into out, then the term added
    into it, one after the other on one stream."""

    def layer(c, P):
        term, note = build(c, P)
        x, w = c["x"], c["weight"]

        def fn(out):
            torch.matmul(x, w.T, out=out)
            term(out)
            return out

        return fn, {"runs": "cublas then the term", **note}

    return layer


V2_SCHEDULES = {  # runner.apply, per plan.overlap
    "a": "shrink (run_a) on the side stream beside the base GEMM; the caller waits for it, then runs the expand "
         "(run_b) into the base output",
    "ab_delta": "shrink and expand on the side stream into a zeroed delta beside the base GEMM; the caller waits, "
                "then adds the delta",
    "none": "the plan asks no overlap: base GEMM, shrink, expand on one stream (timed so)",
}


def sglang_v2_overlap_path(c, P, plan=None, architecture=None):
    """SGLang's triton_v2 layer as TritonV2LoRABackend.forward_with_base runs it: the plan its
    table picks for a linear layer, then DenseLoraRunner.apply with the base GEMM as
    base_fn (SGLang's is quant_method.apply, F.linear: cuBLAS; here torch.matmul into the
    output buffer, as the other layer paths). apply runs the plan's overlap through
    LoraWorkspace.run_parallel (side stream and events: SideStreamWorkspace); on the CPU
    run_parallel runs the side part, then the base, on one stream."""
    x, w = c["x"], c["weight"]
    ws = P.V2SideStreamWorkspace()
    runner, a, b, offsets, plan = _sglang_v2_runner(c, P, ws, plan, architecture)

    def fn(out):
        return runner.apply(x, lambda: torch.matmul(x, w.T, out=out), plan, a=a, b=b, offsets=offsets)

    def streams():  # after timing: the side streams apply used, one per calling stream
        pairs = [(caller, side.cuda_stream) for (_, caller), side in ws._streams.items()]
        return {"side_streams": len(pairs), "side_stream_never_its_caller": all(c != s for c, s in pairs) if pairs
                else None}

    schedule = V2_SCHEDULES[plan.overlap.value]
    if x.device.type != "cuda" and plan.overlap.value != "none":
        schedule += " (on the CPU run_parallel runs the side part, then the base GEMM, on one stream)"
    return fn, {"plan": v2_plan_note(plan), "architecture": runner.architecture, "overlap": plan.overlap.value,
                "schedule": schedule, "after_timing": streams}


def layer_paths(c, P, wanted, rule: EngineRule, backend="auto"):
    out = [("ours_layer", lambda c, P: ours_layer_path(c, P, rule, backend)),
           ("cublas_then_ours", cublas_then(lambda c, P: ours_path(c, P, backend=backend)))]
    out += [(f"cublas_then_{name}", cublas_then(build)) for name, build in peer_paths(c, P, wanted)]
    if P.has("sglang_v2") and "sglang_v2" in wanted:
        out.append(("sglang_v2_overlap", sglang_v2_overlap_path))
    return out


def event_timer(timer, fn) -> float:
    """Without a graph: launches timed by CUDA events, L2 flushed before each (the flush's own
    time lets the host queue the launches ahead of the start event), the median of at least
    100. Host launch cost can still show where the launches outlast the flush."""
    reps = max(timer.reps, 100)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        timer.clear_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return times[len(times) // 2]


def time_layer(timer, fn) -> tuple[float, str]:
    """CUDA-graph replays (GraphTimer, as every other number here); where capture fails, CUDA
    events over eager launches. Returns us and the timer used."""
    try:
        return timer(fn), "cuda_graph"
    except Exception as exc:  # noqa: BLE001  (recorded with the timer that replaced it)
        torch.cuda.synchronize()
        return event_timer(timer, fn), f"cuda_events (graph capture failed: {exc!r:.200})"


def check_and_time_layer(c, paths, P, timer, expected) -> dict:
    """Each layer path built, checked (relative error of the whole output against the float32
    x W^T + term, its output filled with NaN first), timed (timer None: checks only), and
    checked again on what the timed replays left in its output."""
    row = {"errors": {}, "layer_us": {}, "timers": {}, "errors_after_timing": {}, "failures": {}, "notes": {}}
    zero = torch.zeros_like(expected)
    for name, build in paths:
        fn = None
        try:
            fn, note = build(c, P)
            after = note.pop("after_timing", None)
            row["notes"][name] = note
            out = torch.full_like(c["y"], float("nan"))
            fn(out)
            if out.is_cuda:
                torch.cuda.synchronize()
            err = rel_error(out, zero, expected)
            row["errors"][name] = err
            if not err < TOLERANCE:
                row["failures"][name] = f"relative error {err:.3g} >= {TOLERANCE}"
                row["layer_us"][name] = None
                continue
            if timer is not None:
                out.fill_(float("nan"))
                row["layer_us"][name], row["timers"][name] = time_layer(timer, lambda: fn(out))
                err = rel_error(out, zero, expected)
                row["errors_after_timing"][name] = err
                if not err < TOLERANCE:
                    row["failures"][name] = f"after timing: relative error {err:.3g} >= {TOLERANCE}"
                    row["layer_us"][name] = None
            if after is not None:
                note.update(after())
        except Exception as exc:  # record and go on, as check_and_time does
            row["failures"][name] = repr(exc)[:500]
            row["layer_us"][name] = None
        finally:
            fn = None  # noqa: F841
    return row


OURS_LAYER = ("ours_layer", "cublas_then_ours")


def summarize_layer(row: dict) -> None:
    us = row["layer_us"]
    peers = {k: v for k, v in us.items() if k not in OURS_LAYER and v}
    timed = {k: v for k, v in us.items() if v}
    if peers:
        best = min(peers, key=peers.get)
        row["best_peer_layer"], row["best_peer_layer_us"] = best, peers[best]
        if us.get("ours_layer"):
            row["ours_layer_over_best_peer"] = us["ours_layer"] / peers[best]
    if timed:
        row["fastest_layer"] = min(timed, key=timed.get)
    base = row.get("base_gemm_us")
    if base:
        row["layer_over_base_gemm"] = {k: v / base for k, v in timed.items()}
    if us.get("sglang_v2_overlap") and us.get("cublas_then_sglang_v2"):
        row["sglang_v2_overlap_over_sequential"] = us["sglang_v2_overlap"] / us["cublas_then_sglang_v2"]


def run_layer_case(c, P, timer, wanted, rule: EngineRule) -> dict:
    row = check_and_time_layer(c, layer_paths(c, P, wanted, rule), P, timer, layer_reference(c))
    x, w, T = c["x"], c["weight"], c["x"].shape[0]
    out = torch.empty_like(c["y"])
    row["base_gemm_us"] = timer(lambda: torch.matmul(x, w.T, out=out))
    if row["notes"].get("ours_layer", {}).get("runs") == "lora_linear":  # its own GEMM alone, for scale
        config = gemm_config(T, w)
        try:
            row["ours_gemm_us"] = timer(lambda: gemm(x, w, out, config))
        except Exception as exc:  # noqa: BLE001
            row["ours_gemm_us"] = None
            row["failures"]["ours_gemm"] = repr(exc)[:500]
    row["peer_load_errors"] = {k: v for k, v in P.errors.items() if k in wanted}
    summarize_layer(row)
    return row


def in_layer_table(spec, args, rule: EngineRule) -> bool:
    """Decode cases, up to the rows where the engine runs lora_linear (--layer-tokens all: every
    decode token count)."""
    return spec["phase"] == "decode" and (args.layer_tokens == "all" or spec["tokens"] <= rule.max_tokens)


LAYER_SHORT = {"ours_layer": "ours", "cublas_then_ours": "cub+ours", "sglang_v2_overlap": "v2_ovl"}


def layer_short(name: str) -> str:
    return LAYER_SHORT.get(name) or short(name.removeprefix("cublas_then_"))


def print_layer_row(spec, row):
    fmt = lambda v: f"{v:6.1f}" if isinstance(v, (int, float)) else "     -"  # noqa: E731
    cols = " ".join(f"{layer_short(k)} {fmt(v)}" for k, v in row.get("layer_us", {}).items())
    ratio = row.get("ours_layer_over_best_peer")
    tail = f"ours/best {ratio:5.2f} ({layer_short(row['best_peer_layer'])})" if ratio else ""
    ovl = row.get("notes", {}).get("sglang_v2_overlap", {}).get("overlap")
    failed = ", ".join(f"{k}: {v[:80]}" for k, v in row.get("failures", {}).items())
    print(f"layer {spec['layer']:7s} T={spec['tokens']:3d} A={str(spec['adapters']):9s} r={spec['rank']:2d} | "
          f"base {fmt(row.get('base_gemm_us'))} | {cols} | {tail} v2 overlap {ovl} {row.get('failure', '')}"
          f"{' FAILED ' + failed if failed else ''}", flush=True)


def print_layer_summary(rows) -> dict:
    """The short table: per case the base GEMM, ours, the best peer layer, their ratio, and
    SGLang's overlapped layer over its sequential one."""
    num = lambda v, w=6, p=1: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else " " * (w - 1) + "-"  # noqa: E731
    print(f"{'layer':7s} {'T':>3s} {'A':>9s} {'r':>2s} | {'base':>6s} {'ours':>6s} {'ours runs':12s} | "
          f"{'best peer':>14s} {'us':>6s} | {'ours/best':>9s} | {'v2 ovl/seq':>10s}", flush=True)
    ratios = []
    for r in rows:
        us, q = r.get("layer_us", {}), r.get("ours_layer_over_best_peer")
        if q:
            ratios.append((q, r))
        runs = r.get("notes", {}).get("ours_layer", {}).get("runs", "-")[:12]
        print(f"{r['layer']:7s} {r['tokens']:3d} {str(r['adapters']):>9s} {r['rank']:2d} | "
              f"{num(r.get('base_gemm_us'))} {num(us.get('ours_layer'))} {runs:12s} | "
              f"{layer_short(r.get('best_peer_layer', '-')):>14s} {num(r.get('best_peer_layer_us'))} | "
              f"{num(q, 9, 2)} | {num(r.get('sglang_v2_overlap_over_sequential'), 10, 2)}", flush=True)
    summary = {"cases": len(rows), "compared": len(ratios), "ours_not_slower": sum(1 for q, _ in ratios if q <= 1.0),
               "failures": sum(len(r.get("failures", {})) + ("failure" in r) for r in rows)}
    if ratios:
        worst, w = max(ratios, key=lambda p: p[0])
        summary["worst_ratio"] = worst
        summary["worst_case"] = {k: w[k] for k in ("layer", "tokens", "adapters", "rank", "best_peer_layer")}
        summary["geomean_ratio"] = math.exp(sum(math.log(q) for q, _ in ratios) / len(ratios))
        best_counts = {}
        for _, r in ratios:
            best_counts[r["best_peer_layer"]] = best_counts.get(r["best_peer_layer"], 0) + 1
        summary["best_peer_counts"] = best_counts
    print(f"layer: ours <= best peer layer on {summary['ours_not_slower']}/{summary['compared']} cases"
          + (f"; worst ours/best {summary['worst_ratio']:.2f} at {summary['worst_case']}; geomean "
             f"{summary['geomean_ratio']:.2f}; best peer: {summary['best_peer_counts']}" if ratios else ""), flush=True)
    return summary


# --------------------------------------------------------------------------------------
# The table, the printout, the smoke run.
# --------------------------------------------------------------------------------------

def table(args) -> list[dict]:
    cases = []
    for layer in args.layers.split(","):
        for rank in map(int, args.ranks.split(",")):
            for t in DECODE_TOKENS:
                for adapters in DECODE_ADAPTERS:
                    if adapters == "per-token":
                        if t in DECODE_ADAPTERS or t == 1:  # one per token is then a count above
                            continue
                    elif adapters > t:
                        continue
                    cases.append(dict(layer=layer, phase="decode", tokens=t, adapters=adapters, rank=rank))
            for adapters in (1, 8):
                cases.append(dict(layer=layer, phase="prefill", tokens=PREFILL[0] * PREFILL[1], adapters=adapters,
                                  rank=rank))
    cases = [c for c in cases if c["phase"] in args.phases.split(",")]
    if args.quick:
        cases = [c for c in cases if c["tokens"] in (1, 64, PREFILL[0] * PREFILL[1])]
    return cases


def short(name: str) -> str:
    return {"sglang_triton": "sgl_tri", "sglang_csgmv": "sgl_csg", f"sglang_csgmv_chunk{CSGMV_MAX_CHUNK}": "sgl_c128",
            "sglang_v2": "sgl_v2", "base_gemm": "base"}.get(name, name)


def print_row(spec, row):
    fmt = lambda v: f"{v:7.1f}" if isinstance(v, (int, float)) else "      -"  # noqa: E731
    cols = " ".join(f"{short(k)} {fmt(v)}" for k, v in row.get("us", {}).items())
    ratio = row.get("ours_over_best_peer")
    tail = f"ours/best {ratio:5.2f} ({short(row['best_peer'])})" if ratio else ""
    failed = ", ".join(f"{k}: {v[:80]}" for k, v in row.get("failures", {}).items())
    print(f"{spec['layer']:7s} {spec['phase']:7s} T={spec['tokens']:4d} A={str(spec['adapters']):9s} "
          f"r={spec['rank']:2d} | {cols} | {tail} {row.get('failure', '')}{' FAILED ' + failed if failed else ''}",
          flush=True)


def print_summary(results) -> dict:
    ratios = [(r["ours_over_best_peer"], r) for r in results if r.get("ours_over_best_peer")]
    summary = {"cases": len(results), "compared": len(ratios),
               "ours_not_slower": sum(1 for q, _ in ratios if q <= 1.0),
               "peer_failures": sum(len(r.get("failures", {})) for r in results)}
    if ratios:
        worst, w = max(ratios, key=lambda p: p[0])
        summary["worst_ratio"] = worst
        summary["worst_case"] = {k: w[k] for k in ("layer", "phase", "tokens", "adapters", "rank")}
        summary["worst_case"]["best_peer"] = w["best_peer"]
        summary["geomean_ratio"] = math.exp(sum(math.log(q) for q, _ in ratios) / len(ratios))
        wins = {}
        for r in results:
            if r.get("fastest"):
                wins[r["fastest"]] = wins.get(r["fastest"], 0) + 1
        summary["fastest_counts"] = wins
    print(f"ours <= best peer on {summary['ours_not_slower']}/{summary['compared']} cases; "
          + (f"worst ours/best {summary['worst_ratio']:.2f} at {summary['worst_case']}; "
             f"geomean {summary['geomean_ratio']:.2f}; fastest: {summary['fastest_counts']}" if ratios else ""),
          flush=True)
    return summary


# Tiny stand-ins for the Llama-3-8B layers on the CPU: (in_features, output slices).
SMOKE_LAYERS = {"qkv": (64, (64, 32, 32)), "o": (64, (64,)), "gate_up": (64, (96, 96)), "down": (96, (64,))}


def make_smoke_case(layer, num_tokens, adapters, rank, seqs=None, base_rows=0, gen=None, dtype=torch.float16):
    """make_case's tensors at SMOKE_LAYERS sizes on the CPU; `base_rows` rows (at prefill, the
    last `base_rows` sequences) use no adapter."""
    in_features, slices = SMOKE_LAYERS[layer]
    out_features, n = sum(slices), len(slices)
    num_adapters = num_tokens if adapters == "per-token" else adapters
    if seqs:
        token_slots = torch.arange(num_tokens) // (num_tokens // seqs) % num_adapters
    else:
        token_slots = (torch.arange(num_tokens) % num_adapters)[torch.randperm(num_tokens, generator=gen)]
    if base_rows and seqs:  # at prefill a request has one adapter or none: whole sequences
        per_seq = num_tokens // seqs
        token_slots[num_tokens - base_rows * per_seq:] = -1
    elif base_rows:
        token_slots[torch.randperm(num_tokens, generator=gen)[:base_rows]] = -1
    return dict(
        x=torch.randn(num_tokens, in_features, generator=gen).to(dtype),
        y=torch.randn(num_tokens, out_features, generator=gen).to(dtype),
        lora_a=(torch.randn(num_adapters, n * rank, in_features, generator=gen) / math.sqrt(in_features)).to(dtype),
        lora_b=(torch.randn(num_adapters, out_features, rank, generator=gen) / math.sqrt(rank)).to(dtype),
        scaling=torch.rand(num_adapters, n, generator=gen) + 0.5,
        weight=(torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)).to(dtype),
        token_slots=token_slots.to(torch.int32), slices=slices, num_adapters=num_adapters, num_slots=num_adapters,
        rank=rank)


def _cpu_slice_geometry(P):
    """lora_b.slice_geometry without its CUDA-only checks (the table lives on the CPU)."""
    lora_b = sys.modules["sglang.kernels.ops.lora.common.lora_b"]

    def geometry(offsets, block_size_n, device, out_offsets=None):
        rows, columns = lora_b._geometry_inputs(offsets, block_size_n, out_offsets)
        widths = [hi - lo for lo, hi in zip(rows, rows[1:])]
        uniform = widths[0] if len(set(widths)) == 1 else 0
        stride = columns[1] if len(columns) > 1 else uniform
        regular = stride > 0 and all(col == s * stride for s, col in enumerate(columns))
        head = -(-len(rows) // 4) * 4
        t = torch.tensor(list(rows) + [0] * (head - len(rows)) + list(columns), dtype=torch.int32, device=device)
        return lora_b.SliceGeometry(slice_offsets=t[: len(rows)], out_offsets=t[head:], num_slices=len(widths),
                                    num_column_tiles=sum(triton.cdiv(w, block_size_n) for w in widths),
                                    uniform_width=uniform, out_stride=stride if regular else 0,
                                    full_tiles=all(w % block_size_n == 0 for w in widths), block_size_n=block_size_n)

    P.v2_runner.slice_geometry = geometry


def _interpreter_bool_masks() -> None:
    """Triton's interpreter (3.9) types `bool_vector & (python_int < scalar)` as int64 and
    then refuses it as a load mask (SGLang's per-row expand builds its rank mask so; the
    compiler types it int1). Here a mask of any integer type is read as `!= 0`."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype != bool:
            mask = interpreter.TensorHandle(mask.data != 0, tl.int1)
        return mask

    builder.create_masked_load = lambda self, p, mask, *a: load(self, p, as_bool(mask), *a)
    builder.create_masked_store = lambda self, p, v, mask, *a: store(self, p, v, as_bool(mask), *a)
    builder._bool_masks = True


def _forced_v2_plans(P) -> dict:
    """One plan per family pairing and split mode the plan tables use."""
    DensePlan, AF, BF = P.v2_plan.DensePlan, P.v2_plan.AFamily, P.v2_plan.BFamily
    a = {"BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
    b = {"BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 8, "num_warps": 4, "num_stages": 2}
    return {
        "grouped": DensePlan(a_tiles=a, b_tiles=b),
        "grouped_splitk_serial": DensePlan(a_tiles={**a, "SPLIT_K": 2}, b_tiles=b),
        "grouped_splitk_planes": DensePlan(a_tiles={**a, "SPLIT_K": 2, "SPLIT_MODE": "planes"}, b_tiles=b),
        "grouped_a_per_row_b": DensePlan(b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "per_row": DensePlan(a_family=AF.PER_ROW, b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "all_slots": DensePlan(a_family=AF.ALL_SLOTS, b_family=BF.PER_ROW, a_tiles=a, b_tiles=b),
        "grouped_block32": DensePlan(block_size=32, a_tiles=a, b_tiles=b),
    }


def check_plan_shim(P) -> dict:
    """Where pydantic is installed, plan.py parses its tables with it; the GPU machine may lack
    it and take the shim. Loads a second plan.py on the shim and compares the plan each
    resolves for every case of the table (both architectures)."""
    if P.third_party.get("pydantic") != "installed" or not P.has("sglang_v2"):
        return {"checked": False}
    real = sys.modules["pydantic"]
    sys.modules["pydantic"] = _pydantic_shim()
    try:
        shim_plan = _load("sglang.srt.lora.dense.plan_on_shim", P.root / "sglang/srt/lora/dense/plan.py")
    finally:
        sys.modules["pydantic"] = real
    compared = 0
    for arch in ("sm90", "sm100", "default"):
        for rank in (8, 16, 32, 64, 128):
            tables = [m.DensePlanTable(arch, rank) for m in (P.v2_plan, shim_plan)]
            for layer, (k, slices) in LAYERS.items():
                for phase in (SGLangPhase.DECODE, SGLangPhase.PREFILL):
                    for t in (1, 2, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192):
                        got = [v2_plan_note(tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)))
                               | {"tiles": (tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)).a_tiles,
                                            tb.plan_for(m.DenseLoraKind.LINEAR, phase, t, k, sum(slices)).b_tiles)}
                               for tb, m in zip(tables, (P.v2_plan, shim_plan))]
                        if got[0] != got[1]:
                            raise AssertionError(f"plan shim differs at {arch} r={rank} {layer} {phase} T={t}: {got}")
                        compared += 1
    return {"checked": True, "plans_compared": compared}


def smoke_layer(c, P, wanted, rule, forced) -> dict:
    """The --layer paths on one smoke case, checked (whole output), none timed; SGLang's
    overlap path on the sm90 table (its decode plans ask "a"), and on a forced plan with each
    of the three overlaps so every branch of runner.apply runs (on the CPU run_parallel runs
    the side part, then the base)."""
    paths = layer_paths(c, P, wanted, rule, backend="triton")
    if P.has("sglang_v2") and "sglang_v2" in wanted:
        paths.append(("sglang_v2_overlap[sm90 table]",
                      lambda c, P: sglang_v2_overlap_path(c, P, architecture="sm90")))
        overlap = P.v2_plan.Overlap
        for mode in (overlap.A, overlap.AB_DELTA, overlap.NONE):
            plan = dataclasses.replace(forced["grouped"], overlap=mode)
            paths.append((f"sglang_v2_overlap[grouped, {mode.value}]",
                          lambda c, P, plan=plan: sglang_v2_overlap_path(c, P, plan=plan)))
    return check_and_time_layer(c, paths, P, None, layer_reference(c))


def smoke(args) -> int:
    """Every path on small decode and prefill cases on the CPU (Triton's interpreter, float16),
    each checked against the float32 reference; nothing timed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    P = Peers()
    if P.has("sglang_v2"):
        _cpu_slice_geometry(P)
    _interpreter_bool_masks()
    gen = torch.Generator().manual_seed(0)
    wanted = [p for p in args.peers.split(",") if p]
    specs = [  # with_layer: the --layer paths too, on the same case
        dict(layer="qkv", phase="decode", tokens=8, adapters=3, base_rows=2, with_layer=True),
        dict(layer="o", phase="decode", tokens=5, adapters="per-token", with_layer=True),
        dict(layer="gate_up", phase="decode", tokens=6, adapters=2, base_rows=1),
        dict(layer="down", phase="decode", tokens=1, adapters=1, with_layer=True),
        dict(layer="qkv", phase="prefill", tokens=512, adapters=2, seqs=2),
        dict(layer="gate_up", phase="prefill", tokens=64, adapters=1, seqs=2),
        dict(layer="down", phase="prefill", tokens=96, adapters=2, seqs=3, base_rows=1),
    ]
    forced = _forced_v2_plans(P) if P.has("sglang_v2") and "sglang_v2" in wanted else {}
    rule = engine_rule(smoke=True)
    results, layer_results, bad = [], [], 0
    started = time.time()
    for spec in specs:
        spec = {"rank": 16, **spec}
        c = make_smoke_case(spec["layer"], spec["tokens"], spec["adapters"], spec["rank"], seqs=spec.get("seqs"),
                            base_rows=spec.get("base_rows", 0), gen=gen)
        c["phase"], c["seqs"] = spec["phase"], spec.get("seqs")
        paths = [("ours", lambda c, P: ours_path(c, P, backend="triton"))] + peer_paths(c, P, wanted)
        if P.has("sglang_v2") and "sglang_v2" in wanted and (spec["phase"] == "decode" or spec["layer"] == "qkv"):
            paths.append(("sglang_v2[sm90 table]", lambda c, P: sglang_v2_path(c, P, architecture="sm90")))
        if spec["layer"] in ("qkv", "gate_up") and spec["phase"] == "decode":
            for pname, plan in forced.items():
                paths.append((f"sglang_v2[{pname}]", lambda c, P, plan=plan: sglang_v2_path(c, P, plan=plan)))
        t0 = time.time()
        row = check_and_time(c, paths, P, None, reference(c))
        row.update(spec)
        results.append(row)
        bad += len(row["failures"])
        errs = " ".join(f"{short(k)} {v:.1e}" for k, v in row["errors"].items())
        print(f"{spec['layer']:7s} {spec['phase']:7s} T={spec['tokens']:3d} A={str(spec['adapters']):9s} "
              f"base rows {spec.get('base_rows', 0)} | {errs} | {time.time() - t0:.0f}s", flush=True)
        for k, v in row["failures"].items():
            print(f"    FAILED {k}: {v}", flush=True)
        if spec.get("with_layer"):
            t0 = time.time()
            lrow = smoke_layer(c, P, wanted, rule, forced)
            lrow.update(spec)
            layer_results.append(lrow)
            bad += len(lrow["failures"])
            errs = " ".join(f"{layer_short(k)} {v:.1e}" for k, v in lrow["errors"].items())
            ovl = {k: n.get("overlap") for k, n in lrow["notes"].items() if "overlap" in n}
            print(f"  layer: {errs} | overlap {ovl} | {time.time() - t0:.0f}s", flush=True)
            for k, v in lrow["failures"].items():
                print(f"    FAILED {k}: {v}", flush=True)
    missing = [p for p in wanted if not P.has(p)]
    for p in missing:
        print(f"peer {p} not loaded: {P.errors[p]}", flush=True)
    shim = check_plan_shim(P)
    print(f"plan-table shim check: {shim}", flush=True)
    out = {"meta": {"mode": "smoke", "device": "cpu (TRITON_INTERPRET)", "dtype": "float16", "peers": P.versions,
                    "third_party": P.third_party, "plan_shim_check": shim, "layer_engine_rule": rule.meta(),
                    "seconds": time.time() - started}, "results": results, "layer_results": layer_results}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, default=str))
    term_checks = sum(len(r["errors"]) for r in results)
    layer_checks = sum(len(r["errors"]) for r in layer_results)
    print(f"smoke: {term_checks + layer_checks} checks ({term_checks} LoRA term, {layer_checks} layer), {bad} failed, "
          f"{len(missing)} peers not loaded ({time.time() - started:.0f}s)", flush=True)
    return 1 if bad or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="JSON file to write (required on the GPU)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="1, 64 and 4096 tokens only")
    parser.add_argument("--ranks", default="16", help="ranks to run (default 16)")
    parser.add_argument("--phases", default="decode,prefill", help="decode, prefill or both (default both)")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--peers", default=",".join(PEER_NAMES), help="peer paths to run (default all)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the --smoke run")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, Triton's interpreter, small shapes: check every path, time none")
    parser.add_argument("--layer", action="store_true",
                        help="also time the whole decode layer (base GEMM + LoRA term) per path, SGLang's "
                             "triton_v2 with its side-stream overlap too: JSON key layer_results")
    parser.add_argument("--layer-tokens", default="engine", choices=("engine", "all"),
                        help="--layer cases: decode up to the rows where the engine runs lora_linear "
                             "(server/model.py's TRITON_GEMM_MAX_TOKENS, the default) or every decode case")
    parser.add_argument("--layer-only", action="store_true", help="with --layer: skip the LoRA-term table")
    args = parser.parse_args(argv)
    if args.layer_only:
        args.layer = True
    logging.basicConfig(level=logging.WARNING)
    if args.smoke or args.device == "cpu":
        return smoke(args)
    if args.out is None:
        parser.error("--out is required")

    P = Peers()
    for name, err in P.errors.items():
        print(f"peer {name} not loaded: {err}", flush=True)
    wanted = [p for p in args.peers.split(",") if p]
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth()
    timer = GraphTimer(args.reps)
    meta = timing_meta(args.reps, copy_bandwidth_bytes_per_s=bandwidth, dtype="torch.bfloat16", peers=P.versions,
                       peer_load_errors=P.errors, third_party=P.third_party, tolerance=TOLERANCE,
                       conventions="peers' B carries each slice's scaling (bf16), their scale is 1; weight copies "
                                   "and routing built outside the timed region; vLLM default grid (max_loras+1); "
                                   "csgmv chunk 16 (SGLang's default) and its 128 cap where that differs; "
                                   "triton_v2 as run_a + run_b with its table's plan (no side-stream overlap; --layer "
                                   "times that overlap in its layer)")
    meta["launch_floor"] = launch_floor(timer)
    rule = engine_rule()
    if args.layer:
        meta["layer"] = {
            "engine_rule": rule.meta(), "tokens": args.layer_tokens, "lora_term_table": not args.layer_only,
            "conventions": "whole output y = x W^T + term into a preallocated buffer, checked against float32 "
                           "(relative error of the whole output) before and after timing; base GEMM torch.matmul "
                           "(cuBLAS); ours_layer as the engine runs the rows (lora_linear up to the rule's rows, "
                           "cuBLAS then add_lora above); cublas_then_<path>: cuBLAS then that LoRA-term path, one "
                           "stream; sglang_v2_overlap: DenseLoraRunner.apply with its table's plan (side stream "
                           "per plan.overlap, captured in the same CUDA graph through its events); timer per path "
                           "in 'timers'"}
    print(f"peers {P.versions}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; launch floor {meta['launch_floor']}"
          + (f"; engine rule {rule.meta()}" if args.layer else ""), flush=True)

    results, layer_results = [], []

    def write():
        payload = {"meta": meta, "results": results}
        if args.layer:
            payload["layer_results"] = layer_results
        args.out.write_text(json.dumps(payload, indent=1, default=str))

    started = time.time()
    for spec in table(args):
        layer_case = args.layer and in_layer_table(spec, args, rule)
        if args.layer_only and not layer_case:
            continue
        c = None
        try:
            seqs = PREFILL[0] if spec["phase"] == "prefill" else None
            c = make_case(spec["layer"], spec["tokens"], spec["adapters"], spec["rank"], seqs=seqs, gen=gen)
            c["phase"], c["seqs"] = spec["phase"], seqs
            if not args.layer_only:
                row = {**spec, **run_case(c, P, timer, bandwidth, wanted)}
        except Exception as exc:  # record and carry on: one broken case must not lose the run
            row = {**spec, "failure": repr(exc)[:500]}
        if not args.layer_only:
            results.append(row)
            print_row(spec, row)
        if layer_case:
            try:
                if c is None:
                    raise RuntimeError(row.get("failure", "the case was not built"))
                lrow = {**spec, **run_layer_case(c, P, timer, wanted, rule)}
            except Exception as exc:  # noqa: BLE001
                lrow = {**spec, "failure": repr(exc)[:500]}
            layer_results.append(lrow)
            print_layer_row(spec, lrow)
        del c
        write()
    meta["seconds"] = time.time() - started
    if not args.layer_only:
        meta["summary"] = print_summary(results)
    if args.layer:
        meta["layer_summary"] = print_layer_summary(layer_results)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
