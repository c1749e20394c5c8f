"""GPU check of the Triton attention backend: correctness against the torch oracle, then decode
kernel time and achieved bandwidth against the torch backend (attention_backend="torch", on the GPU
its decodes run through SDPA in length groups) and against SDPA on a contiguous cache.

    python scripts/gpu_check.py                  # on a CUDA machine
    TRITON_INTERPRET=1 python scripts/gpu_check.py --device cpu --smoke   # tiny shapes, no GPU

Bandwidth = bytes of K/V the requests own (2 x layers=1 x tokens x kv_heads x head_dim x dtype
size) / kernel time; the copy bandwidth of the device (a large tensor copy, read + write) is
printed beside it as the yardstick. Shapes: the embedded model's heads (9 query, 3 KV, dim 64)
and a Llama-3-8B layer (32 query, 8 KV, dim 128) in bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pagedserve.attention import sdpa, torch_ref, triton_paged
from pagedserve.attention.kv_quant import quantize
from pagedserve.kv.sizes import cdiv


def timeit(fn, device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_case(batch, context, heads, kv_heads, dim, dtype, device, block_size=16):
    blocks_per_req = cdiv(context, block_size)
    perm = torch.randperm(batch * blocks_per_req).tolist()
    tables = [perm[i * blocks_per_req:(i + 1) * blocks_per_req] for i in range(batch)]
    shape = (batch * blocks_per_req, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    md = triton_paged.TritonBackend().build_metadata(tables, [context - 1] * batch, [1] * batch, block_size, device)
    q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
    k = k_cache.view(-1, kv_heads, dim)[md.slot_mapping].clone()
    v = v_cache.view(-1, kv_heads, dim)[md.slot_mapping].clone()
    return q, k, v, k_cache, v_cache, md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (for the interpreter)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    reason = triton_paged.available(device)
    if reason:
        raise SystemExit(reason)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__)
        big = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        copy_s = timeit(lambda: big.clone(), device, 10)
        print(f"copy bandwidth: {2 * big.numel() / copy_s / 1e9:.0f} GB/s (read + write)")

    # Correctness: mixed steps through the same harness as tests/attention/test_triton_paged.py.
    batches, contexts, reps = ([1, 4], [40], 1) if args.smoke else ([1, 32, 128], [1024, 8192, 32768], args.reps)
    for heads, kv_heads, dim, dtype in [(9, 3, 64, torch.float32), (32, 8, 128, torch.bfloat16)]:
        q, k, v, kc, vc, md = decode_case(4, 100, heads, kv_heads, dim, dtype, device)
        out = triton_paged.paged_attention(q, k, v, kc, vc, md, dim**-0.5)
        ref = torch_ref.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), md, dim**-0.5)
        print(f"correctness heads {heads}/{kv_heads} dim {dim} {dtype}: max abs err {(out.float() - ref).abs().max():.2e}")
        sinks = torch.linspace(-8, 8, heads, device=device)  # gpt-oss: a logit per query head, no value
        out = triton_paged.paged_attention(q, k, v, kc, vc, md, dim**-0.5, 64, None, sinks)
        ref = torch_ref.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), md, dim**-0.5, 64,
                                        None, sinks)
        print(f"  sinks, window 64: max abs err {(out.float() - ref).abs().max():.2e}")

        fp8_ok = dtype == torch.bfloat16 and triton_paged.fp8_supported(device) is None
        if fp8_ok:  # the same step on an fp8 cache, against the oracle reading that cache
            scales = torch.tensor([0.05, 0.05], device=device)
            kc8, vc8 = quantize(kc, scales[0]), quantize(vc, scales[1])
            out = triton_paged.paged_attention(q, k, v, kc8, vc8, md, dim**-0.5, None, scales)
            ref = torch_ref.paged_attention(q.float(), k.float(), v.float(), kc8, vc8, md, dim**-0.5, None, scales)
            print(f"  fp8 cache: max abs err {(out.float() - ref).abs().max():.2e}")
        print("batch | context | triton ms | GB/s | torch backend ms | SDPA contiguous ms"
              + (" | triton fp8 ms" if fp8_ok else ""))
        for batch in batches:
            for context in contexts:
                if batch * context * kv_heads * dim * 2 * dtype.itemsize > 20e9:
                    continue
                q, k, v, kc, vc, md = decode_case(batch, context, heads, kv_heads, dim, dtype, device)
                t_triton = timeit(lambda: triton_paged.paged_attention(q, k, v, kc, vc, md, dim**-0.5), device, reps)
                torch_md = sdpa.SdpaBackend().build_metadata(md.block_tables.cpu(), [context - 1] * batch, [1] * batch,
                                                             md.block_size, device)
                t_torch = timeit(lambda: sdpa.paged_attention(q, k, v, kc, vc, torch_md, dim**-0.5), device, reps) \
                    if batch * context <= 32 * 8192 else float("nan")
                # The pool read as if each request owned a contiguous run: same tokens, no table.
                kd = kc.view(batch, -1, kv_heads, dim).transpose(1, 2)[:, :, :context]
                vd = vc.view(batch, -1, kv_heads, dim).transpose(1, 2)[:, :, :context]
                t_sdpa = timeit(lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True),
                                device, reps)
                kv_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize
                line = (f"{batch} | {context} | {t_triton * 1e3:.3f} | {kv_bytes / t_triton / 1e9:.0f} | "
                        f"{t_torch * 1e3:.3f} | {t_sdpa * 1e3:.3f}")
                if fp8_ok:
                    kc8, vc8 = quantize(kc, scales[0]), quantize(vc, scales[1])
                    t_fp8 = timeit(lambda: triton_paged.paged_attention(q, k, v, kc8, vc8, md, dim**-0.5, None, scales),
                                   device, reps)
                    line += f" | {t_fp8 * 1e3:.3f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
