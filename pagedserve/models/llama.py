"""Decoder-only transformer covering Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2, Qwen3,
SmolLM2, SmolLM3 (NoPE layers), Phi-3 / Phi-4 (partial rotary, LongRoPE) and Gemma 3's text model,
over a flat batch of tokens whose K/V are read and written only through paged caches. The config
picks the parts: the norm's form, Gemma's extra norms around attention and MLP, the activation, the
embedding scale, the attention scale, a RoPE per layer type and the final logit soft-capping.

Module names mirror transformers' (model.layers.N.self_attn...), except that q/k/v and gate/up
are fused into one matmul each; `checkpoint_targets` maps checkpoint names onto those fusions.
Checkpoints that store them fused already (Phi-3's qkv_proj, gate_up_proj) are first cut into
their parts by `split_fused_tensors`.
Built with a tensor-parallel group of N ranks, the model holds rank r's share (models/sharding.py)
and `checkpoint_targets` says which slice of each checkpoint tensor that is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.attention.kv_cache import KVCache
from pagedserve.attention.kv_quant import calibrated_scale
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.group import TPGroup
from pagedserve.models.config import ModelConfig
from pagedserve.models.layers import (GatedMLP, Linear, PackedWeight, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                      VocabParallelEmbedding, apply_rotary, linear, rms_norm_unscaled)
from pagedserve.models.sharding import TPShard


class Target(NamedTuple):
    """Where a checkpoint tensor goes: rows [start, start + rows) of `param` take the checkpoint
    tensor's slice that starts at `source_start` along `source_dim` (as long as the rows are along
    that dimension). The whole checkpoint tensor is `source_len` long there and shaped like the
    rows elsewhere."""

    param: nn.Parameter
    start: int
    rows: int
    source_dim: int
    source_start: int
    source_len: int

    def expected_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint tensor must have."""
        shape = list(self.param.shape)
        shape[0] = self.rows
        shape[self.source_dim] = self.source_len
        return tuple(shape)


def split_fused_tensors(config: ModelConfig, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs with each fused qkv_proj or gate_up_proj tensor (as
    Phi-3 stores them: rows q | k | v, gate | up) given as its parts under the names
    `checkpoint_targets` knows, each a view of its rows; a safetensors slice stays unread until
    the part (or this rank's share of it) is indexed."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    parts = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
             "gate_up_proj": (("gate_proj", inter), ("up_proj", inter))}
    for name, tensor in tensors:
        module_path, _, leaf = name.rpartition(".")
        parent, _, module = module_path.rpartition(".")
        if module not in parts:
            yield name, tensor
            continue
        rows = tuple(tensor.shape if hasattr(tensor, "shape") else tensor.get_shape())[0]
        if rows != sum(n for _, n in parts[module]):
            raise ValueError(f"checkpoint tensor {name!r} has {rows} rows, but the config implies "
                             f"{' + '.join(f'{n} ({part})' for part, n in parts[module])}")
        start = 0
        for part, n in parts[module]:
            piece = tensor.narrow(0, start, n) if hasattr(tensor, "narrow") else _LazyRows(tensor, start, n)
            yield f"{parent}.{part}.{leaf}", piece
            start += n


class _LazyRows:
    """Rows [start, start + rows) of a safetensors slice, shaped and indexed like one: indexing
    it reads only the rows (and columns) indexed."""

    def __init__(self, source: Any, start: int, rows: int) -> None:
        self.source, self.start, self.rows = source, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.source.get_shape()[1:]]

    def __getitem__(self, index: Any) -> Tensor:
        index = index if isinstance(index, tuple) else (index,)
        first, last, step = (index[0] if index else slice(None)).indices(self.rows)
        if step != 1:
            raise IndexError("only a contiguous range of a checkpoint tensor's rows is read")
        return self.source[(slice(self.start + first, self.start + last), *index[1:])]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: TPShard, tp: TPGroup):
        super().__init__()
        self.head_dim = config.layer_head_dim(layer)
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads if not config.layer_kv_heads else config.layer_num_kv_heads(layer)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Gemma 4: a KV-shared layer projects only q (it reads its source layer's cache); with
        # K = V the projection is q | k.
        self.kv_shared = config.kv_source(layer) != layer
        self.k_eq_v = bool(config.k_eq_v_layers) and config.k_eq_v_layers[layer]
        self.kv_parts = () if self.kv_shared else ("k_proj",) if self.k_eq_v else ("k_proj", "v_proj")
        self.qkv_proj = Linear(config.hidden_size, self.q_size + len(self.kv_parts) * self.kv_size,
                               bias=config.attention_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, config.attention_out_bias, tp)
        norm = lambda: RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_unit_offset,  # noqa: E731
                               config.norm_scale_float32)
        if config.qk_norm:
            self.q_norm = norm()
            if not self.kv_shared:
                self.k_norm = norm()
        self.value_norm_eps = config.rms_norm_eps if config.value_norm else None
        self.qk_norm = config.qk_norm
        self.use_rope = config.layer_uses_rope(layer)
        self.sliding_window = config.layer_window(layer)
        self.scale = self.head_dim**-0.5 if config.attention_scale is None else config.attention_scale
        # One sink logit per query head of this rank, kept float32 in any model dtype (`empty`): the
        # attention backends read float32 sinks.
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32)) if config.attention_sinks else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache, md: AttentionMetadata) -> Tensor:
        q, *kv = self.qkv_proj(x).split([self.q_size] + [self.kv_size] * len(self.kv_parts), dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm.heads(q)
        if self.use_rope:
            q = apply_rotary(q, cos, sin)
        if self.kv_shared:  # the source layer stored this step's K/V; this one only reads them
            out = md.backend.forward(q, None, None, kv_cache.k, kv_cache.v, md, self.scale, self.sliding_window,
                                     kv_cache.scales, sinks=self.sinks)
            return self.o_proj(out.flatten(1))
        k = kv[0].view(-1, self.num_kv_heads, self.head_dim)
        v = k if self.k_eq_v else kv[1].view(-1, self.num_kv_heads, self.head_dim)
        if self.value_norm_eps is not None:  # first: k's norm and rotation may work in place
            v = rms_norm_unscaled(v, self.value_norm_eps)
        elif self.k_eq_v:
            v = v.clone()
        if self.qk_norm:
            k = self.k_norm.heads(k)
        if self.use_rope:
            k = apply_rotary(k, cos, sin)
        if md.calculate_kv_scales:
            kv_cache.scales.copy_(torch.stack([calibrated_scale(k), calibrated_scale(v)]))
        # The engine's backend, which built md (a per-engine choice: engines may share this model).
        out = md.backend.forward(q, k, v, kv_cache.k, kv_cache.v, md, self.scale, self.sliding_window, kv_cache.scales,
                                 sinks=self.sinks)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    """Attention then MLP, each added to the residual stream after a norm of its input. With
    sandwich norms (Gemma 3) each block's output is normalised too, and the MLP's input norm is
    pre_feedforward_layernorm; without, that one is post_attention_layernorm (Llama's name)."""

    def __init__(self, config: ModelConfig, layer: int, shard: TPShard, tp: TPGroup):
        super().__init__()
        norm = lambda dim=config.hidden_size: RMSNorm(dim, config.rms_norm_eps, config.norm_unit_offset,  # noqa: E731
                                                      config.norm_scale_float32)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer, shard, tp)
        self.post_attention_layernorm = norm()
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        intermediate = (shard.intermediate_size if not config.layer_intermediate_sizes
                        else config.layer_intermediate_sizes[layer] // tp.size)
        self.mlp = GatedMLP(config.hidden_size, intermediate, config.mlp_bias, tp, config.hidden_act)
        self.uses_sliding_rope = config.layer_uses_sliding_rope(layer)
        self.kv_source = config.kv_source(layer)
        # Gemma 4's per-layer embeddings: a gated projection of this layer's share, added after the MLP.
        self.per_layer_input_size = config.per_layer_input_size
        if config.per_layer_input_size:
            self.per_layer_input_gate = Linear(config.hidden_size, config.per_layer_input_size, bias=False)
            self.per_layer_projection = Linear(config.per_layer_input_size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = nn.Parameter(torch.ones(1)) if config.layer_scalar else None
        self.hidden_act = config.hidden_act

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: KVCache,
                md: AttentionMetadata, per_layer_input: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two, in
        the next layer's (or the final) norm, which fuses the add. residual=None: x is the first
        layer's input. With a layer scalar (Gemma 4), which scales the sum, (the sum, None)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, md)
        if not self.sandwich_norms:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        h = self.post_feedforward_layernorm(self.mlp(h))
        if self.layer_scalar is None:
            return h, residual
        x = residual + h
        if self.per_layer_input_size:
            gate = self.per_layer_input_gate(x)
            gate = F.gelu(gate, approximate="tanh") if self.hidden_act == "gelu_pytorch_tanh" else F.silu(gate)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))
        return x * self.layer_scalar, None


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: TPShard, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shard.vocab_rows, config.hidden_size, shard.vocab_start, tp,
                                                   config.embed_scale)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset, config.norm_scale_float32)
        # Each table over its layers' head size (Gemma 4's full and sliding layers differ).
        full = [i for i in range(config.num_layers) if not config.layer_uses_sliding_rope(i)]
        sliding = [i for i in range(config.num_layers) if config.layer_uses_sliding_rope(i)]
        self.rotary_emb = RotaryEmbedding(
            config.rotary_dim or config.layer_head_dim(full[0] if full else 0), config.max_position_embeddings,
            config.rope_theta, config.rope_scaling
        )
        # Gemma 3: the sliding-window layers rotate by their own base.
        self.sliding_rotary_emb = None if config.sliding_rope_theta is None else RotaryEmbedding(
            config.rotary_dim or config.layer_head_dim(sliding[0] if sliding else 0), config.max_position_embeddings,
            config.sliding_rope_theta, config.sliding_rope_scaling,
        )
        # Gemma 4's per-layer embeddings: a table of every layer's share per token, and a projection
        # of the token's embedding onto them (replicated under tensor parallelism).
        self.per_layer_input_size = p = config.per_layer_input_size
        if p:
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.per_layer_vocab_size, config.num_layers * p, 0,
                                                                 TPGroup(), p**0.5)
            self.per_layer_model_projection = Linear(config.hidden_size, config.num_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps, config.norm_unit_offset,
                                                     config.norm_scale_float32)

    def per_layer_inputs(self, input_ids: Tensor, embeds: Tensor) -> Tensor:
        """[num_tokens, layers, per_layer_input_size]: (normalised projection of the embedding
        + the token's per-layer embedding) / sqrt(2), as transformers combines them."""
        n, p = len(self.layers), self.per_layer_input_size
        projected = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        projected = self.per_layer_projection_norm(projected.reshape(-1, n, p).contiguous())
        return (projected + self.embed_tokens_per_layer(input_ids).reshape(-1, n, p)) * 2.0**-0.5

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary_emb, self.sliding_rotary_emb) if r is not None]


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.tp = tp = tp or TPGroup()
        if tp.size > 1 and (config.layer_kv_heads or config.per_layer_input_size):
            raise ValueError("tensor parallelism is not supported for Gemma 4 (per-layer head sizes and KV heads, "
                             "per-layer embeddings)")
        self.shard = shard = TPShard.of(config, tp.rank, tp.size)
        self.model = DecoderModel(config, shard, tp)
        # Tied models have no lm_head at all: the logits reuse the embedding matrix.
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, shard.vocab_rows, bias=False)
        )
        self.head_packed = PackedWeight()

    @classmethod
    def meta(cls, config: ModelConfig, tp: TPGroup | None = None) -> DecoderForCausalLM:
        """The model without memory: its structure and `checkpoint_targets`."""
        with torch.device("meta"):
            return cls(config, tp)

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
              tp: TPGroup | None = None, model: DecoderForCausalLM | None = None) -> DecoderForCausalLM:
        """Allocate without initialising weights (the loader overwrites every one of them, except
        the vocabulary's padding rows under tensor parallelism, zeroed here). Given `model` (from
        `meta`), allocate its parameters: those the loader already replaced with quantized weights
        are gone and take no memory."""
        model = model or cls.meta(config, tp)
        float32 = {id(m.sinks) for m in model.modules() if isinstance(m, Attention) and m.sinks is not None}
        # Module.to_empty's empty_like of a meta tensor goes through torch's Python references,
        # which take half a second to set up on first use: a start pays it. torch.empty does not.
        model = model._apply(lambda t: t if t.device.type != "meta" else torch.empty(
            t.shape, dtype=dtype if t.is_floating_point() and id(t) not in float32 else t.dtype, device=device))
        for rotary in model.model.rotary_tables():  # a buffer, not a weight: compute it for real
            rotary.build(device)
        if model.shard.real_vocab_rows(config.vocab_size) < model.shard.vocab_rows:
            for head in (model.model.embed_tokens, model.lm_head):
                if head is not None and head.weight is not None:
                    head.weight.detach().zero_()
        return model

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata | list[AttentionMetadata]
    ) -> Tensor:
        """input_ids, positions: [num_tokens]; kv_caches: one KVCache per layer; attn_metadata: the
        step's metadata, or one per layer (its KV cache group's). Returns the final hidden states
        [num_tokens, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        per_layer_inputs = self.model.per_layer_inputs(input_ids, x) if self.model.per_layer_input_size else None
        rope = self.model.rotary_emb(positions, x.dtype)  # gathered once, shared by all layers (of its type)
        sliding = self.model.sliding_rotary_emb
        sliding_rope = rope if sliding is None else sliding(positions, x.dtype)
        residual = None
        per_layer = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(kv_caches)
        if len(kv_caches) != self.config.num_cache_layers or len(per_layer) != len(kv_caches):
            raise ValueError(f"{len(kv_caches)} KV caches and {len(per_layer)} metadata for "
                             f"{self.config.num_cache_layers} cache layers")
        for i, layer in enumerate(self.model.layers):
            cos, sin = sliding_rope if layer.uses_sliding_rope else rope
            # A KV-shared layer (Gemma 4) reads its source layer's cache, by that layer's metadata.
            source = layer.kv_source
            x, residual = layer(x, residual, cos, sin, kv_caches[source], per_layer[source],
                                None if per_layer_inputs is None else per_layer_inputs[:, i])
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor | None:
        """Logits [rows, vocab_size]. Under tensor parallelism each rank computes its slice of the
        vocabulary and rank 0 gathers them; the other ranks get None."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if head.quantized is not None:
            logits = self.tp.gather_columns(head.quantized.linear(hidden))
        else:
            logits = self.tp.gather_columns(linear(hidden, head.weight, None, self.head_packed))
        if logits is None:
            return None
        if self.tp.size > 1:
            logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:  # transformers' operators, in the model dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_targets(self) -> dict[str, Target]:
        """Each checkpoint tensor name -> the Target (our parameter, rows, source slice) it fills."""
        c, s = self.config, self.shard
        targets = {}
        for name, param in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            # (part, rows of ours, where this rank's rows start in the checkpoint's tensor, its rows there)
            if module == "qkv_proj":
                parts = self._qkv_parts(self.get_submodule(parent))
            elif module == "gate_up_proj":
                rows = param.shape[0] // 2
                parts = (("gate_proj", rows, s.rank * rows, rows * s.size), ("up_proj", rows, s.rank * rows, rows * s.size))
            if module in ("qkv_proj", "gate_up_proj"):
                start = 0
                for part, rows, source_start, whole in parts:
                    targets[f"{parent}.{part}.{leaf}"] = Target(param, start, rows, 0, source_start, whole)
                    start += rows
            elif module in ("o_proj", "down_proj") and leaf == "weight":  # row-parallel: their input columns
                columns = param.shape[1]
                targets[name] = Target(param, 0, param.shape[0], 1, s.rank * columns, columns * s.size)
            elif module in ("embed_tokens", "lm_head"):
                targets[name] = Target(param, 0, s.real_vocab_rows(c.vocab_size), 0, s.vocab_start, c.vocab_size)
            elif leaf == "sinks":  # one per query head: this rank's heads
                targets[name] = Target(param, 0, s.num_heads, 0, s.rank * s.num_heads, c.num_heads)
            else:
                targets[name] = Target(param, 0, param.shape[0], 0, 0, param.shape[0])
        return targets

    def _qkv_parts(self, attn: Attention) -> list[tuple[str, int, int, int]]:
        """The checkpoint parts of one layer's fused projection (q, then its K/V projections)."""
        s = self.shard
        kv_whole = attn.kv_size * s.size if self.config.layer_kv_heads else self.config.num_kv_heads * attn.head_dim
        return [("q_proj", attn.q_size, s.rank * attn.q_size, attn.q_size * s.size)] + [
            (part, attn.kv_size, s.kv_head_start * attn.head_dim, kv_whole) for part in attn.kv_parts]
