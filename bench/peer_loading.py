"""How bench/peer_kernels.py loads the peers' Triton LoRA op files (vLLM's, SGLang's), which
`bench/fetch_peers.sh` extracts from their wheels into `.peers/`: by file path, with shim
modules in `sys.modules` for the few names they import from the rest of their packages (no
peer file is edited). `Peers` holds each group's entry points, or why it failed to load.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import logging
import os
import sys
import types
import typing
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("LORAPLEX_PEERS", ROOT / ".peers"))
PEER_NAMES = ("vllm", "sglang_triton", "sglang_csgmv", "sglang_v2")
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
