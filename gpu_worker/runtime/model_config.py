"""The decoder's shape, parsed from a Hugging Face checkpoint's config.json (plain Python, no torch).

Accepts the Llama, Qwen2, Qwen3 (dense), Mistral and Phi-3 families, in both config layouts
transformers writes:
the older top-level `rope_theta` + `rope_scaling`, and the newer `rope_parameters` that carries
`rope_theta` inside it. Everything the runtime cannot honour is refused here, with the key named,
so a checkpoint never loads into a model that silently computes something else.

What differs between the families, as flags the model reads (never the family name):
Qwen2 has a bias on q/k/v; Qwen3 normalises each query and key head (RMSNorm over head_dim)
before RoPE; Phi-3 stores q/k/v and gate/up fused in the checkpoint and may rotate only part
of each head (`partial_rotary_factor`). Sliding window: honoured for Mistral and Phi-3 (every
layer attends to the last `sliding_window` positions, as transformers does); Qwen2's and
Qwen3's `use_sliding_window: true` is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
             "phi3": "phi3"}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3",
}
_WINDOWED = ("mistral", "phi3")  # families whose every layer honours `sliding_window`
# Keys each RoPE type needs beyond `rope_type` (see gpu_worker/runtime/model.py for the formulas).
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder checkpoint; built by `from_dir`, validated when built."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalised: always has "rope_type"; None means plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (always on for Qwen2)
    sliding_window: int | None  # Mistral, Phi-3: attend to the last N positions only
    torch_dtype: str | None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every query and key head, before RoPE
    fused_projections: bool = False  # Phi-3: checkpoint holds qkv_proj and gate_up_proj
    rotary_dim: int | None = None  # leading dims of a head that RoPE rotates; None: head_dim

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("config.json: rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"config.json: sliding_window must be positive, got {self.sliding_window}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"config.json: partial_rotary_factor gives {self.rotary_dim} "
                             f"rotary dims, which must be even and in (0, {self.head_dim}]")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parse `model_dir/config.json`.

        Raises ValueError naming the file or key when the file is missing or unreadable, a
        required key is absent or has the wrong type, or the checkpoint uses something this
        runtime does not implement (another architecture, named; activation, RoPE type, MLP
        bias, Qwen2/Qwen3 sliding window).
        """
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: not found (a Hugging Face checkpoint directory needs it)") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from an already parsed config.json dict; same errors as `from_dir`."""
        family = _family(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias true is not supported")
        if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
            raise ValueError(f"config.json: use_sliding_window true is not supported for {family}")
        hidden = _req(raw, "hidden_size", int)
        heads = _req(raw, "num_attention_heads", int)
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError("config.json: head_dim is absent and hidden_size is not a "
                                 "multiple of num_attention_heads")
            head_dim = hidden // heads
        rope_theta, rope_scaling, partial = _rope(raw)
        window = raw.get("sliding_window") if family in _WINDOWED else None
        return cls(
            family=family,
            vocab_size=_req(raw, "vocab_size", int),
            hidden_size=hidden,
            num_layers=_req(raw, "num_hidden_layers", int),
            num_heads=heads,
            num_kv_heads=_opt(raw, "num_key_value_heads", int, heads),
            head_dim=_checked("head_dim", head_dim, int),
            intermediate_size=_req(raw, "intermediate_size", int),
            rms_norm_eps=float(_opt(raw, "rms_norm_eps", (int, float), 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_opt(raw, "max_position_embeddings", int, 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=None if window is None else _checked("sliding_window", window, int),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            qk_norm=family == "qwen3",
            fused_projections=family == "phi3",
            rotary_dim=int(_checked("head_dim", head_dim, int) * partial),
        )

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError unless attention heads, KV heads and the MLP split evenly over
        `tp_size` ranks. The vocabulary need not divide: its shards are padded."""
        if tp_size < 1:
            raise ValueError(f"tp size must be >= 1, got {tp_size}")
        for name, value in (("num_attention_heads", self.num_heads),
                            ("num_key_value_heads", self.num_kv_heads),
                            ("intermediate_size", self.intermediate_size)):
            if value % tp_size:
                raise ValueError(f"config.json: {name} ({value}) is not divisible by tp size {tp_size}")


def _family(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    architectures = raw.get("architectures") or ()
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    named = f"architecture {', '.join(map(str, architectures))} (model_type {model_type!r})" \
        if architectures else f"model_type {model_type!r}"
    raise ValueError(f"config.json: {named} is not supported (supported architectures: "
                     f"{', '.join(sorted(_ARCHITECTURES))})")


def _rope(raw: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(rope_theta, normalised scaling dict or None, partial_rotary_factor) from either
    config layout."""
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if not params:
        params, key = raw.get("rope_scaling"), "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"config.json: {key} must be an object")
    params = dict(params or {})
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    theta = float(_checked("rope_theta", theta, (int, float)))
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = raw.get("partial_rotary_factor", 1.0)
    partial = float(_checked("partial_rotary_factor", partial, (int, float)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None, partial
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings",
                                  raw.get("max_position_embeddings", 2048)))
    _check_rope_scaling(params)
    return theta, params, partial


def _check_rope_scaling(params: dict) -> None:
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config.json: rope_scaling.rope_type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    for key in ROPE_TYPES[rope_type]:
        if not isinstance(params.get(key), (int, float)) or isinstance(params.get(key), bool):
            raise ValueError(f"config.json: rope_scaling.{key} is required for rope_type "
                             f"{rope_type!r} and must be a number")
    if rope_type != "default" and params["factor"] <= 0:
        raise ValueError("config.json: rope_scaling.factor must be positive")


def _checked(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"config.json: {key} has the wrong type ({type(value).__name__})")
    return value


def _req(raw: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in raw:
        raise ValueError(f"config.json: required key {key} is missing")
    return _checked(key, raw[key], kind)


def _opt(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = raw.get(key)
    return default if value is None else _checked(key, value, kind)
