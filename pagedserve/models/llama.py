"""Decoder-only transformer covering Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2, Qwen3 and
SmolLM2, over a flat batch of tokens whose K/V are read and written only through paged caches.

Module names mirror transformers' (model.layers.N.self_attn...), except that q/k/v and gate/up
are fused into one matmul each; `checkpoint_targets` maps checkpoint names onto those fusions.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.kv_quant import calibrated_scale
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.config import ModelConfig
from pagedserve.models.layers import GatedMLP, Linear, OneDNNWeight, RMSNorm, RotaryEmbedding, apply_rotary, linear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.sliding_window = config.layer_window(layer)
        self.scale = self.head_dim**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, md: AttentionMetadata) -> Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if md.calculate_kv_scales:
            kv_cache.scales.copy_(torch.stack([calibrated_scale(k), calibrated_scale(v)]))
        # The engine's backend, which built md (a per-engine choice: engines may share this model).
        out = md.backend.forward(q, k, v, kv_cache.k, kv_cache.v, md, self.scale, self.sliding_window, kv_cache.scales)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: KVCache,
                md: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two, in
        the next layer's (or the final) norm, which fuses the add. residual=None: x is the first
        layer's input."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        # Tied models have no lm_head at all: the logits reuse the embedding matrix.
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.head_onednn = OneDNNWeight()

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> DecoderForCausalLM:
        """Allocate without initialising weights (the loader overwrites every one of them)."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device=device).to(dtype)
        model.model.rotary_emb.build(device)  # a buffer, not a weight: compute it for real
        return model

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[KVCache], attn_metadata: AttentionMetadata
    ) -> Tensor:
        """input_ids, positions: [num_tokens]; kv_caches: one KVCache per layer.
        Returns the final hidden states [num_tokens, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # gathered once, shared by all layers
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight, None, self.head_onednn)

    def checkpoint_targets(self) -> dict[str, tuple[nn.Parameter, int, int]]:
        """Each checkpoint tensor name -> (our parameter, first row, number of rows) it fills."""
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {
            "qkv_proj": (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)),
            "gate_up_proj": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
        }
        targets = {}
        for name, param in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            if module not in fused:
                targets[name] = (param, 0, param.shape[0])
                continue
            start = 0
            for part, rows in fused[module]:
                targets[f"{parent}.{part}.{leaf}"] = (param, start, rows)
                start += rows
        return targets
