"""The fast paths a model runner takes, and why it skips the others.

Each fast path falls back to a slower one that computes the same thing, so a skipped one shows only
as speed: a decode step replayed from a recording (C on CPU, a CUDA graph on GPU), and on CPU the C
attention kernels, the C few-row matmul and the fused elementwise ops. `ModelRunner.fast_paths`
names each that applies to its device, with None where it is taken and the reason where it is not;
the engine core reports them (`EngineCore.fast_paths`), and each skip is logged once per process.
"""

from __future__ import annotations

import logging
import threading

import torch

from pagedserve.config import EngineConfig
from pagedserve.models.config import ModelConfig
from pagedserve.ops import cpu_attention, cpu_linear, fused_cpu, native
from pagedserve.worker import cpu_graphs

logger = logging.getLogger(__name__)

DECODE_REPLAY = "decode_replay"  # worker/cpu_graphs.py on CPU, worker/cuda_graphs.py on CUDA
CPU_ATTENTION = "cpu_attention_kernels"  # ops/csrc/paged_decode.c, paged_prefill.c
CPU_LINEAR = "cpu_linear_kernel"  # ops/csrc/linear.c
CPU_FUSED_OPS = "cpu_fused_ops"  # ops/csrc/fused_ops.c

EAGER = "enforce_eager=True"

_logged: set[tuple[str, str]] = set()  # (path, reason) pairs this process has logged
_logged_lock = threading.Lock()


def log_skipped(paths: dict[str, str | None]) -> None:
    """Log each skipped path with its reason, once per process for each (path, reason): every engine
    of a process (and every tensor-parallel rank's runner) finds the same ones. A warning, as the
    engine runs slower than it could; information only where the user asked for the slow path."""
    for name, reason in paths.items():
        if reason is None:
            continue
        with _logged_lock:
            if (name, reason) in _logged:
                continue
            _logged.add((name, reason))
        asked = reason == EAGER or reason == native.KERNELS_OFF
        logger.log(logging.INFO if asked else logging.WARNING, "fast path %s is skipped: %s", name, reason)


def _not_loaded(load, name: str) -> str | None:
    """None if `load()` (a kernel module's loader: what the forward calls) has the library, else why not."""
    if load() is not None:
        return None
    return native.unavailable_reason(name) or f"csrc/{name}.c is not loaded"


def cpu_kernel_paths(model_config: ModelConfig, config: EngineConfig) -> dict[str, str | None]:
    """The C kernels of a CPU runner: None for each the forward uses, else why it does not."""
    dtype, kv_dtype = config.torch_dtype, config.kv_torch_dtype
    if config.attention_backend != "torch":
        attention = f"attention_backend={config.attention_backend!r} runs its own kernels"
    else:
        q = torch.empty(1, 1, model_config.head_dim, dtype=dtype)
        cache = torch.empty(1, 1, 1, model_config.head_dim, dtype=kv_dtype)
        attention = _not_loaded(cpu_attention.load, "paged_attention")
        if attention is None and not cpu_attention.supports(q, cache):
            attention = (f"they take float32 or bfloat16 queries over a float32, bfloat16 or fp8 cache with a head "
                         f"size that is a multiple of {cpu_attention.VECTOR_WIDTH}, not {dtype} over {kv_dtype} with "
                         f"head size {model_config.head_dim}: attention runs in torch's SDPA")
    linear = _not_loaded(cpu_linear.load, "linear")
    if linear is None and not cpu_linear.supports_dtype(dtype):
        linear = (f"this CPU lacks the instructions csrc/linear.c computes {dtype} with (AVX2 with FMA, or "
                  "AVX-512; bfloat16 there also its BF16 extension): matmuls run in oneDNN or torch")
    fused = _not_loaded(fused_cpu.load, "fused_ops")
    if fused is None and dtype not in (torch.float32, torch.bfloat16):
        fused = f"they take float32 or bfloat16, not {dtype}: norms, activations and RoPE run in torch"
    return {CPU_ATTENTION: attention, CPU_LINEAR: linear, CPU_FUSED_OPS: fused}


def replay_skipped(model_config: ModelConfig, config: EngineConfig,
                   kernels: dict[str, str | None]) -> str | None:
    """Why a runner's decode steps cannot be replayed, where that is known before trying (`kernels`:
    a CPU runner's `cpu_kernel_paths`); None where a replay is worth trying (on CPU a recording may
    still find work outside the C kernels, and say so)."""
    if config.enforce_eager:
        return EAGER
    if config.tensor_parallel_size > 1:
        return "tensor parallelism: a replay would skip the collectives between the kernels"
    device = torch.device(config.device).type
    if device == "cuda":
        if config.attention_backend != "triton":
            return f"attention_backend={config.attention_backend!r}: CUDA graphs need the Triton backend"
        if config.enable_lora:
            return "LoRA: the adapters' grouped matmuls change shape with each step's mix of adapters"
        return _several_groups(model_config, config)
    if device != "cpu":
        return f"no decode replays on {device}"
    unavailable = _not_loaded(cpu_graphs.load, "replay")
    if unavailable:
        return unavailable
    if config.kv_torch_dtype == torch.float8_e4m3fn:
        return "the fp8 KV cache: its K/V writes quantize in torch, outside the C kernels"
    for name in (CPU_ATTENTION, CPU_LINEAR, CPU_FUSED_OPS):
        if kernels.get(name) is not None:
            return f"part of the forward runs outside the C kernels ({name}: {kernels[name]})"
    return None


def _several_groups(model_config: ModelConfig, config: EngineConfig) -> str | None:
    if model_config.kv_layout(config.disable_hybrid_kv_cache).num_groups > 1:
        return "layers of several KV cache groups: CUDA graphs hold one block table per request"
    return None
