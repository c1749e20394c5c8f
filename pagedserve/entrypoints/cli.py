"""The `pagedserve` command line. Heavy imports happen inside each command, so `--help` is quick."""

from __future__ import annotations

import argparse
import sys


def cmd_kv_calc(args: argparse.Namespace) -> None:
    from pagedserve.entrypoints.kv_calc import report, resolve_shape

    print(report(resolve_shape(args.model), args.dtype, args.tokens))


def cmd_bench_memory(args: argparse.Namespace) -> None:
    from pagedserve.bench.memory import run_memory_bench, write_outputs

    setup, results = run_memory_bench(
        num_requests=args.num_requests,
        seed=args.seed,
        kv_budget_tokens=args.kv_budget_tokens,
        max_model_len=args.max_model_len,
        max_len=args.max_prompt_len,
        max_tokens=args.max_tokens,
        arrival_rate=args.arrival_rate,
        block_sizes=tuple(args.block_sizes),
    )
    print(f"KV memory bench: {setup['num_requests']} requests, budget {setup['kv_budget_tokens']:,} token slots, "
          f"max_model_len {setup['max_model_len']}, seed {setup['seed']}")
    print(write_outputs(setup, results, args.out_dir, args.json))
    if args.out_dir:
        print(f"wrote {args.out_dir}/bench_memory.md and {args.out_dir}/bench_memory.png")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    kv = sub.add_parser("kv-calc", help="KV-cache bytes per token and per context for a model")
    kv.add_argument("--model", required=True, help="a preset (e.g. llama-3-8b), a config.json or an HF model directory")
    kv.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "fp8"])
    kv.add_argument("--tokens", type=int, default=None, help="context length (default: the model's maximum)")
    kv.set_defaults(func=cmd_kv_calc)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    mem = bench.add_parser("memory", help="contiguous vs paged KV allocation on one synthetic trace")
    mem.add_argument("--num-requests", type=int, default=1000)
    mem.add_argument("--seed", type=int, default=0)
    mem.add_argument("--kv-budget-tokens", type=int, default=65536, help="KV budget in token slots")
    mem.add_argument("--max-model-len", type=int, default=2048)
    mem.add_argument("--max-prompt-len", type=int, default=1024)
    mem.add_argument("--max-tokens", type=int, default=1024, help="requested max_tokens; outputs end earlier")
    mem.add_argument("--arrival-rate", type=float, default=2.0, help="Poisson arrivals per step")
    mem.add_argument("--block-sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    mem.add_argument("--out-dir", default="docs", help="where the markdown table and PNG go ('' for none)")
    mem.add_argument("--json", default=None, help="also write the figures as JSON here")
    mem.set_defaults(func=cmd_bench_memory)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
