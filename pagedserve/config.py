"""EngineConfig: every engine setting, resolved once at start.

Each field carries its command-line help (and choices) as metadata: `pagedserve`'s engine flags are
made from these fields, so the two cannot disagree. torch is imported only where a setting is
resolved, so that building those flags does not load it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from pagedserve.kv.groups import KVLayout

if TYPE_CHECKING:
    import torch

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of the embedded model in float32
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
EXECUTOR_BACKENDS = ("auto", "mp", "external")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
KV_OFFLOAD_POLICIES = ("write_through", "evicted")
PREEMPTION_MODES = ("auto", "recompute", "swap")
DEFAULT_KV_OFFLOAD_BYTES = 16 << 30  # 16 GiB of files: ~350k tokens of the embedded model in float32


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys: a proposer guesses up to `num_speculative_tokens`
    tokens per request, one forward pass of the model scores them all, and the verifier keeps the
    longest prefix the model agrees with plus one token of its own (the output is the same)."""

    method: str  # ngram: prompt lookup; suffix: suffix trees over the request and recent outputs;
    #              draft_model: a smaller model with the same tokenizer
    num_speculative_tokens: int | None = None  # the most drafts per request per step (suffix: default 8)
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix of the tokens looked up earlier
    prompt_lookup_max: int | None = None  # ngram: the longest
    model: str | None = None  # draft_model: its HF directory or .gguf file
    quantization: str | None = None  # draft_model: its weight format (as EngineConfig.quantization)
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest context matched
    suffix_decoding_max_cached_requests: int = 1000  # suffix: finished outputs kept to propose from
    suffix_decoding_min_token_prob: float = 0.1  # suffix: a continuation less frequent ends the draft
    # Speculation stops for a step whose running requests exceed this: steps that large are bound by
    # arithmetic, where verifying drafts costs as much as it saves. None: the measured default
    # (DEFAULT_SPECULATION_MAX_BATCH).
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From a JSON object's text (the command line), a dict (`LLM(speculative_config=...)`) or
        itself. ValueError for an unknown key or a bad value."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a method: one of {', '.join(SPECULATIVE_METHODS)}")
        return cls(**value)

    def __post_init__(self) -> None:
        def positive_int(name: str, value, limit: int | None = None) -> None:
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1
                                      or (limit is not None and value > limit)):
                bound = f" and <= {limit}" if limit else ""
                raise ValueError(f"speculative_config: {name} must be an integer >= 1{bound}, got {value!r}")

        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        positive_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if self.num_speculative_tokens is None and self.method != "suffix":
            raise ValueError(f"speculative_config: method {self.method!r} needs num_speculative_tokens")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth",
                     "suffix_decoding_max_cached_requests", "disable_by_batch_size"):
            positive_int(name, getattr(self, name))
        if self.method == "ngram":
            low = self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP[0]
            high = self.prompt_lookup_max or max(low, DEFAULT_PROMPT_LOOKUP[1])
            if low > high:
                raise ValueError(f"speculative_config: prompt_lookup_min ({low}) > prompt_lookup_max ({high})")
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram'")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs model (the draft's checkpoint)")
            if self.quantization is not None and self.quantization not in QUANTIZATIONS:
                raise ValueError(f"speculative_config: quantization must be one of {', '.join(QUANTIZATIONS)}; "
                                 f"got {self.quantization!r}")
        elif self.model is not None or self.quantization is not None:
            raise ValueError("speculative_config: model and quantization are for method 'draft_model'")
        if self.method == "suffix" and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", DEFAULT_SUFFIX_TOKENS)
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_decoding_min_token_prob!r}")

    @property
    def max_batch(self) -> int:
        return self.disable_by_batch_size or DEFAULT_SPECULATION_MAX_BATCH


DEFAULT_PROMPT_LOOKUP = (2, 5)  # ngram: (prompt_lookup_min, prompt_lookup_max) when neither is given
DEFAULT_SUFFIX_TOKENS = 8
# See SpeculativeConfig.disable_by_batch_size. Measured by `pagedserve bench spec`'s cost curve: up to
# 16 rows a decode step of the embedded model on the 2-core CPU stays under twice a one-row step.
DEFAULT_SPECULATION_MAX_BATCH = 16


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineConfig:
    model: str | None = _setting(None, "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    dtype: str = _setting("auto", "weights' and activations' dtype; auto: float32 on CPU, bfloat16 on CUDA", DTYPES)
    device: str = _setting("auto", "cpu, cuda, cuda:N; auto: cuda when available, else cpu")
    quantization: str = _setting(
        "auto", "weight format: auto (a GGUF's quantized tensors run as stored, other checkpoints in --dtype), none "
        "(every weight dequantized to --dtype: the exact reference), int8 / int4 (quantize a float checkpoint's "
        "linear weights at load: int8 per output channel, int4 per group of 32)", QUANTIZATIONS)
    block_size: int = _setting(16, "tokens per KV block")
    num_kv_blocks: int | None = _setting(None, "KV blocks in the pool (overrides --kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int | None = _setting(
        None, "bytes for the KV pool (default: 1 GiB on CPU; on CUDA, what --gpu-memory-utilization leaves)")
    kv_cache_dtype: str = _setting(
        "auto", "KV cache element type: auto (the model's dtype) or fp8 (e4m3, per-tensor scales)", KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _setting(
        False, "fp8 KV cache: set each layer's scales from the first forward pass (else 1.0)")
    gpu_memory_utilization: float = _setting(
        0.9, "CUDA: the share of the GPU's memory the engine may take, weights, activations and KV cache all told")
    enforce_eager: bool = _setting(False, "run decode steps eagerly: no CUDA graphs, no CPU replays (cpu_graphs.py)")
    max_num_seqs: int = _setting(256, "the most requests (sequences) running at once")
    max_num_batched_tokens: int = _setting(2048, "the most tokens one step computes (prompts are chunked to fit)")
    max_model_len: int | None = _setting(None, "the longest prompt + output (default: the model's context, "
                                               "capped by the KV pool)")
    enable_prefix_caching: bool = _setting(True, "share the KV blocks of common prompt prefixes across requests")
    disable_hybrid_kv_cache: bool = _setting(
        False, "keep every layer's K/V for every token, sliding windows only masked (one block table per "
        "request), instead of a table per KV cache group whose sliding windows free their blocks")
    attention_backend: str = _setting(
        "auto", "torch (the CPU path, with a C decode kernel), triton (GPU kernels); auto: triton on CUDA when "
        "installed, else torch", ATTENTION_BACKENDS)
    seed: int = _setting(0, "the engine's seed for requests that set none")
    tensor_parallel_size: int = _setting(1, "split the model over this many processes (tensor parallelism)")
    distributed_executor_backend: str = _setting(
        "auto", "tensor parallelism: mp (spawn the other ranks here) or external (they were started apart, by "
        "`pagedserve worker` or torchrun: env:// rendezvous); auto: external when RANK and WORLD_SIZE are set",
        EXECUTOR_BACKENDS)
    distributed_timeout: float = _setting(
        300.0, "tensor parallelism: seconds a collective may wait for the other ranks before the engine fails")
    speculative_config: str | dict | SpeculativeConfig | None = _setting(
        None, "speculative decoding, a JSON object with vLLM's keys: method (ngram, suffix, draft_model), "
        "num_speculative_tokens, prompt_lookup_min/max (ngram), model and quantization (draft_model)")
    grammar_compile_timeout: float = _setting(
        10.0, "structured output: seconds of CPU time a request's grammar may take to compile before the request fails "
        "with a 400 (it waits at most 6 times that in all, however busy the machine)")
    kv_offload_dir: str | None = _setting(
        None, "a directory for a second KV tier behind the pool: full blocks are written there as files and read "
        "back on a prefix-cache miss, also by a later process on the same model (off unless set)")
    kv_offload_bytes: int | None = _setting(
        None, f"the KV tier's size bound; the least recently used blocks go first (default "
        f"{DEFAULT_KV_OFFLOAD_BYTES >> 30} GiB)")
    kv_offload_policy: str = _setting(
        "evicted", "which blocks the KV tier receives: evicted (a cached block as the pool evicts it, or shuts "
        "down, when hit at least --kv-offload-min-hits times) or write_through (every full block once computed: "
        "nothing is lost to a crash, at the cost of writing blocks that are never read)", KV_OFFLOAD_POLICIES)
    kv_offload_min_hits: int = _setting(0, "kv_offload_policy=evicted: the prefix-cache hits a block needs to be kept")
    kv_offload_read_timeout: float = _setting(
        5.0, "seconds a request waits for its blocks to be read from the KV tier before they are computed instead; "
        "a file read stuck that long (a hung filesystem) stops the tier's reads until it returns")
    preemption_mode: str = _setting(
        "auto", "what a preempted request loses: recompute (its blocks are freed and computed again), swap (its full "
        "blocks are written to the KV tier and read back when it resumes; needs --kv-offload-dir) or auto (swap "
        "with a KV tier, by the request's size; else recompute)", PREEMPTION_MODES)
    enable_lora: bool = _setting(False, "serve LoRA adapters: requests name one (LoRARequest; a server's --lora-modules)")
    max_loras: int = _setting(1, "LoRA: the adapters one step may use, each in a slot of the model's")
    max_lora_rank: int = _setting(16, "LoRA: the largest adapter rank served (the slots' size)")
    max_cpu_loras: int | None = _setting(
        None, "LoRA: the adapters kept loaded in host memory, ready to copy into a slot (default: max_loras)")

    def __post_init__(self) -> None:
        import torch

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.attention_backend = resolve_attention_backend(self.attention_backend, torch.device(self.device))
        self.distributed_executor_backend = resolve_executor_backend(self.distributed_executor_backend)
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        kv_dtype = self.kv_torch_dtype  # a ValueError for a name it does not know, or a float type not the model's
        if self.calculate_kv_scales and kv_dtype != torch.float8_e4m3fn:
            raise ValueError("calculate_kv_scales needs kv_cache_dtype='fp8'")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_kv_offload()
        self._check_lora()

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.speculative_config is not None and \
                self.speculative_config.method == "draft_model":
            raise ValueError("enable_lora cannot be used with a draft model: the draft would propose without the "
                             "request's adapter")

    def _check_kv_offload(self) -> None:
        if self.kv_offload_policy not in KV_OFFLOAD_POLICIES:
            raise ValueError(f"kv_offload_policy must be one of {', '.join(KV_OFFLOAD_POLICIES)}; "
                             f"got {self.kv_offload_policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {self.preemption_mode!r}")
        if not self.kv_offload_read_timeout > 0:
            raise ValueError(f"kv_offload_read_timeout must be > 0 seconds, got {self.kv_offload_read_timeout}")
        if self.kv_offload_min_hits < 0:
            raise ValueError(f"kv_offload_min_hits must be >= 0, got {self.kv_offload_min_hits}")
        if self.kv_offload_dir is None:
            if self.kv_offload_bytes is not None:
                raise ValueError("kv_offload_bytes bounds the KV tier: set kv_offload_dir too")
            if self.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' writes preempted requests to the KV tier: set kv_offload_dir")
            return
        if self.kv_offload_bytes is None:
            self.kv_offload_bytes = DEFAULT_KV_OFFLOAD_BYTES
        if self.kv_offload_bytes < 1:
            raise ValueError(f"kv_offload_bytes must be >= 1, got {self.kv_offload_bytes}")
        # The tier is keyed by the prefix cache's block hashes.
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir needs enable_prefix_caching: the KV tier is keyed by its block hashes")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_offload_dir is not supported with tensor_parallel_size > 1 (each rank holds a "
                             "share of every block)")
        if self.calculate_kv_scales:
            raise ValueError("kv_offload_dir cannot be used with calculate_kv_scales: a block written under one "
                             "process's scales would be read under another's")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError("kv_offload_dir cannot be used with a draft model yet: its K/V shares the pool's "
                             "blocks and is not written to the tier")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type (raises ValueError for an unknown kv_cache_dtype)."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def measures_kv_budget(self) -> bool:
        """Whether the KV pool's size comes from profiling free GPU memory (CUDA, no size given)."""
        return self.device.startswith("cuda") and self.num_kv_blocks is None and self.kv_cache_memory_bytes is None

    def resolve_kv_pool(self, kv_bytes_per_token: int, model_max_len: int,
                        measured_budget: int | None = None, layout: KVLayout | None = None) -> tuple[int, int]:
        """(num_kv_blocks, max_model_len) for a model with this KV footprint (bytes of one token
        slot of a block) and context. measured_budget: the bytes profiling found free on a GPU (see
        `measures_kv_budget`); layout: the model's KV cache groups (default: one full-attention group),
        which decide how long a request the pool holds."""
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            budget = self.kv_cache_memory_bytes or measured_budget or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // (kv_bytes_per_token * self.block_size)
            if num_blocks < 1:
                source = "kv_cache_memory_bytes" if self.kv_cache_memory_bytes else "the KV budget"
                raise ValueError(f"{source} ({budget} bytes) holds no block of {self.block_size} tokens")
        layout = layout or KVLayout.uniform(1)
        limit = max(model_max_len, self.max_model_len or 0)
        capacity = layout.max_tokens(num_blocks, self.block_size, self.max_num_batched_tokens, limit)
        if self.max_model_len is None:
            if capacity < 1:
                raise ValueError(f"the KV pool ({num_blocks} blocks) holds no request of the model's KV cache groups")
            return num_blocks, min(model_max_len, capacity)
        if self.max_model_len > capacity:
            holds = f"{num_blocks} blocks x {self.block_size} = {num_blocks * self.block_size} tokens" \
                if layout.num_groups == 1 else f"{num_blocks} blocks over {layout.num_groups} KV cache groups"
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV pool holds "
                f"({holds}, at most {capacity} tokens): "
                "raise num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        self.check_max_model_len(model_max_len)
        return num_blocks, self.max_model_len

    def check_max_model_len(self, model_max_len: int) -> None:
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context ({model_max_len})")


def resolve_dtype(name: str, device: str) -> str:
    """The model's dtype: "auto" is bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {name!r}")
    return name


def resolve_executor_backend(name: str) -> str:
    """"auto" -> "external" when torch.distributed's env:// variables name this process's rank
    (torchrun, `pagedserve worker`'s driver), else "mp"."""
    if name not in EXECUTOR_BACKENDS:
        raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, got {name!r}")
    if name == "auto":
        return "external" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "mp"
    return name


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "torch"; a backend that cannot run
    here is a ValueError that says why."""
    triton_installed = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_installed else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "triton" and not triton_installed:
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton)")
    return name  # whether Triton runs on this device (and with this KV format) the backend checks itself


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: "auto" (or the model's dtype by name) follows the model; "fp8" is
    e4m3. Another float type than the model's is refused: the K/V written are the model's."""
    import torch

    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    if name.startswith("fp8"):
        return torch.float8_e4m3fn
    if name != "auto" and getattr(torch, name) != model_dtype:
        raise ValueError(f"kv_cache_dtype={name!r} differs from the model's dtype ({model_dtype}): "
                         "use 'auto' (the model's) or 'fp8'")
    return model_dtype
