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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from pagedserve.distributed.group import TPGroup
from pagedserve.models.config import ModelConfig
from pagedserve.models.llama import DecoderForCausalLM
from pagedserve.models.loader import read_json_object
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


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype,
                 shard: TPShard) -> LoRAWeights:
    """The adapter's A and B for tensor-parallel rank `shard`, with its scaling in B, in `dtype`:
    checked as read_adapter does, and refused if a value is not finite. Each rank's slice of a
    projection is the one its base weight holds (checkpoint_targets), so the two always agree."""
    from safetensors.torch import load_file

    info, modules, file = _inspect(path, model_config, max_rank)
    cuts = _cuts(model_config, shard.rank, shard.size)
    tensors = load_file(str(file))  # the whole file: an adapter is small, and one read is fastest
    _check_finite(tensors, f"LoRA adapter {info.path}", "the adapter is damaged or its training diverged")
    weights: dict[tuple[int, str], list[tuple[Tensor, Tensor] | None]] = {}
    scaled = {}
    for m in modules:
        a, b = tensors[m.a_name], tensors[m.b_name]
        cut = cuts[m.projection]
        if cut.dim == 0:
            b = b.narrow(0, cut.start, cut.length)
        else:
            a = a.narrow(1, cut.start, cut.length)
        a = a.to(dtype).contiguous()
        scaled[m.b_name] = b = (b.to(torch.float32) * m.scaling).to(dtype)
        fused = _FUSED[m.projection]
        parts = weights.setdefault((m.layer, fused), [None] * len(FUSED_PARTS[fused]))
        parts[FUSED_PARTS[fused].index(m.projection)] = (a, b)
    _check_finite(scaled, f"LoRA adapter {info.path}",
                  f"once scaled, it overflows {str(dtype).removeprefix('torch.')}; serve the adapter in a wider dtype")
    return LoRAWeights(info.path, info.rank, weights)


def _check_finite(tensors: dict[str, Tensor], where: str, why: str) -> None:
    """ValueError naming the first tensor that holds a NaN or an infinity. Its largest magnitude
    tells (a NaN propagates through max): a quarter of torch.isfinite's cost, which would otherwise
    be most of a load's."""
    for name, t in tensors.items():
        if not math.isfinite(t.abs().max()):
            raise ValueError(f"{where}: tensor {name!r} holds values that are not finite (NaN or infinity): {why}")


def adapter_identity(path: str | Path) -> str:
    """A short digest of the adapter directory's files, for keys (cached prefixes) that must change
    when the adapter does. It covers each file's name, size and mtime, and also its inode and
    ctime: adapters of one shape have files of equal sizes, and a copy or an unpacked archive can
    carry an old mtime, but a file rewritten or replaced always gets a new ctime or inode."""
    directory = _directory(path)
    digest = hashlib.sha256(str(directory.resolve()).encode())
    for f in sorted(directory.iterdir()):
        if f.is_file():
            s = f.stat()
            digest.update(f"\0{f.name}\0{s.st_size}\0{s.st_mtime_ns}\0{s.st_ctime_ns}\0{s.st_ino}".encode())
    return digest.hexdigest()[:16]


def _directory(path: str | Path) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        what = "is a file, not" if directory.exists() else "does not exist; pass"
        raise ValueError(f"LoRA adapter {path}: {what} a directory as PEFT's save_pretrained writes it "
                         f"({CONFIG_FILE} and {WEIGHTS_FILE})")
    return directory


def _inspect(path: str | Path, config: ModelConfig, max_rank: int) -> tuple[AdapterInfo, list[_Module], Path]:
    """(what read_adapter returns, each targeted module, the safetensors file)."""
    directory = _directory(path)
    where = f"LoRA adapter {path}"
    settings = _read_settings(directory, where)
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        if (directory / PICKLE_FILE).is_file():
            raise ValueError(f"{where}: has {PICKLE_FILE} but no {WEIGHTS_FILE}; pagedserve does not load pickle "
                             "files (unpickling can run arbitrary code): save the adapter once with PEFT's "
                             "save_pretrained(..., safe_serialization=True)")
        raise ValueError(f"{where}: no {WEIGHTS_FILE} (the adapter's weights) in the directory")
    header = _read_header(file, where)

    cuts = _cuts(config, 0, 1)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, (dtype, shape) in header.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or match[3] not in PROJECTION_PARENT or match[2] != PROJECTION_PARENT[match[3]]:
            raise ValueError(f"{where}: {_unexpected_tensor(name)}")
        layer, projection, kind = int(match[1]), match[3], match[4]
        if layer >= config.num_layers:
            raise ValueError(f"{where}: tensor {name!r} is for layer {layer}, but the model has {config.num_layers} "
                             f"layers (0 to {config.num_layers - 1}): the adapter was trained for another model")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"{where}: tensor {name!r} is stored as {dtype}; LoRA weights must be float16, "
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
        r = settings.rank_pattern.get(_pattern_key(settings.rank_pattern, key), settings.r)
        alpha = settings.alpha_pattern.get(_pattern_key(settings.alpha_pattern, key), settings.lora_alpha)
        out_features, in_features = cuts[projection].shape
        for kind, expected in (("A", (r, in_features)), ("B", (out_features, r))):
            shape = header[names[kind]][1]
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
    nbytes = sum(math.prod(shape) * _DTYPE_BYTES[dtype] for dtype, shape in header.values())
    info = AdapterInfo(str(path), rank, settings.lora_alpha, settings.use_rslora,
                       tuple(p for p in PROJECTIONS if p in targeted), tuple(sorted({m.layer for m in modules})),
                       nbytes)
    return info, modules, file


class _Settings(NamedTuple):
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]


def _read_settings(directory: Path, where: str) -> _Settings:
    """adapter_config.json's settings that decide the adapter's outputs; ValueError for one that
    asks for something other than plain LoRA on the seven projections."""
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE}; an adapter directory is what PEFT's save_pretrained writes")
    try:
        config = read_json_object(file)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type is {config.get('peft_type')!r}; only LoRA adapters (peft_type "
                         "'LORA') are served")
    problems = _refusals(config)
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    r = config.get("r", _DEFAULT_R)
    alpha = config.get("lora_alpha", _DEFAULT_ALPHA)
    if not _positive_int(r):
        raise ValueError(f"{where}: r must be a positive integer, got {r!r}")
    if not _number(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    patterns = []
    for key, check, what in (("rank_pattern", _positive_int, "positive integers"),
                             ("alpha_pattern", _number, "numbers")):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(check(v) for v in pattern.values()):
            raise ValueError(f"{where}: {key} must map module names to {what}, got {pattern!r}")
        for k in pattern:
            try:
                re.compile(k)
            except re.error as e:
                raise ValueError(f"{where}: {key} key {k!r} is not a valid regular expression: {e}") from e
        patterns.append(pattern)
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
            try:
                outside = [m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)]
            except re.error as e:
                outside = [f"(an invalid regular expression: {e})"]
            if outside:
                problems.append(f"target_modules {targets!r} matches {', '.join(outside)}; {_only_projections()}")
    elif targets is not None:
        others = [t for t in targets if not (isinstance(t, str) and t.rpartition(".")[2] in PROJECTIONS)]
        if others:
            problems.append(f"target_modules names {', '.join(map(repr, others))}; {_only_projections()}")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save ({', '.join(map(str, config['modules_to_save']))}) carries fully trained "
                        f"copies of modules; {_only_projections()}")
    if config.get("trainable_token_indices"):
        problems.append(f"trainable_token_indices trains embeddings of chosen tokens; {_only_projections()}")
    if config.get("target_parameters"):
        problems.append(f"target_parameters adapts parameters rather than modules; {_only_projections()}")
    if config.get("use_dora"):
        problems.append("use_dora: DoRA adapters are not served (their magnitude vectors rescale the base weights); "
                        "merge it into the model with PEFT's merge_and_unload, or train a plain LoRA")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r}: the adapter carries trained biases, which are not served; "
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
        problems.append(f"init_lora_weights={init!r} trains against base weights PEFT changed at "
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


def _read_header(file: Path, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape) from the safetensors header; no tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as st:
            return {name: (st.get_slice(name).get_dtype(), tuple(st.get_slice(name).get_shape()))
                    for name in st.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except SafetensorError as e:  # truncated or garbage: the library's message names no file
        raise ValueError(f"{where}: {file.name} is not a valid safetensors file: {e}") from e


def _pattern_key(patterns: dict[str, Any], key: str) -> str | None:
    """The first pattern (in the config's order) that matches a module name as PEFT matches
    rank_pattern and alpha_pattern (its get_pattern_key): the pattern is a suffix of the name
    that starts after a dot, as a regular expression."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), None)


@functools.lru_cache(maxsize=32)
def _cuts(config: ModelConfig, rank: int, size: int) -> dict[str, _Cut]:
    """Each projection's whole shape and rank `rank` of `size`'s slice of it, read off the targets
    the base weights are loaded by (of one layer: every layer is cut alike)."""
    one_layer = dataclasses.replace(config, num_layers=1, sliding_windows=config.sliding_windows[:1])
    targets = DecoderForCausalLM.meta(one_layer, TPGroup(rank, size)).checkpoint_targets()
    cuts = {}
    for projection in PROJECTIONS:
        t = targets[f"model.layers.0.{PROJECTION_PARENT[projection]}.{projection}.weight"]
        length = t.rows if t.source_dim == 0 else t.param.shape[t.source_dim]
        cuts[projection] = _Cut(t.expected_shape(), t.source_dim, t.source_start, length)
    return cuts


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
