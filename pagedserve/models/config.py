"""ModelConfig: the facts about a decoder checkpoint that the model and the engine need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kv.sizes import kv_bytes_per_token

# model_type -> the transformers class our decoder reproduces. SmolLM2 is model_type "llama".
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def check_architecture(model_type: str | None, architectures: list[str] | None = None) -> None:
    """Raise ValueError naming the supported architectures unless model_type is one of them."""
    if model_type in SUPPORTED_ARCHITECTURES:
        return
    name = architectures[0] if architectures else model_type
    supported = ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED_ARCHITECTURES.items())
    raise ValueError(f"unsupported architecture {name!r} (model_type {model_type!r}); pagedserve supports {supported}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                    # e.g. "LlamaForCausalLM"
    model_type: str                      # e.g. "llama"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(hash=False)  # llama3 parameters; None: plain RoPE
    attention_bias: bool                 # bias on the q/k/v projections
    qk_norm: bool                        # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False     # bias on o_proj (Llama, Qwen3: same flag as q/k/v; Qwen2: none)
    mlp_bias: bool = False
    # One entry per layer: its sliding-window size, or None for full attention. Empty: all full.
    sliding_windows: tuple[int | None, ...] = ()
    # gpt-oss: every attention layer has a learned sink logit per query head (`self_attn.sinks`)
    attention_sinks: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """Bytes of K and V one token occupies across all layers (of `kv_heads` heads: one
        tensor-parallel rank's; default all of them)."""
        return kv_bytes_per_token(self.num_layers, kv_heads or self.num_kv_heads, self.head_dim, dtype.itemsize)

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        """Read a transformers PretrainedConfig; raise ValueError for what our decoder cannot run."""
        model_type = getattr(hf, "model_type", None)
        check_architecture(model_type, getattr(hf, "architectures", None))
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}: the gated MLP here implements silu only")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_theta, rope_scaling = _rope(hf)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

        # Per-architecture differences that transformers hard-codes rather than configures.
        if model_type == "qwen2":
            qkv_bias, out_bias = True, False
        elif model_type == "mistral":
            qkv_bias = out_bias = False
        else:
            qkv_bias = out_bias = bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None)
        if window is None:
            windows = ()
        elif layer_types:  # Qwen2/3: only "sliding_attention" layers use the window
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # Mistral: every layer
            windows = (window,) * hf.num_hidden_layers

        return cls(
            architecture=SUPPORTED_ARCHITECTURES[model_type],
            model_type=model_type,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            sliding_windows=windows,
        )


def _rope(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, llama3 scaling or None) from transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    else:
        params = getattr(hf, "rope_scaling", None) or {}
        theta = getattr(hf, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return float(theta), None
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}")
    original = params.get("original_max_position_embeddings", hf.max_position_embeddings)
    return float(theta), {
        "rope_type": "llama3",
        **{k: float(params[k]) for k in _LLAMA3_KEYS},
        "original_max_position_embeddings": int(original),
    }
