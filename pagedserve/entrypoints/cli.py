"""The `pagedserve` command line. Heavy imports happen inside each command, so `--help` is quick."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path


def cmd_kv_calc(args: argparse.Namespace) -> None:
    from pagedserve.entrypoints.kv_calc import report, resolve_shape, weights_line

    print(report(resolve_shape(args.model), args.dtype, args.tokens, args.tp_size, args.kv_cache_memory_bytes,
                 args.block_size))
    weights = weights_line(args.model)  # for a checkpoint on disk, not a preset
    if weights:
        print(weights)


def cmd_bench_hybrid(args: argparse.Namespace) -> None:
    from pagedserve.bench.hybrid import format_hybrid, run_hybrid_bench

    print(format_hybrid(run_hybrid_bench(args.parts, args.contexts, args.batch, args.reps, args.dtype)))


def cmd_bench_memory(args: argparse.Namespace) -> None:
    if args.part == "layouts":
        from pagedserve.bench.memory_layouts import layouts_table, run_layouts_bench

        budget = int(args.kv_budget_gib * 2**30)
        print(layouts_table(run_layouts_bench(budget, tuple(args.contexts)), budget))
        return
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


EXAMPLE_CONVERSATIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
    "What is 12 times 7?",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "What does a compiler do?",
]
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and accurately."


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse type: a number of this kind above 0."""
    def parse(text: str) -> int | float:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with its default, choices and help (config.py holds them)."""
    import dataclasses
    import typing

    from pagedserve.config import EngineConfig

    g = parser.add_argument_group("engine")
    types = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = next(t for t in typing.get_args(types[f.name]) or (types[f.name],) if t is not type(None))
        if kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            help = f.metadata["help"] if "default" in f.metadata["help"] else f"{f.metadata['help']} (default: {f.default})"
            g.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"], help=help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    import dataclasses

    from pagedserve.config import EngineConfig

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--sampling-seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, n=args.n, stop=args.stop, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from pagedserve.entrypoints.llm import LLM

    with LLM(**engine_kwargs(args)) as llm:
        outputs = llm.generate(args.prompts, sampling_params(args), use_tqdm=False)
    for output in outputs:
        if output.error is not None:  # the engine failed on this prompt alone: the others printed
            print(f"error: prompt {output.prompt!r}: {output.error}", file=sys.stderr)
            continue
        for sample in output.outputs:
            print(output.prompt + sample.text if args.echo else sample.text)
    if any(output.error is not None for output in outputs):
        sys.exit(1)


def cmd_chat(args: argparse.Namespace) -> None:
    from pagedserve.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    print("pagedserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        conversation.append({"role": "user", "content": line})
        answer = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text
        print(answer)
        conversation.append({"role": "assistant", "content": answer})


def cmd_demo(args: argparse.Namespace) -> None:
    """A batch of example chat prompts, their answers, and what the engine did; or, with --html, the
    paged-memory walk-through as a page."""
    if args.html:
        from pagedserve.dashboard.report import render_report
        from pagedserve.dashboard.walkthrough import walkthrough_frames

        Path(args.html).write_text(render_report(walkthrough_frames(), "pagedserve: PagedAttention step by step"))
        print(f"wrote {args.html}: open it in a browser and step through with the arrow keys")
        return
    from pagedserve.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
                     for q in EXAMPLE_CONVERSATIONS]
    outputs = llm.chat(conversations, sampling_params(args))
    for conversation, output in zip(conversations, outputs):
        print(f"\n>>> {conversation[-1]['content']}\n{output.outputs[0].text.strip()}")
    print("\n" + format_report(llm.get_metrics()))


RAY_INSTALL = "pip install 'pagedserve[ray]'"


def cmd_serve(args: argparse.Namespace) -> None:
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.openai.api_server import EMBEDDED_MODEL_NAME, run_server

    if not args.ray:
        run_server(EngineConfig(**engine_kwargs(args)), **server_kwargs(args))
        return
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        sys.exit(f"error: --ray needs Ray Serve, which is not installed: {RAY_INSTALL}")
    from pagedserve.entrypoints.openai.ray_app import parse_autoscale, run_ray_server

    autoscale = parse_autoscale(args.autoscale) if args.autoscale else None
    config = EngineConfig(**engine_kwargs(args))
    options = server_kwargs(args)
    run_ray_server(config, args.served_model_name or config.model or EMBEDDED_MODEL_NAME, host=args.host,
                   port=args.port, ray_address=args.ray_address, api_key=args.api_key,
                   num_replicas=args.num_replicas, autoscale=autoscale, replica_cpus=args.replica_cpus,
                   router=args.router,
                   router_kwargs={"imbalance_threshold": args.router_imbalance_threshold}
                   if args.router == "prefix-aware" else None,
                   max_body_bytes=options["max_body_bytes"], default_max_tokens=options["default_max_tokens"],
                   enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                   lora_modules=options["lora_modules"],
                   allow_runtime_lora_updating=options["allow_runtime_lora_updating"])


def server_kwargs(args: argparse.Namespace) -> dict:
    """run_server's keyword arguments from `serve`'s flags. Raises ValueError for a bad
    --override-generation-config, and for --enable-auto-tool-choice without a parser (before the
    engine loads)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    if args.engine_max_restarts < 0:
        raise ValueError(f"--engine-max-restarts must be >= 0, got {args.engine_max_restarts}")
    lora_modules = lora_module_paths(args)
    return dict(host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
                timeout_keep_alive=args.timeout_keep_alive, header_timeout=args.header_timeout,
                body_timeout=args.body_timeout, shutdown_timeout=args.shutdown_timeout,
                max_body_bytes=args.max_body_bytes, engine_core=args.engine_core,
                default_max_tokens=generation_config_max_tokens(args.override_generation_config),
                enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                max_request_tokens=args.max_request_tokens, engine_max_restarts=args.engine_max_restarts,
                engine_stall_timeout=args.engine_stall_timeout, lora_modules=lora_modules,
                allow_runtime_lora_updating=args.allow_runtime_lora_updating, dashboard=not args.no_dashboard,
                dashboard_max_viewers=args.dashboard_max_viewers)


def lora_module_paths(args: argparse.Namespace) -> tuple:
    """--lora-modules as LoRAModulePaths; ValueError for an entry that is not name=path or vLLM's
    JSON form, and for the LoRA flags without --enable-lora (before the engine loads)."""
    from pagedserve.entrypoints.openai.serving_models import parse_lora_module

    for flag, given in (("--lora-modules", args.lora_modules), ("--allow-runtime-lora-updating",
                                                                  args.allow_runtime_lora_updating)):
        if given and not args.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora (the engine serves no LoRA adapters without it)")
    return tuple(parse_lora_module(text) for text in args.lora_modules or ())


def generation_config_max_tokens(override: str | None) -> int | None:
    """max_new_tokens from vLLM's --override-generation-config JSON, the only key served here."""
    if override is None:
        return None
    try:
        config = json.loads(override)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not JSON: {e}") from e
    if not isinstance(config, dict) or set(config) - {"max_new_tokens"}:
        raise ValueError("--override-generation-config takes a JSON object with max_new_tokens only, "
                         f"e.g. '{{\"max_new_tokens\": 256}}'; got {override}")
    value = config.get("max_new_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_new_tokens must be a positive integer, got {value!r}")
    return value


def format_report(m: dict) -> str:
    return "\n".join([
        "engine report",
        f"  requests            {m['requests']}",
        f"  tokens              {m['prompt_tokens']} prompt + {m['generation_tokens']} generated",
        f"  throughput          {m['generation_tokens_per_s']:.1f} generated tokens/s",
        f"  KV blocks           peak {m['kv_peak_used_blocks']} of {m['kv_total_blocks']} used, "
        f"{m['kv_waste_at_peak']:.1%} of reserved slots empty at peak",
        f"  prefix cache        {m['prefix_cache_hits']} of {m['prefix_cache_queries']} prompt tokens hit "
        f"({m['prefix_cache_hit_rate']:.1%})",
        f"  preemptions         {m['preemptions']}",
        f"  copy-on-write       {m['cow_copies']} block copies",
    ])


def save_report(out_dir: str | None, name: str, table: str, draw, json_path: str | None, data) -> None:
    """A bench's outputs: `table` as OUT_DIR/NAME.md and draw(OUT_DIR/NAME.png) (unless draw is
    None) when out_dir is given; `data` as JSON at json_path when given."""
    if out_dir:
        import os

        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, name)
        with open(stem + ".md", "w") as f:
            f.write(table + "\n")
        if draw is None:
            print(f"wrote {stem}.md")
        else:
            draw(stem + ".png")
            print(f"wrote {stem}.md and {stem}.png")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2)


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from pagedserve.bench.throughput import markdown_table, plot, run_throughput_bench
    from pagedserve.bench.workload import WORKLOADS
    from pagedserve.config import resolve_dtype

    workload = WORKLOADS[args.workload](num_requests=args.num_requests, seed=args.seed)
    if args.output_len is not None:
        workload = workload.with_output_len(args.output_len)
    print(workload.describe())
    results = run_throughput_bench(
        workload, args.systems.split(","), reps=args.reps, hf_batch_sizes=tuple(args.hf_batch_sizes),
        vllm_python=args.vllm_python, llamacpp_python=args.llamacpp_python, hf_model_dir=args.hf_model_dir,
        engine_kwargs={"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                       "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                       "tensor_parallel_size": args.tensor_parallel_size},
        device=args.device, model=args.model, dtype=resolve_dtype(args.dtype, args.device),
        quantizations=tuple(args.quantization.split(",")))
    table = markdown_table(workload, results)
    if args.device == "cpu" and args.model is None and any(r.system == "pagedserve" and not r.skipped for r in results):
        table += "\n\n" + ceiling_note(results, resolve_dtype(args.dtype, args.device))
    print(table)
    save_report(args.out_dir, f"bench_throughput_{workload.name}", table,
                lambda png: plot(results, workload.describe(), png),
                args.json, {"workload": workload.describe(), "results": [r.summary() for r in results]})


def cmd_bench_latency(args: argparse.Namespace) -> None:
    from pagedserve.bench.latency import markdown_table, ratios, run_latency_bench

    bandwidth_bytes = int(args.bandwidth_gib * 2**30)
    workload, results, bandwidth, bandwidth_read = run_latency_bench(
        args.systems.split(","), args.quantization.split(","), prompt_len=args.prompt_len, output_len=args.output_len,
        reps=args.reps, seed=args.seed, model=args.model, dtype=args.dtype, llamacpp_python=args.llamacpp_python,
        llamacpp_threads=[int(n) for n in args.llamacpp_threads.split(",")] if args.llamacpp_threads else None,
        vllm_python=args.vllm_python, hf_model_dir=args.hf_model_dir, bandwidth_bytes=bandwidth_bytes)
    table = markdown_table(workload, results, bandwidth, bandwidth_bytes, bandwidth_read)
    table = "\n\n".join([table, *ratios(results)])
    print(table)
    save_report(args.out_dir, "bench_latency", table, None, args.json,
                {"workload": workload.to_json(), "read_bandwidth_bytes_per_s": bandwidth, "read_bandwidth_by": bandwidth_read,
                 "results": [r.summary() for r in results]})


def ceiling_note(results, dtype: str = "float32") -> str:
    """pagedserve's total tokens/s against this machine's matmul ceiling for the model in `dtype`."""
    import torch

    from pagedserve.bench.profile import matmul_ceiling, matmul_params
    from pagedserve.models.loader import load_model

    net = load_model(dtype=getattr(torch, dtype))[0]
    ceiling = matmul_ceiling(net) / (2 * matmul_params(net))
    ours = next(r for r in results if r.system == "pagedserve")
    return (f"pagedserve total tokens/s = {ours.total_tps() / ceiling:.0%} of the {dtype} matmul ceiling "
            f"measured in this run ({ceiling:.0f} tokens/s at 2 x {matmul_params(net) / 1e6:.1f}M FLOPs per token).")


def cmd_bench_prefix(args: argparse.Namespace) -> None:
    from pagedserve.bench.prefix import format_table, run_prefix_bench

    rows = run_prefix_bench(num_requests=args.num_requests, prefix_len=args.prefix_len, seed=args.seed, reps=args.reps)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def cmd_bench_routing(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        sys.exit(f"error: bench routing needs Ray Serve, which is not installed: {RAY_INSTALL}")
    from pagedserve.bench.routing import format_table, run_routing_bench

    rows = run_routing_bench(model=args.model, routers=tuple(args.routers.split(",")), replicas=args.replicas,
                             num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                             requests_per_prompt=args.requests_per_prompt, concurrency=args.concurrency,
                             repeats=args.repeats, seed=args.seed)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def cmd_bench_structured(args: argparse.Namespace) -> None:
    if args.part == "gaps":
        from pagedserve.bench.compile_gaps import format_gaps_table, run_compile_gaps_bench

        reports = run_compile_gaps_bench(concurrent=args.concurrent, properties=args.properties, reps=args.reps)
        table = format_gaps_table(reports)
        print(table)
        save_report(args.out_dir, "bench_structured_gaps", table, None, args.json, reports)
        return
    from pagedserve.bench.structured import format_table, run_structured_bench

    report = run_structured_bench(num_requests=args.num_requests, max_tokens=args.max_tokens, reps=args.reps)
    table = format_table(report)
    print(table)
    save_report(args.out_dir, "bench_structured", table, None, args.json, report)


def cmd_bench_startup(args: argparse.Namespace) -> None:
    from pagedserve.bench.startup import format_table, run_startup_bench

    rows = run_startup_bench(model=args.model, dtype=args.dtype, reps=args.reps)
    table = format_table(rows)
    print(table)
    save_report(args.out_dir, "bench_startup", table, None, args.json, rows)


def cmd_bench_dashboard(args: argparse.Namespace) -> None:
    import shlex

    from pagedserve.bench.dashboard import format_table, run_dashboard_bench

    bounds = tuple(None if b == "default" else int(b) for b in args.max_viewers)
    rows = run_dashboard_bench(viewers=args.viewers, non_readers=args.non_readers, churn=args.churn,
                               max_viewers=bounds, quiet_s=args.quiet_seconds, loaded_s=args.seconds,
                               server_args=tuple(shlex.split(args.server_args)))
    table = format_table(rows)
    print(table)
    save_report(args.out_dir, "bench_dashboard", table, None, args.json, rows)


def cmd_bench_profile(args: argparse.Namespace) -> None:
    from pagedserve.bench.profile import format_table, plot, run_profile_bench

    report = run_profile_bench(batches=tuple(args.batches), steps=args.steps, torch_profile=args.torch_profile,
                               tensor_parallel_size=args.tensor_parallel_size)
    table = format_table(report)
    print(table)
    name = "bench_profile" if args.tensor_parallel_size == 1 else f"bench_profile_tp{args.tensor_parallel_size}"
    save_report(args.out_dir, name, table, lambda png: plot(report, png), args.json, report)


def cmd_bench_overhead(args: argparse.Namespace) -> None:
    from pagedserve.bench.overhead import format_table, plot, report, run_overhead_bench

    threads = args.threads or None
    rows = run_overhead_bench(requests=tuple(args.requests), contexts=tuple(args.contexts), pools=tuple(args.pools),
                              steps=args.steps, pool_states=tuple(args.pool_states), threads=threads)
    table = format_table(rows, threads)
    print(table)
    save_report(args.out_dir, "bench_overhead", table, lambda png: plot(rows, png), args.json, report(rows, threads))


def cmd_bench_serving(args: argparse.Namespace) -> None:
    import asyncio
    import contextlib

    from pagedserve.bench.servers import launch
    from pagedserve.bench.serving import (
        format_comparison, format_report, format_table, median_reports, plot, run_serving_bench, wait_until_idle,
        warm_up)
    from pagedserve.bench.workload import sharegpt_like

    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    rates = args.request_rate

    # A fresh draw of prompts for each round and rate, and for the warm-up: a prompt sent before
    # would be served from the prefix cache. Within a round every system gets the same prompts.
    def workload(seed: int, num_requests: int = args.num_requests):
        return sharegpt_like(num_requests=num_requests, seed=seed, output_len=(16, args.max_output_len))

    urls = [tuple(u.split("=", 1)) if "=" in u.split("://")[0] else (u, u) for u in args.url or []]
    systems = [s for s in (args.systems or "").split(",") if s]
    if not urls and not systems:
        urls = [("http://127.0.0.1:8000",) * 2]
    targets = [(name, url.rstrip("/")) for name, url in urls]  # and the servers of --systems, once started
    runs, startups = [], {}

    def warm(url: str) -> None:
        if args.warmup_requests:
            asyncio.run(warm_up(url, workload(args.seed + args.rounds * len(rates), args.warmup_requests),
                                args.model_name, args.api_key, args.warmup_requests))

    def measure(system: str, url: str, round_: int, i: int, rate: float) -> None:
        if len(targets) > 1:
            wait_until_idle()  # the last system's server may still be busy
        runs.append(asyncio.run(run_serving_bench(url, workload(args.seed + round_ * len(rates) + i), rate,
                                                  args.model_name, seed=args.seed + round_, api_key=args.api_key,
                                                  system=system)))
        runs[-1]["round"] = round_
        print(format_report(runs[-1]) + "\n")

    with contextlib.ExitStack() as servers:
        # Every server is started before any is measured, so that the systems take turns: the
        # speed of this machine drifts by 10-20% over minutes, more than the differences measured.
        # Before each run the bench waits for the CPUs to go quiet (`wait_until_idle`).
        for system in systems:
            print(f"starting {system} serve ...", file=sys.stderr)
            server = servers.enter_context(
                launch(system, args.model_name, args.dtype, args.vllm_python, args.hf_model_dir, args.api_key))
            startups[system] = server.startup_s
            print(f"{system} ready in {server.startup_s:.1f} s at {server.url} (log: {server.log_path})", file=sys.stderr)
            targets.append((system, server.url))
        for _, url in targets:
            warm(url)
        for round_ in range(args.rounds):
            for i, rate in enumerate(rates):
                turn = targets[round_ % len(targets):] + targets[:round_ % len(targets)]  # who goes first rotates
                for name, url in turn:
                    measure(name, url, round_, i, rate)
    reports = median_reports(runs)
    table = format_table(reports)
    names = list(dict.fromkeys(r["system"] for r in reports))
    if len(names) > 1:
        table += "\n\n" + format_comparison(reports, "pagedserve" if "pagedserve" in names else names[0], runs)
    if startups:
        table += "\n\nServer start to /health ready: " + ", ".join(f"{k} {v:.1f} s" for k, v in startups.items())
    print(table)
    save_report(args.out_dir, "bench_serving", table, lambda png: plot(reports, png),
                args.json, runs if len(runs) > 1 else runs[0])


def cmd_bench_spec(args: argparse.Namespace) -> None:
    from pagedserve.bench.speculative import markdown_table, plot, run_spec_bench

    parts = tuple(p for p in args.parts.split(",") if p) + (("serving",) if args.serving else ())
    report = run_spec_bench(reps=args.reps, batch_reps=args.batch_reps, copy_requests=args.copy_requests,
                            sharegpt_requests=args.sharegpt_requests, max_tokens=args.max_tokens, batch=args.batch,
                            batch_requests=args.batch_requests, seed=args.seed, parts=parts,
                            serving_requests=args.serving_requests, serving_rate=args.serving_rate)
    report_identical_outputs(args, "bench_spec", markdown_table(report), plot, report, "speculation")


def report_identical_outputs(args: argparse.Namespace, name: str, table: str, plot, report: dict, feature: str) -> None:
    """Print and save a bench's table (and its plot, if asked); exit non-zero when greedy outputs
    with `feature` differ from those without."""
    print(table)
    save_report(args.out_dir, name, table, None, args.json, report)
    if args.plot and plot is not None:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    if not report["all_identical"]:
        sys.exit(f"error: greedy outputs with {feature} differ from those without")


def cmd_bench_offload(args: argparse.Namespace) -> None:
    from pagedserve.bench.offload import markdown_table, plot, run_offload_bench

    report = run_offload_bench(
        parts=tuple(p for p in args.parts.split(",") if p), sessions=args.sessions, turns=args.turns,
        system_prompt_len=args.system_prompt_len, user_len=args.user_len, answer_len=args.answer_len,
        shared_system_prompt=args.shared_system_prompt, concurrency=args.concurrency, pool_ratio=args.pool_ratio,
        policies=tuple(p for p in args.policies.split(",") if p), noreuse_requests=args.noreuse_requests,
        noreuse_prompt_len=(args.noreuse_min_prompt_len, args.noreuse_max_prompt_len),
        noreuse_output_len=args.noreuse_output_len, restart_prefix_len=args.restart_prefix_len,
        restart_question_len=args.restart_question_len, restart_output_len=args.restart_output_len,
        restart_reps=args.restart_reps, swap_requests=args.swap_requests, swap_prompt_len=args.swap_prompt_len,
        swap_output_len=args.swap_output_len, swap_max_num_seqs=args.swap_max_num_seqs, swap_blocks=args.swap_blocks,
        reps=args.reps, seed=args.seed, offload_root=args.offload_root, offload_bytes=args.offload_bytes)
    report_identical_outputs(args, "bench_offload", markdown_table(report), plot, report, "the KV tier")


def cmd_bench_lora(args: argparse.Namespace) -> None:
    from pagedserve.bench.lora import markdown_table, plot, run_lora_bench

    parts = tuple(p for p in args.parts.split(",") if p)
    report = run_lora_bench(parts, num_adapters=args.num_adapters, rank=args.rank, num_requests=args.requests,
                            prompt_len=args.prompt_len, output_len=args.output_len, reps=args.reps,
                            load_reps=args.load_reps, model=args.model, dtype=args.dtype,
                            quantization=args.quantization, seed=args.seed)
    report_identical_outputs(args, "bench_lora", markdown_table(report), plot if "throughput" in parts else None,
                             report, "LoRA on (requests on the base model)")


def cmd_export_hf(args: argparse.Namespace) -> None:
    """Write the embedded GGUF model as a Hugging Face directory (float32 safetensors + tokenizer),
    for systems that want one (vLLM)."""
    from pagedserve.bench.throughput import load_hf_reference
    from pagedserve.models.loader import load_tokenizer

    from transformers import AutoModelForCausalLM

    gguf_model = load_hf_reference()
    config = gguf_model.config
    del config.quantization_config  # the weights below are already dequantized to float32
    model = AutoModelForCausalLM.from_config(config, dtype=gguf_model.dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(args.out, safe_serialization=True)
    load_tokenizer().save_pretrained(args.out)
    print(f"wrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.bench.workload import WORKLOADS  # plain Python: --help stays quick
    from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving on a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat with the model")
    chat.add_argument("--system", default=SYSTEM_PROMPT)
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    demo = sub.add_parser("demo", help="a batch of example chat prompts and an engine report (make run)")
    demo.add_argument("--html", metavar="FILE", default=None,
                      help="instead, write PagedAttention's walk-through (allocate, grow, share a prefix, fork, copy "
                      "on write, evict, preempt, free), run on the real memory manager, as one self-contained page "
                      "that replays it step by step")
    add_sampling_args(demo, max_tokens=128)
    add_engine_args(demo)
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="if set, /v1 routes require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: --model, or SmolLM2-135M-Instruct)")
    serve.add_argument("--timeout-keep-alive", type=positive(float), default=5.0,
                       help="seconds an idle connection stays open between requests")
    serve.add_argument("--header-timeout", type=positive(float), default=5.0,
                       help="seconds a request's headers may take to arrive, from its first byte")
    serve.add_argument("--body-timeout", type=positive(float), default=30.0,
                       help="seconds a request's body may take to arrive, after its headers (then 408)")
    serve.add_argument("--max-body-bytes", type=positive(int), default=None,
                       help="largest request body (then 413; default: room for the longest prompt that can "
                       "fit the context)")
    serve.add_argument("--shutdown-timeout", type=positive(float), default=30.0,
                       help="on SIGTERM or SIGINT, seconds running requests get to finish before they are "
                       "aborted; new requests get 503 meanwhile (a second signal exits at once)")
    serve.add_argument("--override-generation-config", default=None, metavar="JSON",
                       help="vLLM's flag; '{\"max_new_tokens\": N}' sets max_tokens for requests that set none "
                       "(default: chat runs to the context limit, completions 16)")
    serve.add_argument("--engine-core", choices=("process", "thread"), default="process",
                       help="where the engine core runs: its own process, fed over ZMQ while this one does HTTP, "
                       "tokenization and detokenization (default); or a thread of this process")
    serve.add_argument("--max-request-tokens", type=positive(int), default=1 << 22,
                       help="the most tokens and logprob entries one request may ask the server to produce and return: "
                       "prompts x n x (max_tokens, + the prompt with echo) x (1 + logprobs); more is a 400 (default: "
                       "4194304)")
    serve.add_argument("--engine-max-restarts", type=int, default=3,
                       help="if the engine core process dies or stalls: how many times to start a new one (waiting "
                       "1, 2, 4 s ... before each), requests in flight failing with 503; if none starts the server "
                       "exits 1 (default: 3; 0: exit at once)")
    serve.add_argument("--engine-stall-timeout", type=positive(float), default=60.0,
                       help="seconds the engine core may take to answer a liveness probe (it is asked when silent; "
                       "it answers between steps) before it counts as stalled, with or without requests in "
                       "flight: a core process is killed and restarted as a dead one is (--engine-max-restarts), "
                       "a core on a thread ends the server with exit code 1. Must exceed the longest step "
                       "(default: 60)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's flag: tool_choice \"auto\" (the default with tools), the model's calls read by "
                       "--tool-call-parser (\"required\" and a named function work without it)")
    serve.add_argument("--tool-call-parser", choices=(*TOOL_PARSERS, "auto"), default=None,
                       help="vLLM's flag: the format of the model's tool calls, and the one tools are described in "
                       "when the chat template does not render them (default: hermes); auto: the one whose call "
                       "syntax the chat template writes (<tool_call>: hermes, <|python_tag|>: llama3_json), hermes "
                       "for a template that renders no tools")
    serve.add_argument("--no-dashboard", action="store_true",
                       help="do not serve the live KV-cache view at /dashboard (it needs the API key when one is set, "
                       "as a header or as ?api_key=)")
    serve.add_argument("--dashboard-max-viewers", type=positive(int), default=100, metavar="N",
                       help="the most live-view streams (/dashboard/events) open at once; past it, a 503 (default: "
                       "100). A viewer whose socket takes nothing for 5 s is dropped, freeing its place")
    lora = serve.add_argument_group("LoRA adapters (with --enable-lora; --max-loras, --max-lora-rank and "
                                    "--max-cpu-loras size them)")
    lora.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                      help="vLLM's flag: PEFT LoRA adapters to serve, each under its name (a request's model), "
                      "as name=path or as JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                      "each is checked at start (a bad one stops the server)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which add and remove "
                      "adapters while the server runs (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); without it those "
                      "routes do not exist. A client that may call them can make the server read any directory "
                      "it can: for trusted clients only")
    ray = serve.add_argument_group("replicas on Ray Serve (pip install 'pagedserve[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve N engine replicas on Ray Serve behind one OpenAI ingress (a local Ray instance, or "
                     "--ray-address's cluster)")
    ray.add_argument("--num-replicas", type=positive(int), default=1, help="engine replicas (default: 1)")
    ray.add_argument("--autoscale", default=None, metavar="MIN..MAX",
                     help="let Ray Serve scale the replicas between MIN and MAX with the load")
    ray.add_argument("--replica-cpus", type=positive(int), default=None,
                     help="CPUs each replica reserves and computes on (default: this machine's cores divided among "
                     "the replicas, at least 1)")
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster (e.g. auto, or HOST:6379)")
    ray.add_argument("--router", choices=("prefix-aware", "default", "prefix-cache-affinity"), default="prefix-aware",
                     help="which replica takes a request: the one most likely to hold its prefix (default); Ray Serve's "
                     "default (power of two choices); or Ray Serve LLM's PrefixCacheAffinityRouter")
    ray.add_argument("--router-imbalance-threshold", type=int, default=8,
                     help="prefix-aware: how many more queued requests the preferred replica may have than the least "
                     "loaded before the request goes to the least loaded (default: 8)")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    kv = sub.add_parser("kv-calc", help="KV-cache bytes per token and per context for a model")
    kv.add_argument("--model", required=True, help="a preset (e.g. llama-3-8b), a config.json or an HF model directory")
    kv.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "fp8"])
    kv.add_argument("--tokens", type=int, default=None, help="context length (default: the model's maximum)")
    # dest tp_size, not tensor_parallel_size: main() sends commands with that attribute to a worker
    # when RANK is set, and kv-calc starts no ranks.
    kv.add_argument("--tensor-parallel-size", dest="tp_size", type=positive(int), default=1,
                    help="report per rank: each of N ranks holds max(1, KV heads / N) KV heads (default: 1)")
    kv.add_argument("--kv-cache-memory-bytes", type=positive(int), default=None,
                    help="the KV pool per device: report the tokens it holds (default with N > 1: what N=1 "
                    "needs for --tokens)")
    kv.add_argument("--block-size", type=positive(int), default=16,
                    help="tokens per KV block: a sliding-window layer keeps its window and one block (default: 16)")
    kv.set_defaults(func=cmd_kv_calc)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    mem = bench.add_parser("memory", help="contiguous vs paged KV allocation on one synthetic trace")
    mem.add_argument("--part", choices=["trace", "layouts"], default="trace",
                     help="trace: contiguous vs paged on the synthetic trace; layouts: models mixing full and "
                          "sliding-window layers (Gemma-3-27B, gpt-oss-20b, a 4k-window Mistral), KV cache groups "
                          "vs a uniform pool at long contexts")
    mem.add_argument("--kv-budget-gib", type=float, default=64.0, help="layouts: the KV budget")
    mem.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072], help="layouts: context lengths")
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

    hyb = bench.add_parser("hybrid", help="a Gemma-3-shaped model (sliding and full layers): KV cache groups against "
                                          "every layer keeping every token: decode steps by context, throughput "
                                          "under one KV budget, multi-turn prefix-cache hits")
    hyb.add_argument("--parts", nargs="+", choices=["steps", "throughput", "multi-turn"],
                     default=["steps", "throughput", "multi-turn"])
    hyb.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    hyb.add_argument("--batch", type=int, default=1, help="steps: requests per decode step")
    hyb.add_argument("--reps", type=int, default=5)
    hyb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    hyb.set_defaults(func=cmd_bench_hybrid)

    thr = bench.add_parser("throughput", help="pagedserve vs other systems on one workload, as ratios")
    thr.add_argument("--workload", default="sharegpt-like", choices=list(WORKLOADS))
    thr.add_argument("--systems", default="pagedserve,hf-static,hf-cb,vllm,llamacpp")
    thr.add_argument("--num-requests", type=int, default=64)
    thr.add_argument("--seed", type=int, default=0)
    thr.add_argument("--output-len", type=positive(int), default=None,
                     help="every request generates exactly this many tokens, its prompt unchanged (1: prompts alone)")
    thr.add_argument("--reps", type=int, default=3)
    thr.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    thr.add_argument("--max-num-seqs", type=int, default=256)
    thr.add_argument("--max-num-batched-tokens", type=int, default=2048)
    thr.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="pagedserve's KV pool (default: 1 GiB on CPU)")
    thr.add_argument("--tensor-parallel-size", type=positive(int), default=1,
                     help="also run pagedserve split over this many processes, beside TP=1 on the same threads")
    thr.add_argument("--device", default="cpu", help="where pagedserve and transformers run (cpu or cuda)")
    thr.add_argument("--model", default=None, help="an HF directory for pagedserve, transformers and vLLM (default: "
                     "embedded; llama.cpp always runs the embedded model)")
    thr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="pagedserve's and transformers' (auto: float32 on CPU, bfloat16 on CUDA)")
    thr.add_argument("--vllm-python", default=None, help="a Python with vllm installed (its own venv)")
    thr.add_argument("--hf-model-dir", default=None,
                     help="the model as an HF directory for vLLM (default: --model; the embedded model: pagedserve export-hf)")
    thr.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python installed")
    thr.add_argument("--quantization", default="auto",
                     help="pagedserve's weight formats, comma-separated (auto, none, int8, int4): a row each, the "
                          "first the one the others are compared with")
    thr.add_argument("--out-dir", default="docs")
    thr.add_argument("--json", default=None)
    thr.set_defaults(func=cmd_bench_throughput)

    lat = bench.add_parser("latency", help="one request at a time: time to first token and decode speed, "
                           "against llama.cpp, vLLM and the memory-bandwidth bound")
    lat.add_argument("--systems", default="pagedserve,llamacpp", help="comma list of pagedserve, llamacpp, vllm")
    lat.add_argument("--quantization", default="auto",
                     help="pagedserve's weight formats, a comma list of auto, none, int8, int4: a row each")
    lat.add_argument("--model", default=None, help="pagedserve's checkpoint, and llama.cpp's when a .gguf "
                     "(default: the embedded GGUF)")
    lat.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="pagedserve's dtype")
    lat.add_argument("--prompt-len", type=positive(int), default=128)
    lat.add_argument("--output-len", type=positive(int), default=128, help="greedy output tokens (at least 2)")
    lat.add_argument("--reps", type=positive(int), default=3, help="timed requests per system, after a warm-up")
    lat.add_argument("--seed", type=int, default=0, help="for the prompt's token ids")
    lat.add_argument("--llamacpp-python", default=None, help="a Python with llama-cpp-python installed")
    lat.add_argument("--llamacpp-threads", default=None,
                     help="comma list of llama.cpp thread counts, a row each (default: torch's thread count)")
    lat.add_argument("--vllm-python", default=None, help="a Python with vllm installed (its own venv)")
    lat.add_argument("--hf-model-dir", default=None,
                     help="the model as an HF directory for vLLM (the embedded model: pagedserve export-hf)")
    lat.add_argument("--bandwidth-gib", type=positive(float), default=1.0,
                     help="size of the tensor whose summing measures the read bandwidth")
    lat.add_argument("--out-dir", default=None, help="write bench_latency.md here")
    lat.add_argument("--json", default=None)
    lat.set_defaults(func=cmd_bench_latency)

    pre = bench.add_parser("prefix", help="shared-prefix workload with prefix caching on vs off")
    pre.add_argument("--num-requests", type=int, default=32)
    pre.add_argument("--prefix-len", type=int, default=512)
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--reps", type=int, default=1)
    pre.add_argument("--json", default=None)
    pre.set_defaults(func=cmd_bench_prefix)

    rt = bench.add_parser("routing", help="prefix-cache hit rates of replicas on Ray Serve under each request router")
    rt.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    rt.add_argument("--routers", default="default,prefix-cache-affinity,prefix-aware",
                    help="comma list of serve --ray's --router choices (default: all three)")
    rt.add_argument("--replicas", type=positive(int), default=2)
    rt.add_argument("--num-prompts", type=positive(int), default=4, help="distinct system prompts")
    rt.add_argument("--prompt-len", type=positive(int), default=512)
    rt.add_argument("--requests-per-prompt", type=positive(int), default=16)
    rt.add_argument("--concurrency", type=positive(int), default=4)
    rt.add_argument("--repeats", type=positive(int), default=1,
                    help="runs per router, each with its own random order (the default router's picks are random)")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--json", default=None)
    rt.set_defaults(func=cmd_bench_routing)

    so = bench.add_parser("structured", help="JSON-schema-constrained requests vs the same work unconstrained; "
                          "--part gaps: a streaming neighbour's token gaps while big schemas compile")
    so.add_argument("--part", choices=("throughput", "gaps"), default="throughput",
                    help="throughput: constrained vs free, offline; gaps: a real server's neighbour stream while "
                    "--concurrent schemas of --properties properties compile at once")
    so.add_argument("--num-requests", type=int, default=64)
    so.add_argument("--max-tokens", type=int, default=160)
    so.add_argument("--concurrent", type=int, default=3, help="gaps: schemas sent at once")
    so.add_argument("--properties", type=int, default=1000, help="gaps: properties in each schema")
    so.add_argument("--reps", type=int, default=1)
    so.add_argument("--out-dir", default=None, help="write bench_structured.md (gaps: bench_structured_gaps.md) here")
    so.add_argument("--json", default=None)
    so.set_defaults(func=cmd_bench_structured)

    st = bench.add_parser("startup", help="seconds from a new process to the first token, cold and warm cache")
    st.add_argument("--model", default=None)
    st.add_argument("--dtype", default="float32")
    st.add_argument("--reps", type=int, default=2, help="warm starts")
    st.add_argument("--out-dir", default=None, help="write bench_startup.md here")
    st.add_argument("--json", default=None)
    st.set_defaults(func=cmd_bench_startup)

    dash = bench.add_parser("dashboard", help="what live KV view viewers (reading, never reading, dropping) cost a "
                            "neighbour stream and /health on a real server")
    dash.add_argument("--viewers", type=int, default=1000, help="clients reading /dashboard/events")
    dash.add_argument("--non-readers", type=int, default=300, help="connections that ask for it and never read")
    dash.add_argument("--churn", type=int, default=20, help="clients that connect, ask and drop, in a loop")
    dash.add_argument("--max-viewers", nargs="+", default=["default"], metavar="N|default",
                      help="a server for each: its --dashboard-max-viewers (default: the server's default)")
    dash.add_argument("--seconds", type=positive(float), default=40.0, help="the loaded phase's length")
    dash.add_argument("--quiet-seconds", type=positive(float), default=10.0, help="the neighbour alone, first")
    dash.add_argument("--server-args", default="", help="more flags for each server, e.g. '--num-kv-blocks 4096'")
    dash.add_argument("--out-dir", default=None, help="write bench_dashboard.md here")
    dash.add_argument("--json", default=None)
    dash.set_defaults(func=cmd_bench_dashboard)

    prof = bench.add_parser("profile", help="a decode step's time by part, and decode speed vs the matmul ceiling")
    prof.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    prof.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    prof.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's op table")
    prof.add_argument("--tensor-parallel-size", type=positive(int), default=1,
                      help="profile the model split over this many processes (the embedded model: 1 or 3)")
    prof.add_argument("--out-dir", default="docs")
    prof.add_argument("--json", default=None)
    prof.set_defaults(func=cmd_bench_profile)

    ovh = bench.add_parser("overhead", help="the engine's host time per decode step, by part, with a no-op model")
    ovh.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256], help="running requests in steady decode")
    ovh.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="prompt tokens per request")
    ovh.add_argument("--pools", type=int, nargs="+", default=[10_000, 1_000_000], help="KV pool sizes in blocks of 16")
    ovh.add_argument("--steps", type=int, default=50, help="timed decode steps per scenario")
    ovh.add_argument("--pool-states", nargs="+", default=["fresh", "cached"], choices=["fresh", "cached", "watched"],
                     help="fresh: a new engine; cached: every free block holds a cached prefix first (a server "
                     "that has run a while); watched: fresh, with a dashboard viewer watching the KV pool")
    ovh.add_argument("--threads", type=int, default=1, help="torch intra-op threads while it runs (0: leave as is)")
    ovh.add_argument("--out-dir", default="docs")
    ovh.add_argument("--json", default=None)
    ovh.set_defaults(func=cmd_bench_overhead)

    srv = bench.add_parser("serving", help="load generator against an OpenAI-compatible server")
    srv.add_argument("--url", nargs="+", default=None, metavar="[NAME=]URL",
                     help="running servers to measure, taking turns (default: http://127.0.0.1:8000 "
                     "unless --systems is given)")
    srv.add_argument("--systems", default=None, help="servers the bench starts itself, each on a free loopback port: "
                     "a comma list of pagedserve, vllm")
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="for the servers of --systems")
    srv.add_argument("--vllm-python", default=None, help="a Python with vllm installed, for --systems vllm")
    srv.add_argument("--hf-model-dir", default=None, help="the model as an HF directory for vLLM (pagedserve export-hf)")
    srv.add_argument("--warmup-requests", type=int, default=8,
                     help="requests sent at once, unrecorded, before a server's timed runs (0: none)")
    srv.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                     help="requests per second (inf: all at once); several rates give a latency-vs-rate table")
    srv.add_argument("--out-dir", default=None, help="write bench_serving.md and .png (latency vs rate) here")
    srv.add_argument("--num-requests", type=int, default=64)
    srv.add_argument("--rounds", type=int, default=1,
                     help="measure every rate this many times, the systems taking turns (new prompts each round); "
                     "the tables give the median over rounds")
    srv.add_argument("--max-output-len", type=int, default=256)
    srv.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="the model name the server serves")
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--json", default=None)
    srv.set_defaults(func=cmd_bench_serving)

    spec = bench.add_parser("spec", help="speculative decoding (n-gram, suffix, draft model) against speculation "
                            "off, in one run, as ratios; and the cost of a decode row")
    spec.add_argument("--parts", default="copy,draft,batch,cost",
                      help="comma list of copy (batch 1, copy-edit: ngram, suffix), draft (batch 1, sharegpt-like: "
                      "a Q4 draft of the model), batch (--batch requests at once, sharegpt-like: ngram), cost "
                      "(a decode step's time by rows)")
    spec.add_argument("--serving", action="store_true",
                      help="also start `pagedserve serve` without and with ngram speculation and compare TPOT at "
                      "--serving-rate")
    spec.add_argument("--reps", type=positive(int), default=3, help="timed repetitions of the batch-1 parts")
    spec.add_argument("--batch-reps", type=positive(int), default=3, help="timed repetitions of the batch part")
    spec.add_argument("--copy-requests", type=positive(int), default=8)
    spec.add_argument("--sharegpt-requests", type=positive(int), default=8, help="requests of the draft part")
    spec.add_argument("--max-tokens", type=positive(int), default=256, help="the copy-edit requests' max_tokens")
    spec.add_argument("--batch", type=positive(int), default=32, help="max_num_seqs of the batch part")
    spec.add_argument("--batch-requests", type=positive(int), default=64)
    spec.add_argument("--serving-requests", type=positive(int), default=16)
    spec.add_argument("--serving-rate", type=positive(float), default=1.0)
    spec.add_argument("--seed", type=int, default=0)
    spec.add_argument("--out-dir", default=None, help="write bench_spec.md here")
    spec.add_argument("--plot", default=None, help="write the figure (ratios and the cost curve) here")
    spec.add_argument("--json", default=None)
    spec.set_defaults(func=cmd_bench_spec)

    off = bench.add_parser("offload", help="the KV offload tier (kv_offload_dir) against the engine without it: "
                           "multi-turn TTFT, the cost without reuse, a restart, preemption by swap")
    off.add_argument("--parts", default="multiturn,noreuse,restart,swap",
                     help="comma list of multiturn (interleaved chat sessions whose contexts outgrow the pool), "
                     "noreuse (unique prompts: the cost of writing), restart (a new engine on the same tier "
                     "directory), swap (preemption_mode swap vs recompute)")
    off.add_argument("--sessions", type=positive(int), default=8, help="multiturn: chat sessions")
    off.add_argument("--turns", type=positive(int), default=4, help="multiturn: turns per session")
    off.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: system prompt tokens")
    off.add_argument("--user-len", type=positive(int), default=64, help="multiturn: tokens per user message")
    off.add_argument("--answer-len", type=positive(int), default=32, help="multiturn: tokens per answer")
    off.add_argument("--shared-system-prompt", action="store_true",
                     help="multiturn: one system prompt for every session (default: one each)")
    off.add_argument("--concurrency", type=positive(int), default=2, help="multiturn: sessions per generate call")
    off.add_argument("--pool-ratio", type=positive(float), default=4.0,
                     help="multiturn: the sessions' final contexts / the KV pool")
    off.add_argument("--policies", default="write_through,evicted",
                     help="multiturn: the kv_offload_policy of each tier row, a comma list of write_through, evicted")
    off.add_argument("--noreuse-requests", type=positive(int), default=32)
    off.add_argument("--noreuse-min-prompt-len", type=positive(int), default=256)
    off.add_argument("--noreuse-max-prompt-len", type=positive(int), default=512)
    off.add_argument("--noreuse-output-len", type=positive(int), default=64)
    off.add_argument("--restart-prefix-len", type=positive(int), default=2000, help="restart: system prompt tokens")
    off.add_argument("--restart-question-len", type=positive(int), default=16)
    off.add_argument("--restart-output-len", type=positive(int), default=4)
    off.add_argument("--restart-reps", type=positive(int), default=3, help="restart: repetitions (median)")
    off.add_argument("--swap-requests", type=positive(int), default=32)
    off.add_argument("--swap-prompt-len", type=positive(int), default=64)
    off.add_argument("--swap-output-len", type=positive(int), default=128)
    off.add_argument("--swap-max-num-seqs", type=positive(int), default=16)
    off.add_argument("--swap-blocks", type=positive(int), default=None,
                     help="swap: KV pool blocks (default: half of what max_num_seqs requests hold at their longest)")
    off.add_argument("--reps", type=positive(int), default=2,
                     help="repetitions of multiturn, noreuse and swap, configurations taking turns (medians)")
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--offload-root", default=None,
                     help="where each tier's temporary directory is made (default: the system's temporary directory)")
    off.add_argument("--offload-bytes", type=positive(int), default=None,
                     help="kv_offload_bytes of every tier (default: the engine's)")
    off.add_argument("--out-dir", default=None, help="write bench_offload.md here")
    off.add_argument("--plot", default=None, help="write the figure (one panel per part) here")
    off.add_argument("--json", default=None)
    off.set_defaults(func=cmd_bench_offload)

    lora = bench.add_parser("lora", help="many LoRA adapters served at once against the base model alone: output "
                            "tokens/s, and the time to load an adapter")
    lora.add_argument("--parts", default="throughput,load", help="comma list of throughput, load")
    lora.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    lora.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    lora.add_argument("--quantization", default="auto", help="the engines' quantization (EngineConfig's)")
    lora.add_argument("--num-adapters", type=positive(int), default=8, help="random adapters, each in a slot")
    lora.add_argument("--rank", type=positive(int), default=16)
    lora.add_argument("--requests", type=positive(int), default=32, help="requests at once, request i on adapter "
                      "i mod N")
    lora.add_argument("--prompt-len", type=positive(int), default=128)
    lora.add_argument("--output-len", type=positive(int), default=128)
    lora.add_argument("--reps", type=positive(int), default=5, help="throughput: repetitions, systems in turn")
    lora.add_argument("--load-reps", type=positive(int), default=10, help="load: repetitions (medians)")
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--out-dir", default=None, help="write bench_lora.md here")
    lora.add_argument("--plot", default=None, help="write the throughput figure here")
    lora.add_argument("--json", default=None)
    lora.set_defaults(func=cmd_bench_lora)

    worker = sub.add_parser(
        "worker", help="a tensor-parallel rank > 0 for an engine on another machine (env:// rendezvous)",
        description="Join the tensor-parallel group that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT name "
        "(torch.distributed's env://) and run this rank's shard of every step until the driver (RANK=0: any "
        "engine command with --tensor-parallel-size WORLD_SIZE) shuts down. The model and engine settings come "
        "from the driver; the model path must exist on this machine too.")
    worker.add_argument("--distributed-timeout", type=positive(float), default=300.0,
                        help="seconds a collective may wait for the other ranks (default: 300)")
    worker.set_defaults(func=cmd_worker)

    exp = sub.add_parser("export-hf", help="write the embedded model as an HF directory (for vLLM)")
    exp.add_argument("--out", required=True)
    exp.set_defaults(func=cmd_export_hf)
    return parser


def cmd_worker(args: argparse.Namespace) -> None:
    from pagedserve.worker.tp_worker import run_from_env

    run_from_env(args.distributed_timeout)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "tensor_parallel_size", 1) > 1 and os.environ.get("RANK", "0") != "0":
        # torchrun starts this same command on every rank: the driver is rank 0, the rest serve it.
        args.func, args.distributed_timeout = cmd_worker, getattr(args, "distributed_timeout", 300.0)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:  # bad input or a path that is not there: one line, no traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
