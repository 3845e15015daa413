"""ModelConfig: the shape of a Llama-family base, read from an HF config.json or named.

Covers Llama 2/3 (incl. Llama-3.1 "llama3", "linear" and "dynamic" rope scaling), Mistral and Qwen2 (q/k/v biases)
shapes: grouped-query attention, RoPE, RMSNorm, SwiGLU, tied or untied embeddings.
Imports no torch, so the node agent and operator could read a base's shape too.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# transformers' defaults (LlamaConfig, MistralConfig, Qwen2Config) for the values of the
# shape a config.json may leave out: they are what transformers runs such a config with.
_HF_DEFAULTS = {
    "llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "mistral": {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
}


class ModelConfigError(ValueError):
    """A config.json that describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Only the "llama3" type is supported besides plain RoPE, e.g.
    # {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    #  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    # Llama's attention_bias=true biases o_proj too (Qwen2's q/k/v biases leave it without).
    o_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """{projection: (in_features, out_features)} for the seven LoRA-capable linears."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size), "k_proj": (h, self.kv_size), "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    def num_params(self) -> int:
        per_layer = sum(a * b for a, b in self.module_shapes().values()) + 2 * self.hidden_size
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.o_bias:
            per_layer += self.hidden_size
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
        cfg = _HF_DEFAULTS[model_type] | cfg
        # A checkpoint of another head (LlamaForSequenceClassification's score.weight, a bare
        # LlamaModel) has no LM head to sample from.
        others = [a for a in cfg.get("architectures") or () if not str(a).endswith("ForCausalLM")]
        if others:
            raise ModelConfigError(
                f"architectures {cfg['architectures']} is not supported: a causal LM (*ForCausalLM) only")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise ModelConfigError(f"quantized checkpoints ({method!r}) are not supported: "
                                   "a float32, float16 or bfloat16 checkpoint only")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        if cfg.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if not isinstance(cfg.get(k), int)]
        if missing:
            raise ModelConfigError(f"config has no (integer) {', '.join(missing)}")
        heads = cfg["num_attention_heads"]
        # transformers >= 5 nests theta and scaling in rope_parameters; older configs use
        # rope_theta + rope_scaling at the top level.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            scaling = rope
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                scaling = None
            elif kind in ("linear", "dynamic"):
                factor = scaling.get("factor")
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
                    raise ModelConfigError(f"{kind} rope scaling needs a factor >= 1, got {factor!r}")
                scaling = {"rope_type": kind, "factor": float(factor)}
            elif kind != "llama3":
                raise ModelConfigError(f"rope scaling type {kind!r} is not supported (llama3, linear and dynamic are)")
            else:
                keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                # transformers' standardize_rope_params: a top-level original_max_position_embeddings
                # first, then the scaling's own, then max_position_embeddings.
                original = (cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                            or cfg.get("max_position_embeddings"))
                scaling = scaling | {"original_max_position_embeddings": original}
                missing = [k for k in keys if scaling.get(k) is None]
                if missing:
                    raise ModelConfigError(f"llama3 rope scaling {scaling} has no {', '.join(missing)}")
                scaling = {k: scaling[k] for k in keys} | {"rope_type": "llama3"}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_pos = cfg.get("max_position_embeddings", 4096)
        if model_type == "mistral" and cfg.get("sliding_window") and cfg["sliding_window"] < max_pos:
            # Full attention equals sliding-window attention up to the window's length.
            log.warning("mistral sliding_window %d: served as full attention, the context is capped at %d "
                        "tokens (max_position_embeddings %d)", cfg["sliding_window"], cfg["sliding_window"], max_pos)
            max_pos = cfg["sliding_window"]
        if model_type == "qwen2" and cfg.get("use_sliding_window"):
            raise ModelConfigError("qwen2 use_sliding_window=true is not supported")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelConfigError(f"{path}: no config.json")
        cfg = _read_json(cfg_file)
        gen = path / "generation_config.json"
        if gen.is_file():
            # generation_config's eos list (Llama 3 instruct: [128001, 128008, 128009]) wins.
            g = _read_json(gen)
            if g.get("eos_token_id") is not None:
                cfg = cfg | {"eos_token_id": g["eos_token_id"]}
        try:
            return cls.from_hf(cfg)
        except ModelConfigError as e:
            raise ModelConfigError(f"{cfg_file}: {e}") from None

    def to_hf(self) -> dict:
        """An HF config.json dict (transformers' LlamaConfig / Qwen2Config keys)."""
        out = {
            "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias or self.o_bias
        if self.model_type == "mistral":
            out["sliding_window"] = None  # served as full attention (MistralConfig's default is 4096)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path}: unreadable: {e}") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path}: not a JSON object")
    return value


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Named shapes for --dummy-weights (benchmarks) and the demo.
DUMMY_SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=2048,
        bos_token_id=1, eos_token_ids=(2,)),
    "small": ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8,
        num_heads=16, num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=4096,
        bos_token_id=1, eos_token_ids=(2,)),
    "llama-3-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING, max_position_embeddings=131072,
        bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama-2-7b": ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "mistral-7b": ModelConfig(
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,)),
    "qwen2-7b": ModelConfig(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, qkv_bias=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643)),
}


def named_shape(name: str) -> ModelConfig:
    try:
        return DUMMY_SHAPES[name]
    except KeyError:
        raise ModelConfigError(
            f"unknown dummy shape {name!r}; known: {sorted(DUMMY_SHAPES)}") from None
