"""ModelConfig: the facts about a decoder checkpoint that the model and the engine need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kv.sizes import kv_bytes_per_token

# model_type -> the transformers class our decoder reproduces. SmolLM2 is model_type "llama";
# "gemma3" is Gemma 3's multimodal checkpoint, of which the decoder runs the text part.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # transformers' names (ACT2FN)
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
    # What Gemma 3 changes; the defaults are Llama's.
    hidden_act: str = "silu"             # the gated MLP's activation, one of SUPPORTED_ACTIVATIONS
    norm_unit_offset: bool = False       # every RMSNorm scales by (1 + weight), in float32
    sandwich_norms: bool = False         # norms on the attention and MLP outputs, and one before the MLP
    embed_scale: float | None = None     # the embeddings are multiplied by it (rounded to the model dtype)
    attention_scale: float | None = None  # of q.k before the softmax; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # The sliding-window layers' own RoPE (Gemma 3's local base); None: rope_theta / rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def layer_uses_sliding_rope(self, layer: int) -> bool:
        """Whether this layer rotates by sliding_rope_theta / sliding_rope_scaling."""
        return self.sliding_rope_theta is not None and self.layer_window(layer) is not None

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """Bytes of K and V one token occupies across all layers (of `kv_heads` heads: one
        tensor-parallel rank's; default all of them)."""
        return kv_bytes_per_token(self.num_layers, kv_heads or self.num_kv_heads, self.head_dim, dtype.itemsize)

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        """Read a transformers PretrainedConfig; raise ValueError for what our decoder cannot run."""
        model_type = getattr(hf, "model_type", None)
        check_architecture(model_type, getattr(hf, "architectures", None))
        # A multimodal checkpoint nests its language model's config; the rest (vision) is not read.
        text = hf.get_text_config() if model_type == "gemma3" else hf
        gemma = model_type in ("gemma3", "gemma3_text")
        act = (getattr(text, "hidden_activation", None) if gemma else None) or getattr(text, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}: the gated MLP here implements "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        eos_ids = _token_ids(getattr(text, "eos_token_id", None)) + (
            _token_ids(getattr(hf, "eos_token_id", None)) if text is not hf else ())
        bos = getattr(text, "bos_token_id", None)

        # Per-architecture differences that transformers hard-codes rather than configures.
        if model_type == "qwen2":
            qkv_bias, out_bias = True, False
        elif model_type == "mistral":
            qkv_bias = out_bias = False
        else:
            qkv_bias = out_bias = bool(getattr(text, "attention_bias", False))
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if window is None:
            windows = ()
        elif layer_types:  # Qwen2/3, Gemma 3: only "sliding_attention" layers use the window
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # Mistral: every layer
            windows = (window,) * text.num_hidden_layers
        gemma_fields = _gemma3_fields(text, model_type, windows) if gemma else {}
        rope_theta, rope_scaling = gemma_fields.pop("rope") if gemma else _rope(text)

        return cls(
            architecture=SUPPORTED_ARCHITECTURES[model_type],
            model_type=model_type,
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=float(text.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            attention_out_bias=out_bias,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=model_type == "qwen3" or gemma,
            # The outer config's: transformers ties a multimodal model's head by it.
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=bos if bos is not None else getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            sliding_windows=windows,
            hidden_act=act,
            **gemma_fields,
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _gemma3_fields(text: Any, model_type: str, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """What Gemma 3 (transformers' modeling_gemma3.py) sets apart from the Llama decoder, and its
    two RoPEs ("rope": the full-attention layers'); ValueError for the variants we cannot run."""
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported: the attention kernels do not soft-cap "
                         f"the attention logits (this config sets {text.attn_logit_softcapping})")
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention is not supported: the decoder attends causally")
    if not windows:
        raise ValueError("a Gemma 3 config without sliding_window is not supported")
    params = text.rope_parameters
    full = _rope(text, params["full_attention"])
    sliding = _rope(text, params["sliding_attention"]) if "sliding_attention" in params else full
    return {
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": text.hidden_size**0.5,
        "attention_scale": float(text.query_pre_attn_scalar) ** -0.5,
        # Only the text-only class soft-caps: transformers' Gemma3ForConditionalGeneration does not.
        "final_logit_softcapping": (getattr(text, "final_logit_softcapping", None)
                                    if model_type == "gemma3_text" else None),
        "rope": full,
        "sliding_rope_theta": None if sliding == full else sliding[0],
        "sliding_rope_scaling": None if sliding == full else sliding[1],
    }


def _rope(hf: Any, params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from `params` (one layer type's entry of transformers 5's
    `rope_parameters`), else from the config's `rope_parameters` or the older `rope_theta` +
    `rope_scaling` pair. Scaling: llama3's parameters or linear's factor."""
    if params is None:
        params = getattr(hf, "rope_parameters", None)
        if params:
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        else:
            params = getattr(hf, "rope_scaling", None) or {}
            theta = getattr(hf, "rope_theta", 10000.0)
    else:
        theta = params["rope_theta"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), {"rope_type": "linear", "factor": float(params["factor"])}
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}")
    original = params.get("original_max_position_embeddings", hf.max_position_embeddings)
    return float(theta), {
        "rope_type": "llama3",
        **{k: float(params[k]) for k in _LLAMA3_KEYS},
        "original_max_position_embeddings": int(original),
    }
