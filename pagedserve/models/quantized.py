"""Weights kept quantized: GGUF's block formats and pagedserve's own int8 / int4, run by
csrc/quant_linear.c without ever being widened to a dense matrix.

Every supported format reads as codes in groups of consecutive input features, each group with a
scale and maybe a min per output row: w = q * scale + min (`QuantizedTensor`). A GGUF tensor is
unpacked into that form (`from_gguf`), a float one quantized into it (`quantize_int8`,
`quantize_int4`); narrowed for tensor parallelism (rows, or input features in whole groups); then
`QuantizedWeight` packs it into the kernel's tiles and multiplies by it. The values the kernel uses
are exactly gguf-py's dequantized ones (ops/csrc/quant_linear.c says why).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from pagedserve.ops import native

COLS = 16  # output rows of W per panel, as in ops/csrc/quant_linear.c
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

# GGUF type name -> (elements per block, bytes per block) for the formats unpacked here.
GGUF_FORMATS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


@dataclass
class QuantizedTensor:
    """W [rows, cols] as w[r, c] = codes[r, c] * scales[r, c // group] (+ mins[r, c // group]).
    codes: int8 for 8-bit formats (signed, no mins), else uint8 below 2**bits."""

    format: str
    codes: np.ndarray
    scales: np.ndarray  # float32 [rows, cols // group]
    mins: np.ndarray | None
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def kind(self) -> tuple[int, int, bool]:
        """What the kernel needs to know of the format: parts with equal kinds pack together."""
        return self.bits, self.group, self.mins is not None

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows [start, start + length), or columns there (dim 1), which must be whole groups."""
        if dim == 0:
            return self.take_rows(slice(start, start + length))
        if start % self.group or length % self.group:
            raise ValueError(f"columns [{start}, {start + length}) cut through groups of {self.group}")
        groups = slice(start // self.group, (start + length) // self.group)
        return QuantizedTensor(self.format, self.codes[:, start:start + length], self.scales[:, groups],
                               None if self.mins is None else self.mins[:, groups], self.group, self.bits)

    def take_rows(self, index: slice | np.ndarray) -> QuantizedTensor:
        """The rows `index` selects (a slice, or an order of rows)."""
        return QuantizedTensor(self.format, self.codes[index], self.scales[index],
                               None if self.mins is None else self.mins[index], self.group, self.bits)

    def zero_rows(self, count: int) -> QuantizedTensor:
        """`count` rows of zero weights in this tensor's format (padding)."""
        return QuantizedTensor(self.format, np.zeros((count, self.shape[1]), self.codes.dtype),
                               np.zeros((count, self.scales.shape[1]), np.float32),
                               None if self.mins is None else np.zeros((count, self.mins.shape[1]), np.float32),
                               self.group, self.bits)

    def dequantize(self) -> np.ndarray:
        """The float32 weights (the same values the kernel uses)."""
        scales = np.repeat(self.scales, self.group, axis=1)
        w = self.codes.astype(np.float32) * scales
        return w + np.repeat(self.mins, self.group, axis=1) if self.mins is not None else w


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Parts of one kind stacked by rows (a fused q/k/v or gate/up weight)."""
    first = parts[0]
    mins = None if first.mins is None else np.concatenate([p.mins for p in parts])
    name = "+".join(dict.fromkeys(p.format for p in parts))
    return QuantizedTensor(name, np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                           mins, first.group, first.bits)


# --- GGUF blocks -> QuantizedTensor -------------------------------------------------------------

def from_gguf(type_name: str, blocks: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    """A GGUF tensor of type `type_name` (one of GGUF_FORMATS) whose raw bytes are `blocks`
    (rows x bytes per row), as rows x cols weights."""
    per_block, block_bytes = GGUF_FORMATS[type_name]
    if cols % per_block or blocks.size != rows * cols // per_block * block_bytes:
        raise ValueError(f"{blocks.size} bytes do not hold {rows} x {cols} weights of {type_name}")
    b = np.ascontiguousarray(blocks).reshape(rows, cols // per_block, block_bytes)
    codes, scales, mins, group, bits = _UNPACK[type_name](b)
    return QuantizedTensor(type_name, codes.reshape(rows, cols), scales.reshape(rows, -1).astype(np.float32),
                           None if mins is None else mins.reshape(rows, -1).astype(np.float32), group, bits)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] as float32 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """32 four-bit codes from 16 bytes: the low nibbles are elements 0-15, the high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of little-endian bytes qh [..., count / 8] as [..., count]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def _q8_0(b):
    return b[..., 2:].view(np.int8), _f16(b[..., :2]), None, 32, 8


def _q4_0(b):
    d = _f16(b[..., :2])
    return _nibbles(b[..., 2:]), d, -8 * d, 32, 4


def _q4_1(b):
    return _nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]), 32, 4


def _q5_0(b):
    d = _f16(b[..., :2])
    return _nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6], 32) << 4), d, -16 * d, 32, 5


def _q5_1(b):
    return _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8], 32) << 4), _f16(b[..., :2]), _f16(b[..., 2:4]), 32, 5


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block, from its 12 bytes: sub-blocks
    0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of
    bytes 8-11 (low: scale, high: min) with their top 2 bits in the top bits of bytes 0-7."""
    low, high = s[..., :4], s[..., 4:8]
    scales = np.concatenate([low & 63, (s[..., 8:] & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (s[..., 8:] >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """The 256 four-bit codes of a Q4_K / Q5_K super-block: each 32 bytes hold two sub-blocks of
    32, the first in the low nibbles."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (q & 15).reshape(*qs.shape[:-1], 256)


def _q4_k(b):
    d, dmin = _f16(b[..., :2])[..., None], _f16(b[..., 2:4])[..., None]
    scales, mins = _k_scales(b[..., 4:16])
    return _k_low_nibbles(b[..., 16:]), d * scales, -(dmin * mins), 32, 4


def _q5_k(b):
    d, dmin = _f16(b[..., :2])[..., None], _f16(b[..., 2:4])[..., None]
    scales, mins = _k_scales(b[..., 4:16])
    # bit j of the 32 high-bit bytes is the fifth bit of sub-block j
    high = np.unpackbits(b[..., 16:48], axis=-1, bitorder="little").reshape(*b.shape[:-1], 32, 8)
    high = np.swapaxes(high, -1, -2).reshape(*b.shape[:-1], 256)
    return _k_low_nibbles(b[..., 48:]) | (high << 4), d * scales, -(dmin * mins), 32, 5


def _q6_k(b):
    """Q6_K: ql[128] qh[64] scales[16] (int8) d (float16); in each half of 128 elements, element
    64s + j takes nibble s of ql[j] and element 32t + j the bits 2t, 2t+1 of qh[j] as its top two;
    codes are stored minus 32."""
    shape = b.shape[:-1]
    ql = b[..., :128].reshape(*shape, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    qh = b[..., 128:192].reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    q = (ql & 15).reshape(*shape, 256) | ((qh & 3).reshape(*shape, 256) << 4)
    scales = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)
    return q, scales, -32 * scales, 16, 6


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
           "Q5_K": _q5_k, "Q6_K": _q6_k}


# --- float -> QuantizedTensor ---------------------------------------------------------------------

INT4_GROUP = 32


def _round_to_f16(x: np.ndarray) -> np.ndarray:
    """x rounded to float16 where float16 holds it without losing precision (normal numbers), else
    kept: the kernel then reads float16 scales, a quarter of int4's bytes fewer."""
    h = x.astype(np.float16).astype(np.float32)
    normal = (np.abs(x) >= 2.0**-14) & (np.abs(x) <= 65504.0) | (x == 0)
    return h if normal.all() else x


def quantize_int8(w: Tensor) -> QuantizedTensor:
    """Symmetric int8 per output row (one scale per row, repeated per group of 32 for the kernel)."""
    w = w.detach().float().numpy()
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"int8 needs input features in groups of 32; this weight has {cols}")
    scale = _round_to_f16(np.abs(w).max(axis=1, keepdims=True) / 127)
    codes = np.clip(np.rint(np.divide(w, scale, out=np.zeros_like(w), where=scale > 0)), -127, 127).astype(np.int8)
    return QuantizedTensor("int8", codes, np.repeat(scale, cols // 32, axis=1), None, 32, 8)


def quantize_int4(w: Tensor, group: int = INT4_GROUP) -> QuantizedTensor:
    """Asymmetric int4 per group of `group` input features: w ~ q * scale + min, q in [0, 15]."""
    w = w.detach().float().numpy()
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"int4 needs input features in groups of {group}; this weight has {cols}")
    g = w.reshape(rows, cols // group, group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scale = _round_to_f16((high - low) / 15)
    low = _round_to_f16(low)
    q = np.divide(g - low[..., None], scale[..., None], out=np.zeros_like(g), where=scale[..., None] > 0)
    codes = np.clip(np.rint(q), 0, 15).astype(np.uint8).reshape(rows, cols)
    return QuantizedTensor("int4", codes, scale, low, group, 4)


# --- the kernel's tiles ------------------------------------------------------------------------------

def _code_bytes(bits: int) -> int:
    return {8: 16, 4: 8, 5: 10, 6: 12}[bits]


def pack(t: QuantizedTensor) -> tuple[Tensor, bool]:
    """(tiles as a uint8 tensor, whether scales are float16): ops/csrc/quant_linear.c's layout."""
    rows, cols = t.shape
    panels, groups = -(-rows // COLS), cols // t.group
    pad = panels * COLS - rows

    def by_panel(a: np.ndarray) -> np.ndarray:  # [rows, x] -> [panels, x, 16], zero rows past the end
        a = np.pad(a, ((0, pad), (0, 0)))
        return a.reshape(panels, COLS, -1).swapaxes(1, 2)

    scale_parts = [t.scales] + ([t.mins] if t.mins is not None else [])
    scale_f16 = all(np.array_equal(p.astype(np.float16).astype(np.float32), p) for p in scale_parts)
    header = [np.ascontiguousarray(by_panel(p), np.float16 if scale_f16 else np.float32).view(np.uint8)
              for p in scale_parts]
    codes = np.ascontiguousarray(by_panel(t.codes)).reshape(panels, groups, t.group, COLS)  # [panel, group, k in group, column]
    if t.bits == 8:
        body = codes.view(np.uint8)
    else:
        low = codes & 15
        body = [low[..., :COLS // 2] | (low[..., COLS // 2:] << 4)]
        if t.bits == 5:
            body.append(np.packbits((codes >> 4) & 1, axis=-1, bitorder="little"))
        elif t.bits == 6:
            high = ((codes >> 4) & 3).astype(np.uint32) << (2 * np.arange(COLS, dtype=np.uint32))
            body.append(np.bitwise_or.reduce(high, axis=-1, keepdims=True).astype("<u4").view(np.uint8))
        body = np.concatenate(body, axis=-1)
    body = body.reshape(panels, groups, t.group * _code_bytes(t.bits))
    header = np.concatenate([h.reshape(panels, groups, -1) for h in header], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(np.concatenate([header, body], axis=-1)).reshape(-1)), scale_f16


@functools.cache
def load(flags: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """ops/csrc/quant_linear.c, or None where it cannot be built (quantized weights are then widened)."""
    lib = native.optional_library("quant_linear", "quantized weights are dequantized at load",
                                  None if flags is None else list(flags))
    if lib is None:
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.quant_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i32, i32, i32, i32, i32, i32]
    lib.quant_linear.restype = None
    lib.quant_rows.argtypes = [ptr, i64, i64, ptr, i64, ptr, i32, i32, i32, i32, i32, i32]
    lib.quant_rows.restype = ctypes.c_int
    lib.quant_linear_simd.restype = ctypes.c_int
    return lib


def available() -> bool:
    return load() is not None


class _Segment(nn.Module):
    """Rows [start, start + rows) of a weight, packed in one kind."""

    FIELDS = ("format", "start", "rows", "cols", "bits", "group", "scale_f16", "has_min")

    def __init__(self, tiles: Tensor, format: str, start: int, rows: int, cols: int, bits: int, group: int,
                 scale_f16: bool, has_min: bool) -> None:
        super().__init__()
        self.register_buffer("tiles", tiles)
        self.format, self.start, self.rows, self.cols = format, start, rows, cols
        self.bits, self.group, self.scale_f16, self.has_min = bits, group, scale_f16, has_min

    @classmethod
    def of(cls, part: QuantizedTensor, start: int) -> _Segment:
        tiles, scale_f16 = pack(part)
        return cls(tiles, part.format, start, *part.shape, part.bits, part.group, scale_f16, part.mins is not None)

    def describe(self) -> dict:
        """The fields that remake this segment from its tiles (`_Segment(tiles, **describe())`)."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def args(self) -> tuple[int, int, int, int]:
        return self.bits, self.group, int(self.scale_f16), int(self.has_min)


class QuantizedWeight(nn.Module):
    """A [rows, cols] weight held as packed quantized segments (one per run of rows that share a
    kind: a fused q/k/v may hold Q4_K rows and Q6_K rows). `linear` multiplies by it; `rows`
    gathers dequantized rows (an embedding table); `lib` is the kernel library (the portable build
    in tests)."""

    def __init__(self, segments: list[_Segment], lib: ctypes.CDLL | None = None) -> None:
        super().__init__()
        self.segments = nn.ModuleList(segments)
        self.shape = (sum(s.rows for s in segments), segments[0].cols)
        self.lib = lib or load()

    @classmethod
    def of(cls, parts: list[QuantizedTensor], lib: ctypes.CDLL | None = None) -> QuantizedWeight:
        """The parts stacked by rows, each run of one kind packed as one segment."""
        runs: list[list[QuantizedTensor]] = []
        for part in parts:
            if runs and runs[-1][0].kind() == part.kind():
                runs[-1].append(part)
            else:
                runs.append([part])
        segments, start = [], 0
        for run in runs:
            part = concat_rows(run) if len(run) > 1 else run[0]
            segments.append(_Segment.of(part, start))
            start += part.shape[0]
        return cls(segments, lib)

    @classmethod
    def from_packed(cls, described: list[dict], tiles: list[Tensor]) -> QuantizedWeight:
        """A weight remade from its segments' `describe()` and tiles (a cache entry)."""
        return cls([_Segment(t, **d) for d, t in zip(described, tiles, strict=True)])

    @property
    def formats(self) -> list[str]:
        return [s.format for s in self.segments]

    @property
    def nbytes(self) -> int:
        return sum(s.tiles.numel() for s in self.segments)

    def linear(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        """x @ W.T (+ bias) in x's dtype (float32 or bfloat16), float32 sums."""
        x = x.contiguous()  # held: the kernel reads it
        k = x.shape[-1]
        if k != self.shape[1] or x.dtype not in _DTYPES:
            raise ValueError(f"x [..., {k}] {x.dtype} does not multiply a quantized [{self.shape[0]}, "
                             f"{self.shape[1]}] weight")
        rows, n = x.numel() // k, self.shape[0]
        y = x.new_empty((*x.shape[:-1], n))
        threads = torch.get_num_threads()
        for s in self.segments:
            native.call(self.lib.quant_linear, x.data_ptr(), rows, k, s.tiles.data_ptr(), s.rows,
                        y.data_ptr() + s.start * y.element_size(), n, *s.args(), _DTYPES[x.dtype], threads)
        return y if bias is None else y.add_(bias)

    def rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of W dequantized to `dtype` (float32 or bfloat16); a single-kind weight."""
        (s,) = self.segments
        ids = ids.contiguous()
        out = torch.empty((*ids.shape, self.shape[1]), dtype=dtype)
        if native.call(self.lib.quant_rows, s.tiles.data_ptr(), s.rows, s.cols, ids.data_ptr(), ids.numel(),
                       out.data_ptr(), *s.args(), _DTYPES[dtype], torch.get_num_threads()) != 0:
            raise IndexError(f"token id out of range for an embedding table of {s.rows} rows")
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The whole weight as a dense [rows, cols] tensor."""
        out = torch.empty(self.shape, dtype=dtype)
        for s in self.segments:
            ids = torch.arange(s.rows, dtype=torch.int64)
            if self.lib.quant_rows(s.tiles.data_ptr(), s.rows, s.cols, ids.data_ptr(), s.rows,
                                   out[s.start:s.start + s.rows].data_ptr(), *s.args(),
                                   _DTYPES[dtype], torch.get_num_threads()) != 0:
                raise AssertionError("unreachable: every row id is in range")
        return out


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """The bytes of a model's weights by format: each quantized segment's format, and the dtype of
    every dense parameter (the rotary tables and other buffers are not weights)."""
    sizes: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, _Segment):
            sizes[module.format] = sizes.get(module.format, 0) + module.tiles.nbytes
    for p in model.parameters():
        name = str(p.dtype).removeprefix("torch.")
        sizes[name] = sizes.get(name, 0) + p.nbytes
    return sizes


def describe_weights(model: nn.Module) -> str:
    """e.g. "Q4_1 66.4 MB, Q8_0 30.1 MB, float32 0.1 MB", largest first."""
    sizes = sorted(weight_bytes_by_format(model).items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {n / 1e6:.1f} MB" for name, n in sizes)
