"""A model whose linear weights stay quantized: a GGUF's tensors read as stored, or a float
checkpoint quantized to int8 / int4 at load (models/quantized.py holds the formats and kernels).

Each checkpoint tensor becomes a QuantizedTensor (a format with a kernel) or a dense tensor (norms,
biases, float tensors, and formats without a kernel, dequantized with a log line naming them).
A parameter whose parts are all quantized, and can be cut for this tensor-parallel rank in whole
groups, becomes a QuantizedWeight on its layer and is never allocated dense; every other one is
filled as `loader.load_weights` fills a float checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pagedserve.models.config import ModelConfig
from pagedserve.models.layers import Linear, VocabParallelEmbedding
from pagedserve.models.llama import DecoderForCausalLM, Target, split_fused_tensors
from pagedserve.models.quantized import (GGUF_FORMATS, QuantizedTensor, QuantizedWeight, from_gguf, quantize_int4,
                                         quantize_int8)

logger = logging.getLogger(__name__)

# The float checkpoint tensors that int8 / int4 quantize: the linear layers of every block.
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DENSE_GGUF_TYPES = ("F32", "F16", "BF16")


def gguf_tensors(reader, config: ModelConfig, names: Iterable[str]) -> Iterator[tuple[str, QuantizedTensor | Tensor]]:
    """The checkpoint tensors `names` (transformers' names) of a GGUF, as stored: a QuantizedTensor
    for each format with a kernel, float32 tensors otherwise. What llama.cpp's converter changed is
    put back, as transformers' GGUF loader does: a Llama's q/k rows permuted (rotary halves
    interleaved), a Gemma 3's norm weights stored as 1 + w. A Phi-3's fused attn_qkv and ffn_up
    (q | k | v, gate | up) are cut by rows into their parts, still quantized (GGUF blocks run
    along a row, so any row range is whole blocks)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    field = reader.fields["general.architecture"]
    arch = field.parts[field.data[0]].tobytes().decode()
    arch_id = {v: k for k, v in MODEL_ARCH_NAMES.items()}.get(arch)
    if arch_id is None:
        raise ValueError(f"GGUF architecture {arch!r} is not one gguf-py knows")
    name_map = get_tensor_name_map(arch_id, config.num_layers)
    stored = {t.name: t for t in reader.tensors}
    names = list(names)
    if arch == "phi3":  # only the fused tensors exist (ffn_up is gate | up): ask for those
        names = list(dict.fromkeys(_fused_name(name) for name in names))
    widened: dict[str, list[str]] = defaultdict(list)

    def read() -> Iterator[tuple[str, QuantizedTensor | Tensor]]:
        for name in names:
            gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            tensor = stored.get(gguf_name) if gguf_name else None
            if tensor is None:
                continue  # the caller reports what is missing
            value = _stored_value(tensor, gguf_name, widened)
            if arch == "llama" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
                heads = config.num_heads if "attn_q." in gguf_name else config.num_kv_heads
                value = _unpermute_rows(value, heads)
            if arch == "gemma3" and gguf_name.endswith("norm.weight"):
                value = value - 1  # float32, as transformers subtracts it
            yield name, value

    yield from split_fused_tensors(config, read())
    for kind, tensors in widened.items():
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        logger.warning("%d tensors are %s, which has no kernel here: dequantized at load (%s%s)", len(tensors), kind,
                       ", ".join(tensors[:3]), more)


_FUSED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _fused_name(name: str) -> str:
    """The fused tensor's name for a q/k/v or gate/up part's (split_fused_tensors cuts it again)."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    return f"{parent}.{_FUSED_PARTS[module]}.{leaf}" if module in _FUSED_PARTS else name


def _stored_value(tensor, gguf_name: str, widened: dict[str, list[str]]) -> QuantizedTensor | Tensor:
    """A GGUF tensor as a QuantizedTensor where its format has a kernel, else float32 (its name
    noted in `widened` under a quantized format)."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    if kind in GGUF_FORMATS and len(shape) == 2:
        return _unpacked(kind, tensor.data, shape, gguf_name)
    if kind not in _DENSE_GGUF_TYPES:
        widened[kind].append(gguf_name)
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(shape))


def _unpacked(kind: str, data: np.ndarray, shape: tuple[int, int], name: str) -> QuantizedTensor:
    """The GGUF tensor `name` as a QuantizedTensor; ValueError naming it if its bytes are damaged."""
    try:
        t = from_gguf(kind, data, *shape)
    except ValueError as e:
        raise ValueError(f"GGUF tensor {name!r} ({kind}) is damaged: {e}") from None
    for what, values in (("scales", t.scales), ("mins", t.mins)):
        if values is not None and not np.isfinite(values).all():
            raise ValueError(f"GGUF tensor {name!r} ({t.format}) is corrupt: its {what} are not all finite")
    return t


def _unpermute_rows(value: QuantizedTensor | Tensor, heads: int) -> QuantizedTensor | Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pairs of rotary halves interleaved) back to
    the first half then the second."""
    rows = value.shape[0]
    order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    return value.take_rows(order) if isinstance(value, QuantizedTensor) else value[torch.from_numpy(order)]


def quantized_safetensors(tensors: Iterable[tuple[str, object]], method: str) -> Iterator[tuple[str, object]]:
    """A float checkpoint's tensors with its linear weights quantized (`method`: int8 or int4)."""
    quantize = {"int8": quantize_int8, "int4": quantize_int4}[method]
    for name, tensor in tensors:
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if module in QUANTIZED_LINEARS and name.endswith(".weight"):
            full = tensor if isinstance(tensor, Tensor) else tensor[:]
            try:
                yield name, quantize(full)
            except ValueError as e:
                raise ValueError(f"quantization={method!r} cannot quantize {name}: {e}") from None
        else:
            yield name, tensor


def split_quantized(net: DecoderForCausalLM, tensors: Iterable[tuple[str, object]]
                    ) -> tuple[dict[str, QuantizedWeight], list[tuple[str, object]]]:
    """({layer path: its QuantizedWeight} for each layer of `net` whose checkpoint tensors are all
    quantized, the remaining (name, tensor) pairs for `loader.load_weights`), with the quantized
    parts of other parameters dequantized. `net` only lends its structure (the meta device will do)."""
    targets = net.checkpoint_targets()
    owners = {id(p): (path, module, leaf) for path, module in net.named_modules()
              for leaf, p in module.named_parameters(recurse=False)}
    expected: dict[int, int] = defaultdict(int)
    for target in targets.values():
        expected[id(target.param)] += 1
    by_param: dict[int, list[tuple[str, Target, QuantizedTensor]]] = defaultdict(list)
    dense: list[tuple[str, object]] = []
    quantized: dict[str, QuantizedWeight] = {}

    def settle(param_id: int) -> None:
        """Pack a parameter's parts (or dequantize them) and let go of the unpacked codes."""
        parts = by_param.pop(param_id)
        path, module, leaf = owners[param_id]
        weight = None
        if leaf == "weight" and isinstance(module, (Linear, VocabParallelEmbedding)):
            weight = _quantized_weight(parts[0][1].param, parts, expected[param_id])
        if weight is None:
            dense.extend((name, torch.from_numpy(t.dequantize())) for name, _, t in parts)
        else:
            quantized[path] = weight

    tied = net.config.tie_word_embeddings
    for name, tensor in tensors:
        if tied and name == "lm_head.weight":
            continue
        target = targets.get(name)
        if target is None or not isinstance(tensor, QuantizedTensor):
            dense.append((name, tensor))
            continue
        by_param[id(target.param)].append((name, target, tensor))
        if len(by_param[id(target.param)]) == expected[id(target.param)]:
            settle(id(target.param))  # as soon as complete: the load holds one layer's codes at a time
    for param_id in list(by_param):  # incomplete: loaded dense (load_weights names what is missing)
        settle(param_id)
    return quantized, dense


def apply_quantized(net: DecoderForCausalLM, quantized: dict[str, QuantizedWeight], dtype: torch.dtype) -> None:
    """Give each layer its quantized weight (before `DecoderForCausalLM.empty` allocates the rest)."""
    for path, weight in quantized.items():
        module = net.get_submodule(path)
        if isinstance(module, VocabParallelEmbedding):
            module.quantize(weight, dtype)
        else:
            module.quantize(weight)


def save_packed(quantized: dict[str, QuantizedWeight], dense: list[tuple[str, Tensor]], folder: Path) -> None:
    """Write quantized weights (and the dense tensors beside them) for `load_packed`."""
    from safetensors.torch import save_file

    tensors = {f"dense:{name}": t.contiguous() for name, t in dense}
    described = {}
    for path, weight in quantized.items():
        described[path] = [s.describe() for s in weight.segments]
        tensors.update({f"{path}#{i}": s.tiles for i, s in enumerate(weight.segments)})
    save_file(tensors, str(folder / "packed.safetensors"))
    (folder / "packed.json").write_text(json.dumps({"quantized": described, "dense": [n for n, _ in dense]}))


def load_packed(folder: Path) -> tuple[dict[str, QuantizedWeight], list[tuple[str, Tensor]]]:
    from safetensors.torch import load_file

    described = json.loads((folder / "packed.json").read_text())
    tensors = load_file(str(folder / "packed.safetensors"))
    quantized = {path: QuantizedWeight.from_packed(segments, [tensors[f"{path}#{i}"] for i in range(len(segments))])
                 for path, segments in described["quantized"].items()}
    return quantized, [(name, tensors[f"dense:{name}"]) for name in described["dense"]]


def _quantized_weight(param, parts: list[tuple[str, Target, QuantizedTensor]], expected: int) -> QuantizedWeight | None:
    """The parameter's QuantizedWeight, or None when its parts do not make a whole one (one of its
    `expected` parts missing, or a cut through groups): it is then loaded dense."""
    if len(parts) != expected:
        return None
    pieces, covered = [], 0
    for name, target, tensor in sorted(parts, key=lambda p: p[1].start):
        if tensor.shape != target.expected_shape():
            raise ValueError(f"checkpoint tensor {name!r} has shape {tensor.shape}, but the config implies "
                             f"{target.expected_shape()}")
        length = target.rows if target.source_dim == 0 else param.shape[1]
        try:
            pieces.append(tensor.narrow(target.source_dim, target.source_start, length))
        except ValueError:
            return None
        covered = target.start + target.rows
    if covered < param.shape[0]:  # the vocabulary's padding rows under tensor parallelism: zeros
        pieces.append(pieces[-1].zero_rows(param.shape[0] - covered))
    return QuantizedWeight.of(pieces)
