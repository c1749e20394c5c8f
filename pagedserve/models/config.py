"""ModelConfig: the facts about a decoder checkpoint that the model and the engine need."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.kv.groups import KVLayout
from pagedserve.kv.sizes import kv_bytes_per_token

# model_type -> the transformers class our decoder reproduces. SmolLM2 is model_type "llama";
# "gemma3" is Gemma 3's multimodal checkpoint, of which the decoder runs the text part.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",           # Phi-3 and Phi-4
    "smollm3": "SmolLM3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # transformers' names (ACT2FN)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_PARTIAL_ROTARY_ARCHS = ("phi3",)  # whose transformers attention rotates only the first rotary_dim dims


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
    rope_scaling: dict[str, Any] | None = field(hash=False)  # a scaled RoPE's parameters (_rope); None: plain
    attention_bias: bool                 # bias on the q/k/v projections
    qk_norm: bool                        # Qwen3: RMSNorm over each head of q and k before RoPE
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_out_bias: bool = False     # bias on o_proj (Llama, Qwen3: same flag as q/k/v; Qwen2: none)
    mlp_bias: bool = False
    # One entry per layer: its sliding-window size, or None for full attention. Empty: all full.
    sliding_windows: tuple[int | None, ...] = ()
    rotary_dim: int | None = None        # the leading dims of each head that RoPE rotates; None: all of them
    # One entry per layer: whether it applies RoPE (SmolLM3's NoPE layers do not). Empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # gpt-oss: every attention layer has a learned sink logit per query head (`self_attn.sinks`)
    attention_sinks: bool = False
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
    # What Gemma 4 adds. Per layer (empty: every layer head_dim, num_kv_heads, its own K/V, intermediate_size):
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()     # the layer whose K/V it attends over: itself, or a KV-shared layer's source
    k_eq_v_layers: tuple[bool, ...] = ()  # V is K's projection (before k_norm): no v_proj
    layer_intermediate_sizes: tuple[int, ...] = ()
    value_norm: bool = False             # V is RMS-normalised (no weight) per head
    norm_scale_float32: bool = False     # RMSNorm scales by weight in float32, then rounds (Gemma 4)
    per_layer_input_size: int = 0        # per-layer embeddings (PLE) of this width; 0: none
    per_layer_vocab_size: int = 0
    layer_scalar: bool = False           # each layer's output is multiplied by a learned scalar

    def __post_init__(self):
        for heads in self.layer_kv_heads or (self.num_kv_heads,):
            if self.num_heads % heads:
                raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({heads})")
        for name in ("sliding_windows", "rope_layers", "layer_head_dims", "layer_kv_heads", "kv_sources",
                     "k_eq_v_layers", "layer_intermediate_sizes"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_layers} layers")

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache this layer reads (itself unless it is a KV-shared layer)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def num_cache_layers(self) -> int:
        """Layers that hold a KV cache: all but the KV-shared ones, which come last (Gemma 4)."""
        return sum(self.kv_source(i) == i for i in range(self.num_layers))

    @property
    def mixed_kv_shapes(self) -> bool:
        """Whether the cache layers' pages differ in size (Gemma 4's full and sliding layers)."""
        return len({(self.layer_num_kv_heads(i), self.layer_head_dim(i)) for i in range(self.num_cache_layers)}) > 1

    def kv_layout(self, uniform: bool = False) -> KVLayout:
        """The cache layers' KV cache groups (kv/groups.py). uniform: one full-attention group of
        every cache layer, windows only masked (the layout of an engine without groups, for
        comparison). Layers whose pages differ in size get that uniform layout too: groups share
        one pool of equal-size pages, which such layers cannot make (kv/groups.py)."""
        if uniform or not self.sliding_windows or self.mixed_kv_shapes:
            return KVLayout.uniform(self.num_cache_layers)
        return KVLayout.of([self.layer_window(i) for i in range(self.num_cache_layers)])

    def kv_buffer_shapes(self, kv_heads: int | None = None, uniform: bool = False) -> list[tuple[int, int]]:
        """(KV heads, head dim) of each layer buffer a block spans (one per `layers_per_block`
        slot): the cache layers' own where their shapes differ (then the layout is uniform and
        slot j is layer j), else each slot `kv_heads` (one rank's; default all) x head_dim."""
        if self.mixed_kv_shapes:
            return [(self.layer_num_kv_heads(i), self.layer_head_dim(i)) for i in range(self.num_cache_layers)]
        per = self.kv_layout(uniform).layers_per_block
        return [(kv_heads or self.layer_num_kv_heads(0), self.layer_head_dim(0))] * per

    def kv_bytes_per_block_token(self, dtype: torch.dtype, kv_heads: int | None = None, uniform: bool = False) -> int:
        """Bytes one token slot of a block takes: K and V in each layer buffer a block spans
        (`KVLayout.layers_per_block`; all cache layers for a model of one kind of layer)."""
        return sum(kv_bytes_per_token(1, h, d, dtype.itemsize) for h, d in self.kv_buffer_shapes(kv_heads, uniform))

    def layer_uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else True

    def layer_uses_sliding_rope(self, layer: int) -> bool:
        """Whether this layer rotates by sliding_rope_theta / sliding_rope_scaling."""
        return self.sliding_rope_theta is not None and self.layer_window(layer) is not None

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """Bytes of K and V one token occupies across all cache layers (of `kv_heads` heads: one
        tensor-parallel rank's; default all of them)."""
        if self.mixed_kv_shapes:
            return self.kv_bytes_per_block_token(dtype)
        return kv_bytes_per_token(self.num_cache_layers, kv_heads or self.num_kv_heads, self.layer_head_dim(0),
                                  dtype.itemsize)

    @classmethod
    def from_hf_config(cls, hf: Any) -> ModelConfig:
        """Read a transformers PretrainedConfig; raise ValueError for what our decoder cannot run."""
        model_type = getattr(hf, "model_type", None)
        check_architecture(model_type, getattr(hf, "architectures", None))
        # A multimodal checkpoint nests its language model's config; the rest (vision) is not read.
        text = hf.get_text_config() if model_type == "gemma3" else hf
        gemma4 = model_type == "gemma4_text"
        gemma = model_type in ("gemma3", "gemma3_text") or gemma4
        act = (getattr(text, "hidden_activation", None) if gemma else None) or getattr(text, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}: the gated MLP here implements "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        num_heads = text.num_attention_heads
        # Gemma 4's head size and KV heads are per layer (config.per_layer_config); these are layer 0's.
        layer0 = text.per_layer_config[0] if gemma4 else text
        head_dim = getattr(layer0, "head_dim", None) or text.hidden_size // num_heads
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
        if model_type == "smollm3":
            window = _smollm3_window(text, window, layer_types)
        if window is None:
            windows = ()
        elif layer_types:  # Qwen2/3, SmolLM3, Gemma 3: only "sliding_attention" layers use the window
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # Mistral, Phi-3: every layer
            windows = (window,) * text.num_hidden_layers
        # SmolLM3: no_rope_layers[i] is 1 where layer i applies RoPE, 0 where it is a NoPE layer.
        rope_layers = tuple(bool(u) for u in text.no_rope_layers) if model_type == "smollm3" else ()

        gemma_fields = (_gemma4_fields(text, windows) if gemma4 else _gemma3_fields(text, model_type, windows)
                        if gemma else {})
        rope_theta, rope_scaling, rotary_fraction = gemma_fields.pop("rope") if gemma else _rope(text)
        rotary_dim = _rotary_dim(model_type, head_dim, rotary_fraction)
        frequencies = (rotary_dim or head_dim) // 2
        for key in ("short_factor", "long_factor") if rope_scaling and rope_scaling["rope_type"] == "longrope" else ():
            if len(rope_scaling[key]) != frequencies:
                raise ValueError(f"longrope's {key} has {len(rope_scaling[key])} entries, not one per rotary "
                                 f"frequency ({frequencies})")

        return cls(
            architecture=SUPPORTED_ARCHITECTURES[model_type],
            model_type=model_type,
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(layer0, "num_key_value_heads", None) or num_heads,
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
            rotary_dim=rotary_dim,
            rope_layers=() if all(rope_layers) else rope_layers,
            hidden_act=act,
            **gemma_fields,
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    return () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _gemma3_fields(text: Any, model_type: str, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """What Gemma 3 (transformers' modeling_gemma3.py) sets apart from the Llama decoder, and its
    two RoPEs ("rope": the full-attention layers', as _rope gives it); ValueError for the variants
    we cannot run."""
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
    if sliding[2] != full[2]:
        raise ValueError("Gemma 3 rope_parameters with a partial_rotary_factor per layer type are not supported")
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


def _gemma4_fields(text: Any, windows: tuple[int | None, ...]) -> dict[str, Any]:
    """What Gemma 4's text model (transformers' modeling_gemma4.py) sets apart from Gemma 3's:
    plain-weight norms scaled in float32, attention scale 1, a normalised V, per-layer-type head
    size and KV heads, K = V on full layers (attention_k_eq_v), KV-shared last layers, per-layer
    embeddings, a scalar per layer, proportional RoPE on the full layers. ValueError for what we
    cannot run."""
    if getattr(text, "enable_moe_block", False):
        raise ValueError("Gemma 4 with enable_moe_block (a mixture-of-experts block beside the MLP) is not supported")
    if getattr(text, "use_bidirectional_attention", None):
        raise ValueError("use_bidirectional_attention is not supported: the decoder attends causally")
    n = text.num_hidden_layers
    per_layer = text.per_layer_config
    sharing = text.kv_sharing_modes
    first_shared = n - text.num_kv_shared_layers
    # A shared layer reads the last cache layer of its type before the shared ones (transformers'
    # "store" layer of that type).
    sources = []
    for i in range(n):
        if sharing[i] != "reuse":
            sources.append(i)
            continue
        same = [j for j in range(first_shared) if text.layer_types[j] == text.layer_types[i]]
        if not same:
            raise ValueError(f"Gemma 4 layer {i} shares the K/V of a {text.layer_types[i]} layer, but none holds a cache")
        sources.append(same[-1])
    if any(sources[i] != i for i in range(first_shared)) or first_shared < 1:
        raise ValueError("Gemma 4 configs whose every layer is KV-shared are not supported")
    vocab_ple = int(getattr(text, "vocab_size_per_layer_input", 0) or 0)
    ple = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
    if ple and vocab_ple < text.vocab_size:
        raise ValueError(f"vocab_size_per_layer_input ({vocab_ple}) below vocab_size ({text.vocab_size}) is not "
                         "supported: some tokens would have no per-layer embedding")
    params = text.rope_parameters
    full = _rope(text, params["full_attention"])
    sliding = _rope(text, params["sliding_attention"]) if "sliding_attention" in params else full
    for kind, rope in (("full_attention", full), ("sliding_attention", sliding)):
        if rope[2] != 1.0:
            raise ValueError(f"Gemma 4 {kind} RoPE with partial_rotary_factor={rope[2]} outside proportional "
                             "RoPE is not supported")
    full_layers = [i for i in range(n) if windows[i] is None]
    sliding_layers = [i for i in range(n) if windows[i] is not None]
    dims = tuple(per_layer[i].head_dim for i in range(n))
    for group in (full_layers, sliding_layers):
        if len({dims[i] for i in group}) > 1:
            raise ValueError("Gemma 4 layers of one type with different head sizes are not supported")
    double = bool(getattr(text, "use_double_wide_mlp", False))
    return {
        "sandwich_norms": True,
        "norm_scale_float32": True,
        "value_norm": True,
        "embed_scale": text.hidden_size**0.5,
        "attention_scale": 1.0,
        "final_logit_softcapping": getattr(text, "final_logit_softcapping", None),
        "rope": full,
        "sliding_rope_theta": None if sliding == full else sliding[0],
        "sliding_rope_scaling": None if sliding == full else sliding[1],
        "layer_head_dims": dims,
        "layer_kv_heads": tuple(per_layer[i].num_key_value_heads for i in range(n)),
        "kv_sources": tuple(sources),
        "k_eq_v_layers": tuple(bool(text.attention_k_eq_v) and windows[i] is None for i in range(n)),
        "layer_intermediate_sizes": tuple(text.intermediate_size * (2 if double and sources[i] != i else 1)
                                          for i in range(n)),
        "per_layer_input_size": ple,
        "per_layer_vocab_size": vocab_ple if ple else 0,
        "layer_scalar": True,
    }


def _smollm3_window(hf: Any, window: int | None, layer_types: list[str] | None) -> int | None:
    """SmolLM3's window, used on its "sliding_attention" layers only when use_sliding_window is
    set. Its layer_types may name sliding layers without it, and then transformers' eager and
    SDPA attention apply the window (through the mask) but flash attention does not: refused."""
    if getattr(hf, "use_sliding_window", False):
        return window
    if window is not None and "sliding_attention" in (layer_types or ()):
        raise ValueError("a SmolLM3 config whose layer_types name sliding_attention layers but whose "
                         "use_sliding_window is false is ambiguous (transformers' attention backends disagree)")
    return None


def _rotary_dim(model_type: str, head_dim: int, fraction: float) -> int | None:
    """The rotated dims of each head for a partial_rotary_factor (None: the whole head), as
    transformers truncates it: int(head_dim * factor)."""
    if fraction == 1.0:
        return None
    if model_type not in _PARTIAL_ROTARY_ARCHS:  # transformers ignores it there, or fails
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={fraction}) are supported for "
                         f"{', '.join(_PARTIAL_ROTARY_ARCHS)} only, not {model_type}")
    dim = int(head_dim * fraction)
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor={fraction} of head_dim {head_dim} rotates {dim} dims; "
                         "pagedserve needs a positive even number")
    return dim


def _rope(hf: Any, params: dict[str, Any] | None = None) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, the scaled RoPE's parameters or None, partial_rotary_factor) from transformers 5
    `rope_parameters` or the older `rope_theta` + `rope_scaling` pair; given `params`, from those
    (one layer type's entry of a per-type `rope_parameters`, Gemma 3's). The parameters are those
    transformers' modeling_rope_utils reads, with its defaults filled in (a yarn or longrope
    attention factor computed), so that models/layers.py needs nothing else."""
    if params is not None:
        theta = params["rope_theta"]
    elif getattr(hf, "rope_parameters", None):
        params = hf.rope_parameters
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    else:
        params = getattr(hf, "rope_scaling", None) or {}
        theta = getattr(hf, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    fraction = float(params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0)
    if rope_type == "proportional":  # rotates the whole head, its frequencies past the fraction zero
        return float(theta), {"rope_type": rope_type, "partial_rotary_factor": fraction,
                              "factor": float(params.get("factor", 1.0))}, 1.0
    if rope_type == "default":
        return float(theta), None, fraction
    max_len = hf.max_position_embeddings
    # Phi-3 keeps the pretraining length beside rope_parameters; transformers prefers it there.
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf, "original_max_position_embeddings", None) or max_len)
    factor = params.get("factor")
    if rope_type in ("linear", "dynamic", "llama3") and factor is None:
        raise ValueError(f"{rope_type} rope scaling lacks its factor")
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            raise ValueError(f"llama3 rope scaling lacks {missing}")
        scaling = {k: float(params[k]) for k in _LLAMA3_KEYS} | {"original_max_position_embeddings": original}
    elif rope_type == "linear":
        scaling = {"factor": float(factor)}
    elif rope_type == "dynamic":  # its frequencies for sequences up to max_position_embeddings
        scaling = {"factor": float(factor), "max_position_embeddings": int(max_len)}
    elif rope_type == "yarn":
        scaling = _yarn(params, original, max_len)
    else:
        scaling = _longrope(params, original, max_len)
    return float(theta), {"rope_type": rope_type, **scaling}, fraction


def _yarn(params: dict[str, Any], original: int, max_len: int) -> dict[str, Any]:
    """YaRN's parameters with transformers' defaults: factor max_len / original, beta_fast 32,
    beta_slow 1, truncate True, and the attention factor (which scales cos and sin) from
    mscale / mscale_all_dim or from the factor."""
    if "factor" not in params:
        raise ValueError("yarn rope scaling lacks its factor")
    factor = params["factor"]
    factor = float(max_len / original if factor is None else factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {"factor": factor, "original_max_position_embeddings": original, "attention_factor": float(attention),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True))}


def _longrope(params: dict[str, Any], original: int, max_len: int) -> dict[str, Any]:
    """LongRoPE's per-frequency short and long factors and its attention factor (transformers'
    default: sqrt(1 + ln(factor) / ln(original)), factor max_len / original unless given)."""
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    if missing:
        raise ValueError(f"longrope rope scaling lacks {missing}")
    factor = params.get("factor")
    factor = max_len / original if factor is None else factor
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"short_factor": [float(f) for f in params["short_factor"]],
            "long_factor": [float(f) for f in params["long_factor"]],
            "original_max_position_embeddings": original, "attention_factor": float(attention)}
