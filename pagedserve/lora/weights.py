"""PEFT LoRA adapters: checked from their config and safetensors header alone (so a server can
refuse a bad one at once), then loaded as one tensor-parallel rank's A and B per projection.

An adapter is a directory as PEFT's save_pretrained writes it: adapter_config.json and
adapter_model.safetensors, whose tensors are named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (A: [r, in_features]) and
`....lora_B.weight` (B: [out_features, r]). The output of a projection gains
(x @ A^T @ B^T) * scaling, with scaling = lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA;
rank_pattern and alpha_pattern set r and lora_alpha per module, matched as PEFT matches them.
Only plain LoRA on the seven attention and MLP projections is served: anything else an adapter
could carry (DoRA, biases, trained embeddings or heads, other variants) is refused by name, since
serving it without would silently give other outputs than PEFT's. Pickle files (.bin) are not read.

Every read is bounded (`lora/files.py`): the config at MAX_CONFIG_BYTES; the safetensors header at
what the model can hold (`header_bounds`); the tensors' bytes at what the checked shapes take. The
directory is never listed: its two files are opened by name.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pagedserve.distributed.group import TPGroup
from pagedserve.lora import files
from pagedserve.lora.files import MAX_CONFIG_BYTES, MAX_HEADER_BYTES, HeaderEntry
from pagedserve.lora.patterns import pattern_problem, suffix_matcher, suffix_matches
from pagedserve.models.config import ModelConfig
from pagedserve.models.llama import DecoderForCausalLM
from pagedserve.models.sharding import TPShard

FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PROJECTIONS = tuple(p for parts in FUSED_PARTS.values() for p in parts)  # the 7 PEFT target names

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
# Each projection's parent module in a decoder layer (self_attn or mlp), as checkpoints name them.
PROJECTION_PARENT = {p: "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
                     for fused, parts in FUSED_PARTS.items() for p in parts}
_FUSED = {p: fused for fused, parts in FUSED_PARTS.items() for p in parts}
_PREFIX = "base_model.model."  # PeftModel's own prefix: PeftModel.from_pretrained loads no other names
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
# The safetensors header's bounds (`header_bounds`): a PEFT adapter of all 7 projections holds 2
# tensors per projection and layer, each ~130 bytes of header. The headroom lets an adapter with
# more (DoRA's magnitude vectors, biases, a few trained modules) be refused by what it holds.
_TENSORS_HEADROOM, _TENSORS_SLACK = 4, 256
_HEADER_BYTES_PER_TENSOR, _HEADER_SLACK_BYTES = 1024, 64 << 10
_LIST = ", ".join(PROJECTIONS)
# PEFT's defaults for keys an adapter_config.json may leave out (LoraConfig's fields).
_DEFAULT_R, _DEFAULT_ALPHA = 8, 8


@dataclass
class LoRAWeights:
    """One adapter's weights for one tensor-parallel rank, ready to copy into a slot."""
    path: str
    rank: int   # the largest rank among its modules (<= max_lora_rank)
    # (layer index, fused module name) -> one entry per part, in FUSED_PARTS order:
    # (A [r, in_features_of_this_rank], B [out_features_of_this_rank_for_the_part, r]) with the
    # scaling (lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA) already multiplied into B,
    # in the dtype asked for, on CPU; None for a part the adapter does not target.
    # A fused module none of whose parts is targeted is absent from the dict.
    modules: dict[tuple[int, str], list[tuple[Tensor, Tensor] | None]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.modules.values() for ab in parts if ab
                   for t in ab)


@dataclass(frozen=True)
class AdapterInfo:
    """What read_adapter found in an adapter directory, its tensors unread."""
    path: str
    rank: int                       # the largest rank among its modules
    lora_alpha: float               # the config's; alpha_pattern may set others per module
    use_rslora: bool
    projections: tuple[str, ...]    # the targeted ones, in PROJECTIONS order
    layers: tuple[int, ...]         # the layers with at least one targeted projection, ascending
    nbytes: int                     # its tensors' bytes as stored


class _Module(NamedTuple):
    """One targeted projection of one layer: where its tensors are, and how B is scaled."""
    layer: int
    projection: str
    a_name: str
    b_name: str
    rank: int
    scaling: float


class _Cut(NamedTuple):
    """A projection's whole weight shape [out, in], and the slice of it one rank holds along `dim`
    (0: its output rows, which cut B; 1: its input columns, which cut A)."""
    shape: tuple[int, int]
    dim: int
    start: int
    length: int


def read_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> AdapterInfo:
    """Check an adapter directory against the model from its config and its safetensors header,
    without reading a tensor. ValueError saying what is wrong and what to do about it."""
    return _inspect(path, model_config, max_rank)[0]


def verify_adapter(path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype) -> AdapterInfo:
    """Every check load_adapter makes, its values' included, with the weights then dropped: for a
    front that registers an adapter which another process (the engine core, each tensor-parallel
    rank) reads for itself, so that a bad one is refused when it is registered rather than failing
    every request for it. The whole adapter: every rank's shard is part of it."""
    info, modules, tensors = _inspect(path, model_config, max_rank, read_values=True)
    for _ in _shard_parts(info, modules, tensors, model_config, dtype, TPShard.of(model_config)):
        pass
    return info


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 shard: TPShard) -> LoRAWeights:
    """The adapter's A and B for tensor-parallel rank `shard`, with its scaling in B, in `dtype`:
    checked as read_adapter does, and refused if a value is not finite. Each rank's slice of a
    projection is the one its base weight holds (checkpoint_targets), so the two always agree."""
    info, modules, tensors = _inspect(path, model_config, max_rank, read_values=True)
    weights: dict[tuple[int, str], list[tuple[Tensor, Tensor] | None]] = {}
    for m, a, b in _shard_parts(info, modules, tensors, model_config, dtype, shard):
        fused = _FUSED[m.projection]
        parts = weights.setdefault((m.layer, fused), [None] * len(FUSED_PARTS[fused]))
        parts[FUSED_PARTS[fused].index(m.projection)] = (a, b)
    return LoRAWeights(info.path, info.rank, weights)


def _shard_parts(info: AdapterInfo, modules: list[_Module], tensors: dict[str, Tensor], config: ModelConfig,
                 dtype: torch.dtype, shard: TPShard) -> Iterator[tuple[_Module, Tensor, Tensor]]:
    """Each module's (A, B * scaling) in `dtype`, cut for `shard`, after its values are checked:
    every stored tensor finite, and each whole scaled B finite in `dtype` (whole: every rank
    refuses an adapter alike, so that one rank's check stands for all)."""
    where = f"LoRA adapter {files.shown(info.path)}"
    _check_finite(tensors, where, "the adapter is damaged or its training diverged")
    cuts = _cuts(config, shard.rank, shard.size)
    overflow = f"once scaled, it overflows {str(dtype).removeprefix('torch.')}; serve the adapter in a wider dtype"
    for m in modules:
        a = tensors[m.a_name]
        b = (tensors[m.b_name].to(torch.float32) * m.scaling).to(dtype)
        _check_finite({m.b_name: b}, where, overflow)
        cut = cuts[m.projection]
        if cut.dim == 0:
            b = b.narrow(0, cut.start, cut.length).clone()
        else:
            a = a.narrow(1, cut.start, cut.length)
        a = a.to(dtype, copy=True).contiguous()  # (a copy: the stored tensors are views of the file's bytes)
        yield m, a, b


def _check_finite(tensors: dict[str, Tensor], where: str, why: str) -> None:
    """ValueError naming the first tensor that holds a NaN or an infinity. Its largest magnitude
    tells (a NaN propagates through max): a quarter of torch.isfinite's cost, which would otherwise
    be most of a load's."""
    for name, t in tensors.items():
        if not math.isfinite(t.abs().max()):
            raise ValueError(f"{where}: tensor {name!r} holds values that are not finite (NaN or infinity): {why}")


def adapter_identity(path: str | Path) -> str:
    """A short digest of the adapter's two files, for keys (cached prefixes) that must change when
    the adapter does. It covers each file's size and mtime, and also its device, inode and ctime:
    adapters of one shape have files of equal sizes, and a copy or an unpacked archive can carry
    an old mtime, but a file rewritten or replaced always gets a new ctime or inode. Computed for
    every request on the core's step loop: a stat of the directory and of each file, no listing."""
    where = f"LoRA adapter {files.shown(path)}"
    directory = files.check_directory(str(path), where, _ADAPTER_DIRECTORY)
    digest = hashlib.sha256(os.fsencode(os.path.realpath(directory)))
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            s = os.stat(directory / name)
        except OSError as e:  # missing or unreadable: reading the adapter says why
            digest.update(f"\0{name}\0{errno.errorcode.get(e.errno, e.errno)}".encode())
            continue
        digest.update(f"\0{name}\0{s.st_size}\0{s.st_mtime_ns}\0{s.st_ctime_ns}\0{s.st_dev}\0{s.st_ino}".encode())
    return digest.hexdigest()[:16]


_ADAPTER_DIRECTORY = f"a directory as PEFT's save_pretrained writes it ({CONFIG_FILE} and {WEIGHTS_FILE})"


def header_bounds(config: ModelConfig) -> tuple[int, int, str]:
    """(the most bytes, the most tensors) an adapter's safetensors header may hold for this model,
    and the bounds in words: the tensors a LoRA of every projection of every layer holds, with
    headroom, and their header at a generous size each, never above MAX_HEADER_BYTES."""
    lora_tensors = 2 * len(PROJECTIONS) * config.num_layers
    max_tensors = _TENSORS_HEADROOM * lora_tensors + _TENSORS_SLACK
    max_bytes = min(MAX_HEADER_BYTES, max_tensors * _HEADER_BYTES_PER_TENSOR + _HEADER_SLACK_BYTES)
    words = (f"a LoRA adapter of all {len(PROJECTIONS)} projections of this model's {config.num_layers} layers holds "
             f"{lora_tensors:,} tensors; the bounds allow {max_tensors:,} tensors and {max_bytes:,} bytes of header")
    return max_bytes, max_tensors, words


def _inspect(path: str | Path, config: ModelConfig, max_rank: int, read_values: bool = False
             ) -> tuple[AdapterInfo, list[_Module], dict[str, Tensor]]:
    """(what read_adapter returns, each targeted module, the stored tensors by name if
    `read_values`, else {}). The header and the tensors are read through one descriptor, so they
    are of one file even if it is replaced meanwhile."""
    where = f"LoRA adapter {files.shown(path)}"
    directory = files.check_directory(str(path), where, _ADAPTER_DIRECTORY)
    settings = _read_settings(directory, where, config.num_layers)
    file = directory / WEIGHTS_FILE
    with files.open_regular(file, where) as opened:
        if opened is None:
            if _exists(directory / PICKLE_FILE):
                raise ValueError(f"{where}: has {PICKLE_FILE} but no {WEIGHTS_FILE}; pagedserve does not load pickle "
                                 "files (unpickling can run arbitrary code): save the adapter once with PEFT's "
                                 "save_pretrained(..., safe_serialization=True)")
            raise ValueError(f"{where}: no {WEIGHTS_FILE} (the adapter's weights) in the directory")
        fd, st = opened
        header = files.read_safetensors_header(fd, st.st_size, file, where, *header_bounds(config))
        info, modules = _check_header(header.entries, settings, config, max_rank, str(path), where)
        tensors = _read_tensors(fd, header, file, where) if read_values else {}
    return info, modules, tensors


def _check_header(header: dict[str, HeaderEntry], settings: _Settings, config: ModelConfig, max_rank: int,
                  path: str, where: str) -> tuple[AdapterInfo, list[_Module]]:
    """The adapter's modules from its tensors' names, dtypes and shapes, against the model."""
    cuts = _cuts(config, 0, 1)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or match[3] not in PROJECTION_PARENT or match[2] != PROJECTION_PARENT[match[3]]:
            raise ValueError(f"{where}: {_unexpected_tensor(name)}")
        layer, projection, kind = int(match[1]), match[3], match[4]
        if layer >= config.num_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}, but the model has {config.num_layers} "
                             f"layers (0 to {config.num_layers - 1}): the adapter was trained for another model")
        if entry.dtype not in _DTYPE_BYTES:
            raise ValueError(f"{where}: tensor {name!r} is stored as {entry.dtype}; LoRA weights must be float16, "
                             "bfloat16, float32 or float64")
        found.setdefault((layer, projection), {})[kind] = name
    if not found:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")

    modules = []
    for (layer, projection), names in sorted(found.items(), key=lambda kv: (kv[0][0], PROJECTIONS.index(kv[0][1]))):
        for kind, other in (("A", "B"), ("B", "A")):
            if kind not in names:
                raise ValueError(f"{where}: tensor {names[other]!r} has no lora_{kind} beside it: each targeted "
                                 "projection needs both lora_A and lora_B")
        # the name PEFT matches patterns on
        key = f"model.layers.{layer}.{PROJECTION_PARENT[projection]}.{projection}"
        r = _first_match(settings.rank_pattern, key, settings.r)
        alpha = _first_match(settings.alpha_pattern, key, settings.lora_alpha)
        out_features, in_features = cuts[projection].shape
        for kind, expected in (("A", (r, in_features)), ("B", (out_features, r))):
            shape = header[names[kind]].shape
            if shape != expected:
                raise ValueError(f"{where}: tensor {names[kind]!r} has shape {list(shape)}, but the model's "
                                 f"{projection} ({in_features} in, {out_features} out) at rank {r} needs "
                                 f"{list(expected)}: the adapter was trained for another model (or its config's "
                                 "r / rank_pattern disagrees with its weights)")
        scaling = alpha / math.sqrt(r) if settings.use_rslora else alpha / r
        modules.append(_Module(layer, projection, names["A"], names["B"], r, scaling))

    rank = max(m.rank for m in modules)
    if rank > max_rank:
        raise ValueError(f"{where}: its rank {rank} is above max_lora_rank={max_rank}; raise the max_lora_rank "
                         f"setting to at least {rank} to serve it")
    targeted = {m.projection for m in modules}
    nbytes = sum(entry.end - entry.start for entry in header.values())
    info = AdapterInfo(path, rank, settings.lora_alpha, settings.use_rslora,
                       tuple(p for p in PROJECTIONS if p in targeted), tuple(sorted({m.layer for m in modules})),
                       nbytes)
    return info, modules


def _read_tensors(fd: int, header: files.SafetensorsHeader, file: Path, where: str) -> dict[str, Tensor]:
    """The stored tensors, views of one read of the file's data (its size: what the checked shapes
    take, so bounded by the model and max_lora_rank)."""
    data = files.read_exactly(fd, header.data_start, header.data_size, file, where)
    tensors = {}
    for name, entry in header.entries.items():
        dtype, itemsize = _TORCH_DTYPES[entry.dtype], _DTYPE_BYTES[entry.dtype]
        source, offset = data, entry.start
        if offset % itemsize:  # a misaligned tensor is copied out (a view must be aligned to its element)
            source, offset = bytearray(data[entry.start:entry.end]), 0
        tensors[name] = torch.frombuffer(source, dtype=dtype, count=math.prod(entry.shape),
                                         offset=offset).reshape(entry.shape)
    return tensors


def _exists(file: Path) -> bool:
    try:
        os.stat(file)
    except OSError:
        return False
    return True


class _Settings(NamedTuple):
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[re.Pattern, int]  # by each key compiled (`patterns.suffix_matcher`), in the config's order
    alpha_pattern: dict[re.Pattern, float]


def _read_settings(directory: Path, where: str, num_layers: int) -> _Settings:
    """adapter_config.json's settings that decide the adapter's outputs; ValueError for one that
    asks for something other than plain LoRA on the seven projections. Its patterns are bounded
    in number (by the model's `num_layers`) and in the work each takes to match."""
    max_patterns = _TENSORS_HEADROOM * len(PROJECTIONS) * num_layers + _TENSORS_SLACK
    file = directory / CONFIG_FILE
    with files.open_regular(file, where) as opened:
        if opened is None:
            raise ValueError(f"{where}: no {CONFIG_FILE}; an adapter directory is what PEFT's save_pretrained writes")
        bound = f"{MAX_CONFIG_BYTES >> 20} MiB, the bound on an adapter's config; PEFT writes a few KiB"
        data = files.read_at_most(opened[0], MAX_CONFIG_BYTES, file, where, bound)
    config = files.parse_json_object(data, f"{where}: {CONFIG_FILE}")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type is {_short(config.get('peft_type'))}; only LoRA adapters (peft_type "
                         "'LORA') are served")
    problems = _refusals(config)
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    r = config.get("r", _DEFAULT_R)
    alpha = config.get("lora_alpha", _DEFAULT_ALPHA)
    if not _positive_int(r):
        raise ValueError(f"{where}: r must be a positive integer, got {_short(r)}")
    if not _number(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {_short(alpha)}")
    patterns = []
    for key, check, what in (("rank_pattern", _positive_int, "positive integers"),
                             ("alpha_pattern", _number, "numbers")):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(check(v) for v in pattern.values()):
            raise ValueError(f"{where}: {key} must map module names to {what}, got {_short(pattern)}")
        if len(pattern) > max_patterns:
            raise ValueError(f"{where}: {key} has {len(pattern):,} keys, above the bound of {max_patterns:,} for "
                             f"this model ({len(PROJECTIONS)} projections in each of its {num_layers} layers, with "
                             "headroom)")
        for k in pattern:
            problem = pattern_problem(k, suffix=True)
            if problem is not None:
                raise ValueError(f"{where}: {key} key {_short(k)} {problem}")
        patterns.append({suffix_matcher(k): v for k, v in pattern.items()})
    return _Settings(r, alpha, bool(config.get("use_rslora", False)), *patterns)


# init_lora_weights values whose training starts from base weights PEFT changed (the residual of
# an SVD, a quantized copy), which the stored base model no longer has.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_CONVERT = ("save it from PEFT with save_pretrained(..., path_initial_model_for_weight_conversion=...) to "
            "get a plain LoRA of the original model")
_VARIANTS = ("alora_invocation_tokens", "use_bdlora", "arrow_config", "kasa_config", "monteclora_config", "use_qalora")


def _refusals(config: dict[str, Any]) -> list[str]:
    """Why each setting that plain LoRA on the seven projections cannot honour is refused."""
    problems = []
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets.lower() != "all-linear":  # PEFT's shorthand leaves out the output layer
            problem = pattern_problem(targets, suffix=False)
            if problem is not None:
                problems.append(f"target_modules {_short(targets)} {problem}")
            else:
                outside = [m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)]
                if outside:
                    problems.append(f"target_modules {targets!r} matches {', '.join(outside)}; {_only_projections()}")
    elif isinstance(targets, list):
        others = [t for t in targets if not (isinstance(t, str) and t.rpartition(".")[2] in PROJECTIONS)]
        if others:
            named = _short(", ".join(map(repr, others)), quote=False)
            problems.append(f"target_modules names {named}; {_only_projections()}")
    elif targets is not None:
        problems.append(f"target_modules must be a list of module names or one regular expression, got "
                        f"{_short(targets)}")
    saved = config.get("modules_to_save")
    if saved:
        listed = ", ".join(map(str, saved)) if isinstance(saved, list) else str(saved)
        problems.append(f"modules_to_save ({_short(listed, quote=False)}) carries fully trained copies of modules; "
                        f"{_only_projections()}")
    if config.get("trainable_token_indices"):
        problems.append(f"trainable_token_indices trains embeddings of chosen tokens; {_only_projections()}")
    if config.get("target_parameters"):
        problems.append(f"target_parameters adapts parameters rather than modules; {_only_projections()}")
    if config.get("use_dora"):
        problems.append("use_dora: DoRA adapters are not served (their magnitude vectors rescale the base weights); "
                        "merge it into the model with PEFT's merge_and_unload, or train a plain LoRA")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={_short(config['bias'])}: the adapter carries trained biases, which are not served; "
                        "train with bias='none', or merge it into the model with PEFT's merge_and_unload")
    if config.get("lora_bias"):
        problems.append("lora_bias: LoRA B with a bias is not served; train with lora_bias=False, or merge it into "
                        "the model with PEFT's merge_and_unload")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out is set: that layout is for GPT-2's Conv1D layers, and this model's "
                        "projections are Linear; save the adapter with fan_in_fan_out=False")
    if config.get("layer_replication"):
        problems.append("layer_replication stacks copies of layers, which the served model does not have")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        problems.append(f"init_lora_weights={_short(init)} trains against base weights PEFT changed at "
                        f"initialisation, which the served model does not have; {_CONVERT}")
    problems += [f"{key} is set: a LoRA variant that is not served; train a plain LoRA" for key in _VARIANTS
                 if config.get(key)]
    return problems


def _only_projections() -> str:
    return (f"only the attention and MLP projections ({_LIST}) can carry LoRA here, not embeddings, the LM head or "
            "other modules; train the adapter with target_modules among those")


def _unexpected_tensor(name: str) -> str:
    """Why a tensor is not one the adapter may hold, with what to do."""
    what = f"tensor {name!r} is not the lora_A or lora_B weight of a decoder layer's projection ({_LIST})"
    if "lora_magnitude_vector" in name:
        return f"{what}: it is DoRA's magnitude vector, and DoRA adapters are not served; train a plain LoRA"
    if "embed_tokens" in name or "lm_head" in name or "lora_embedding" in name or "trainable_tokens" in name:
        return f"{what}; {_only_projections()}"
    if "modules_to_save" in name or ".lora_" not in name:
        return f"{what}: it looks like a fully trained module (modules_to_save); {_only_projections()}"
    if name.endswith(".bias"):
        return f"{what}: it is a bias, which is not served; train with bias='none' and lora_bias=False"
    if not name.startswith(_PREFIX):
        return (f"{what}: its name lacks the {_PREFIX!r} prefix PEFT's save_pretrained writes (PEFT's "
                "PeftModel.from_pretrained would not load it either); save the adapter with PEFT")
    return f"{what} as PEFT names them (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight)"


def _first_match(patterns: dict[re.Pattern, Any], key: str, default: Any) -> Any:
    """The value of the first pattern (in the config's order) that matches a module name as PEFT
    matches rank_pattern and alpha_pattern (its get_pattern_key), else `default`."""
    return next((value for matcher, value in patterns.items() if suffix_matches(matcher, key)), default)


@functools.lru_cache(maxsize=32)
def _cuts(config: ModelConfig, rank: int, size: int) -> dict[str, _Cut]:
    """Each projection's whole shape and rank `rank` of `size`'s slice of it, read off the targets
    the base weights are loaded by (of one layer: every layer is cut alike)."""
    one_layer = dataclasses.replace(config, num_layers=1, sliding_windows=config.sliding_windows[:1],
                                    rope_layers=config.rope_layers[:1])
    targets = DecoderForCausalLM.meta(one_layer, TPGroup(rank, size)).checkpoint_targets()
    cuts = {}
    for projection in PROJECTIONS:
        t = targets[f"model.layers.0.{PROJECTION_PARENT[projection]}.{projection}.weight"]
        length = t.rows if t.source_dim == 0 else t.param.shape[t.source_dim]
        cuts[projection] = _Cut(t.expected_shape(), t.source_dim, t.source_start, length)
    return cuts


def _short(value: Any, quote: bool = True) -> str:
    """A config's value as a message shows it: its repr, cut short past a few hundred characters."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= 200 else f"{text[:160]}... ({len(text):,} characters)"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
