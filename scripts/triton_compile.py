"""Compile the Triton attention kernels for NVIDIA GPUs, on a machine without one.

    python scripts/triton_compile.py                 # every case, for sm_90 (H100/H200) and sm_80 (A100)
    python scripts/triton_compile.py --quick --arch 90

The interpreter runs the kernels' arithmetic on the CPU but compiles nothing, so it misses what
only the GPU compiler rejects (a tl.dot shape or operand type, a cast, an op an architecture lacks)
and says nothing of register pressure. Here `triton_paged.paged_attention` is called on CPU tensors
with its kernels replaced by recorders, so every launch a step would make is captured with its real
arguments, not run; each distinct launch is then compiled the way a launch on a GPU of that
architecture specialises it (Triton's own binder: argument types, 16-byte alignment, constexprs),
through ptxas to a cubin. One line per kernel variant: registers per thread, local memory
(spills), shared memory, from the cubin by cuobjdump (both ship inside the Triton wheel).
Exit status 1 if any compile failed or any kernel spilled.

Run it without TRITON_INTERPRET=1: under it @triton.jit makes interpreted functions, not compilable ones.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from pagedserve.attention import triton_paged
from pagedserve.attention.kv_quant import FP8_DTYPE
from pagedserve.kv.sizes import cdiv

KERNELS = ("_write_kv", "_decode", "_combine", "_prefill")
# (name, block size, KV heads, query heads per KV head, head size)
SHAPES = [
    ("embedded model", 16, 3, 3, 64),
    ("Llama-3-8B", 16, 8, 4, 128),
    ("block 8, MHA, dim 80", 8, 2, 1, 80),
    ("block 32, group 8", 32, 1, 8, 128),
]
# (name, model dtype, cache dtype)
DTYPES = [
    ("float32", torch.float32, torch.float32),
    ("bfloat16", torch.bfloat16, torch.bfloat16),
    ("float16", torch.float16, torch.float16),
    ("fp8 cache", torch.bfloat16, FP8_DTYPE),
]
QUICK_SHAPES, QUICK_DTYPES = SHAPES[:2], ["float32", "bfloat16", "fp8 cache"]


@dataclass
class Launch:
    kernel: triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list[Launch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, args, kwargs))


def record_step(block_size: int, kv_heads: int, group: int, dim: int, model_dtype, cache_dtype, split: bool,
                sinks: bool = False):
    """The launches of one step: decodes (one of 70 blocks, so split-K cuts it when `split`),
    a fresh prompt, and a chunk behind a prefix-cache hit; with `sinks`, a layer's sink logits."""
    reqs = [(70 * block_size - 5, 1), (3, 1), (0, 20), (2 * block_size, 7)]  # (cached, new) tokens
    needed = [cdiv(c + n, block_size) for c, n in reqs]
    tables = [list(range(sum(needed[:i]), sum(needed[:i + 1]))) for i in range(len(reqs))]
    md = triton_paged.TritonBackend().build_metadata(tables, [c for c, _ in reqs], [n for _, n in reqs], block_size)
    num_tokens = sum(n for _, n in reqs)
    cache = torch.zeros(sum(needed), block_size, kv_heads, dim, dtype=cache_dtype)
    q = torch.zeros(num_tokens, kv_heads * group, dim, dtype=model_dtype)
    kv = torch.zeros(num_tokens, kv_heads, dim, dtype=model_dtype)
    launches: list[Launch] = []
    saved = {name: getattr(triton_paged, name) for name in KERNELS}
    saved_split, saved_f32 = triton_paged.SPLIT_BELOW_PROGRAMS, triton_paged.products_in_float32
    try:
        for name in KERNELS:
            setattr(triton_paged, name, Recorder(saved[name], launches))
        triton_paged.SPLIT_BELOW_PROGRAMS = 10**9 if split else 0
        # As on a GPU: CPU tensors would make bfloat16 products float32 (an interpreter workaround).
        triton_paged.products_in_float32 = lambda q: q.dtype == torch.float32
        kv_scales = torch.ones(2) if cache_dtype == FP8_DTYPE else None
        sink_logits = torch.zeros(kv_heads * group) if sinks else None
        triton_paged.paged_attention(q, kv, kv, cache, cache.clone(), md, dim**-0.5, None, kv_scales, sink_logits)
    finally:
        for name, kernel in saved.items():
            setattr(triton_paged, name, kernel)
        triton_paged.SPLIT_BELOW_PROGRAMS, triton_paged.products_in_float32 = saved_split, saved_f32
    return launches


def compile_launch(launch: Launch, arch: int):
    """Compile `launch` for sm_`arch` as Triton would for that launch on such a GPU."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, extra = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, extra, bound, specialization, extra)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spilled bytes per thread), SHARED, STACK of the cubin's one function."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def variant(launch: Launch) -> str:
    kw = launch.kwargs
    keys = ("HEAD_DIM", "GROUP_PAD", "BLOCK_SIZE", "SPLIT", "NUM_PARTS", "ROW", "F32", "FP8", "HAS_SINKS")
    return " ".join(f"{k}={kw[k]}" for k in keys if k in kw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities, e.g. 90 80")
    parser.add_argument("--quick", action="store_true", help="two shapes, three dtypes (the test's subset)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    dtypes = [d for d in DTYPES if not args.quick or d[0] in QUICK_DTYPES]
    failures = spills = compiled = 0
    print(f"Triton {triton.__version__}; per kernel: registers/thread, local (spill) bytes, shared bytes")
    for arch in args.arch:
        seen: set[tuple] = set()
        for shape_name, block_size, kv_heads, group, dim in shapes:
            for dtype_name, model_dtype, cache_dtype in dtypes:
                if cache_dtype == FP8_DTYPE and arch < 89:
                    continue  # e4m3 needs sm_89+ (triton_paged.fp8_supported)
                for split, sinks in ((False, False), (True, False), (False, True), (True, True)):
                    for launch in record_step(block_size, kv_heads, group, dim, model_dtype, cache_dtype, split,
                                              sinks):
                        key = (launch.kernel.__name__, str(model_dtype), str(cache_dtype), variant(launch))
                        if key in seen:
                            continue
                        seen.add(key)
                        label = f"sm_{arch} {shape_name:21} {dtype_name:9} {launch.kernel.__name__:9} {variant(launch)}"
                        start = time.perf_counter()
                        try:
                            usage = resource_usage(compile_launch(launch, arch).asm["cubin"])
                        except Exception as exc:  # noqa: BLE001 -- report every failing variant, then fail
                            failures += 1
                            print(f"FAIL {label}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
                            continue
                        compiled += 1
                        spilled = usage.get("LOCAL", 0) > 0
                        spills += spilled
                        print(f"{'SPILL' if spilled else 'ok':5} {label}: {usage.get('REG')} regs, "
                              f"{usage.get('LOCAL', 0)} local, {usage.get('SHARED', 0)} shared "
                              f"({time.perf_counter() - start:.1f} s)")
    print(f"{compiled} compiled, {failures} failed, {spills} spilled")
    return 1 if failures or spills else 0


if __name__ == "__main__":
    sys.exit(main())
