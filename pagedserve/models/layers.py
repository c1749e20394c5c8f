"""Building blocks of the decoder: RMSNorm, rotary position embedding, gated MLP, linears, embedding.

Arithmetic follows transformers' Llama family (and, where the config asks, Gemma 3's variants) step
for step, so float32 results agree to rounding.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedserve.distributed.group import TPGroup
from pagedserve.models.quantized import QuantizedWeight
from pagedserve.ops import cpu_linear, fused_cpu


class RMSNorm(nn.Module):
    """Llama's RMSNorm, weight * dtype(normalised x); with unit_offset Gemma's, dtype(normalised x *
    (1 + weight)) all in float32 (its weights are stored as offsets from one)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, scale_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset
        # Gemma 4: weight * normalised x in float32, then rounded; the fused kernel has no such form
        # (in float32 it is Llama's, which it has).
        self.scale_float32 = scale_float32

    def fused(self, x: Tensor) -> bool:
        return fused_cpu.available(x) and (not self.scale_float32 or x.dtype == torch.float32)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x); with a residual, (norm(x + residual), x + residual), the sum written into
        residual's memory on the fused CPU path."""
        if self.fused(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            out = fused_cpu.rms_norm(x, self.weight, self.eps, residual, self.unit_offset)
            return out if residual is None else (out, residual)
        if residual is None:
            return self.norm(x)
        x = x + residual
        return self.norm(x), x

    def heads(self, x: Tensor) -> Tensor:
        """norm of each head of x [num_tokens, heads, head_dim] (the q/k norms). On the fused CPU
        path x is normalised in place (it may be a view of the fused qkv output)."""
        if self.fused(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return fused_cpu.rms_norm_heads_(x, self.weight, self.eps, self.unit_offset)
        return self.norm(x)

    def norm(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the model dtype; Llama scales in the model dtype, Gemma in float32.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        if self.scale_float32:
            return (x32 * self.weight.float()).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def rms_norm_unscaled(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight over the last dim, in float32, rounded back (Gemma 4's V norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None = None, long: bool = False) -> Tensor:
    """Inverse frequencies [dim // 2] of RoPE over `dim` rotated dims, plain or scaled
    (`scaling`: models/config.py's _rope), computed op for op as transformers' modeling_rope_utils
    does. longrope: the short factors' frequencies, or the long factors' with long=True."""
    rope_type = scaling["rope_type"] if scaling else "default"
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope_type == "dynamic":
        # NTK's base for a sequence of max_position_embeddings tokens, the longest the engine runs
        # (transformers recomputes it only past that length): theta itself, up to rounding.
        factor, length = scaling["factor"], scaling["max_position_embeddings"]
        theta = theta * ((factor * length / length) - (factor - 1)) ** (dim / (dim - 2))
    if rope_type == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta**exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling)
    if rope_type == "proportional":
        # Gemma 4's full layers: the first fraction of the head's frequency pairs turn as plain RoPE
        # over the whole head would, the rest do not turn (frequency zero: cos 1, sin 0).
        angles = int(scaling["partial_rotary_factor"] * dim // 2)
        turning = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
        return torch.cat([turning, torch.zeros(dim // 2 - angles)]) / scaling["factor"]
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        return inv_freq
    # Llama 3.1: stretch low frequencies (long wavelengths) by `factor`, keep high ones, and
    # interpolate smoothly in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those turning more than beta_fast times are kept, with a
    linear ramp between the two dims those counts fall on."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    powers = theta ** (torch.arange(0, dim, 2).float() / dim)
    kept, interpolated = 1.0 / powers, 1.0 / (factor * powers)

    def dim_turning(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_turning(scaling["beta_fast"]), dim_turning(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + kept * keep


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_positions over the `dim` rotated dims of a head (all of
    them, or a partial rotary's leading share), computed once in float32 and scaled by the rope
    type's attention factor (yarn, longrope) as transformers scales them.

    Only half a head's worth is stored: the two halves of transformers' table are equal.

    Where transformers' frequencies depend on the sequence (it recomputes them per forward), the
    table holds what it uses for each position of a sequence it would run the same way:
    - dynamic: transformers rescales past max_position_embeddings only, which the engine never
      reaches (max_model_len <= max_position_embeddings), so these are its frequencies throughout.
    - longrope: position p takes the short factors below original_max_position_embeddings and the
      long factors from there on. A sequence within the original length gets transformers'
      rotation exactly (short factors), and so does one decoded past it a token per forward over
      a cache. transformers' Phi-3 generate instead runs the whole sequence again with the long
      factors once it first grows past that length; a paged cache keeps each token's K as first
      written, so here the earlier tokens keep the short factors. (Choosing by a batch's longest
      position, as a transformers forward does, would make a request's K depend on its batch.)
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.dim, self.max_positions, self.theta, self.scaling = dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        if self.cos.device.type != "meta":  # a model allocated without data builds it once it has a device
            self.build()

    def build(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the table, e.g. after the module was allocated without data."""
        device = self.cos.device if device is None else device
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None]
        freqs = positions * rope_inv_freq(self.dim, self.theta, self.scaling).to(device)
        scaling = self.scaling or {}
        if scaling.get("rope_type") == "longrope":
            original = scaling["original_max_position_embeddings"]
            long = positions[original:] * rope_inv_freq(self.dim, self.theta, scaling, long=True).to(device)
            freqs = torch.cat([freqs[:original], long])
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if "attention_factor" in scaling:  # float32 products, as transformers scales its table
            self.cos, self.sin = self.cos * scaling["attention_factor"], self.sin * scaling["attention_factor"]
        self._tables = {}

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [num_tokens, dim // 2] for these positions, in the model dtype."""
        cos, sin = self.tables(dtype)
        if fused_cpu.available(cos) and positions.dtype == torch.int64 and positions.is_contiguous():
            return fused_cpu.gather_rows(cos, positions), fused_cpu.gather_rows(sin, positions)
        return cos[positions], sin[positions]

    def tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The whole cos and sin tables rounded to `dtype` (the same values as rounding the rows a
        step gathers), made on first use."""
        key = (dtype, self.cos.data_ptr())
        if key not in self._tables:
            self._tables[key] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._tables[key]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [num_tokens, heads, head_dim] by the half-split (GPT-NeoX) convention that
    transformers' Llama weights use, over the first 2 * cos.shape[-1] dims of each head (all of
    them, or a partial rotary's share: the rest pass unchanged, as in transformers' Phi-3). On the
    fused CPU path x is rotated in place (it may be a view of the fused qkv output)."""
    if fused_cpu.available(x) and x.stride(2) == 1 and x.stride(1) == x.shape[2] and cos.dtype == x.dtype:
        return fused_cpu.rotary_(x, cos, sin)
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)


class PackedWeight:
    """A weight's copies in the layouts the CPU matmuls read: oneDNN's blocked layout, and
    ops/csrc/linear.c's panels (`cpu_linear.pack`). Each is made on first use and remade whenever the
    weight is replaced or written. oneDNN's is packed for batches of about ONEDNN_ROWS rows (a hint:
    any row count works): the 120 layer matmuls of the embedded model's shapes at 64 rows took 74 ms
    packed, 88 ms from a plain oneDNN copy, on the 2-core test machine."""

    ONEDNN_ROWS = 64

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.copies: dict[str, Tensor] = {}

    def onednn(self, weight: Tensor) -> Tensor:
        return self._get(weight, "onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, self.ONEDNN_ROWS))

    def panels(self, weight: Tensor) -> Tensor:
        return self._get(weight, "panels", cpu_linear.pack)

    def _get(self, weight: Tensor, layout: str, make) -> Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            self.copies, self.key = {}, key
        if layout not in self.copies:
            self.copies[layout] = make(weight.detach())
        return self.copies[layout]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight) -> Tensor:
    """x @ weight.T + bias. On CPU, a few rows (decode) go through ops/csrc/linear.c, which streams
    the weights once per call: at 16 rows 1.56x (bfloat16) and 1.41x (float32) the speed of
    oneDNN's GEMM on an AVX-512 test machine (docs/benchmarks.md). More rows go through oneDNN with
    the weight kept in its blocked layout, in float32 and where the CPU has bf16 instructions also
    in bfloat16: 1.1x (large batches) to 2x (a few tokens) the speed of torch's default CPU matmul
    in float32, 1.2x at 64 rows in bfloat16. Where oneDNN cannot pack the dtype (bfloat16 without
    those instructions) ops/csrc/linear.c takes every row count. Same arithmetic up to rounding; each
    path costs a copy of the weights it reads, made on first use."""
    onednn = x.device.type == "cpu" and x.dtype == weight.dtype and _onednn_packs(x.dtype)
    if cpu_linear.supports(x, weight, cpu_linear.MAX_ROWS if onednn else None):
        return cpu_linear.linear(x, packed.panels(weight), weight.shape[0], bias)
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn(weight), bias, "none", [], "")
    return F.linear(x, weight, bias)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    """nn.Linear through `linear` (ops/csrc/linear.c or oneDNN on CPU in float32 and bfloat16), or
    through its quantized weight where the loader gave it one (`quantize`: then `weight` is None).
    With `lora` set (a lora.layers.LoRAStack, on the fused linears of a model with LoRA slots), each
    output row also gets the delta of its token's adapter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()
        self.quantized: QuantizedWeight | None = None
        self.lora = None

    def quantize(self, weight: QuantizedWeight) -> None:
        """Hold `weight` instead of the dense parameter."""
        self.register_parameter("weight", None)
        self.quantized = weight

    def forward(self, x: Tensor) -> Tensor:
        out = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, out)
        return out

    def matmul(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x @ W.T (+ bias), W dense or quantized."""
        if self.quantized is not None:
            return self.quantized.linear(x, bias)
        return linear(x, self.weight, bias, self.packed)


class RowParallelLinear(Linear):
    """A Linear whose input features are split across a tensor-parallel group: each rank
    multiplies its slice, the partial products are summed over the group, then the (whole) bias
    is added once. A LoRA delta is a partial product too: its A holds this rank's input features.
    With a group of one, exactly Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.matmul(x, None)
        if self.lora is not None:
            self.lora.add_to(x, out)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(nn.Module):
    """The token embedding, rows [start, start + rows) of the (padded) vocabulary on this rank:
    each rank looks up the ids it holds, zeros elsewhere, and the group sums the rows. With
    `scale` (Gemma: sqrt(hidden_size)) each row is multiplied by it, rounded to the dtype first as
    transformers does."""

    def __init__(self, rows: int, dim: int, start: int, tp: TPGroup, scale: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.tp, self.scale = start, tp, scale
        self.quantized: QuantizedWeight | None = None

    def quantize(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        """Hold `weight` instead of the dense table: rows are dequantized (to `dtype`) as they are
        looked up."""
        self.register_parameter("weight", None)
        self.quantized, self.dtype = weight, dtype

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        rows = self.weight.shape[0] if self.quantized is None else self.quantized.shape[0]
        outside = (local < 0) | (local >= rows)
        out = self._rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def _rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of this rank's table, scaled."""
        if self.quantized is not None:
            rows = self.quantized.rows(ids, self.dtype)
            return rows if self.scale is None else rows * _rounded(self.scale, rows.dtype)
        if fused_cpu.available(self.weight) and ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous():
            if self.scale is None:  # one C call each (ops/csrc/fused_ops.c)
                return fused_cpu.gather_rows(self.weight, ids)
            return fused_cpu.gather_scaled_rows(self.weight, ids, _rounded(self.scale, self.weight.dtype))
        rows = F.embedding(ids, self.weight)
        return rows if self.scale is None else rows * _rounded(self.scale, rows.dtype)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as a float32 tensor rounded to `dtype` holds it: a Python float that multiplies
    exactly as transformers' scale tensor does."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU or tanh-approximated GELU (transformers'
    "gelu_pytorch_tanh"), with gate and up fused into one matmul. Under tensor parallelism
    intermediate_size is this rank's share: gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: TPGroup | None = None,
                 activation: str = "silu"):
        super().__init__()
        if activation not in fused_cpu.ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r}; supported: {', '.join(fused_cpu.ACTIVATIONS)}")
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp or TPGroup())
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if fused_cpu.available(gate_up):
            return self.down_proj(fused_cpu.act_and_mul(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
