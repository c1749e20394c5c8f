"""`pagedserve bench lora`: serving many LoRA adapters at once against the base model alone, in one
run, on the same prompts and engine settings, reported as ratios.

Parts:
- throughput: `num_requests` requests at once (random prompts, `output_len` tokens each, greedy,
  EOS ignored), on three systems, each a warm engine:
  - "base model": an engine without LoRA (the baseline);
  - "LoRA on, base requests": an engine with enable_lora whose requests name no adapter (what
    having LoRA on costs a server whose traffic is mostly the base model's);
  - "N adapters": the same engine, request i under adapter i mod N (`num_adapters` random
    rank-`rank` adapters on all 7 projections), every adapter in a slot (max_loras = N), so
    each step mixes them all;
  - "N adapters, one at a time": the same requests, one adapter's requests after another's (a
    batch per adapter), as a server that runs one adapter at a time would: the batching that mixing
    adapters in a step buys.
  Systems take turns within each repetition (prefix cache reset before each run); ratios are
  taken within a repetition and the table gives medians. The LoRA engine's base requests must
  give the base engine's greedy tokens (counted per row), and the adapters' requests the same
  tokens mixed as one adapter at a time (the CLI fails otherwise); the adapters' outputs are counted
  where they differ from the base model's (an adapter that changes nothing would be a broken bench).
- load: one adapter read from disk into host memory (`load_adapter`: safetensors, checks, scaling,
  dtype) and copied from there into a free slot (`load_slot`), each timed `load_reps` times on
  the LoRA engine's model; the table gives medians.

The adapters are written by this module in PEFT's format with random weights (a fresh temporary
directory, removed afterwards); the two engines have a copy of the model each, as an engine with
LoRA takes its model's linear layers for its slots.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time

from pagedserve.bench.offload import safe_vocab
from pagedserve.bench.workload import Workload, WorkloadRequest
from pagedserve.lora.weights import PROJECTION_PARENT

BASE, LORA_BASE = "base model", "LoRA on, base requests"


def projection_shapes(model_config) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each of a decoder layer's 7 projections."""
    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
            "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
            "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}


def write_random_adapter(path: str, model_config, rank: int, seed: int, alpha: float | None = None) -> str:
    """A PEFT LoRA adapter directory with random A and B on all 7 projections of every layer:
    adapter_config.json and adapter_model.safetensors, named as PEFT saves them."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for proj, (fan_in, fan_out) in projection_shapes(model_config).items():
            name = f"base_model.model.model.layers.{layer}.{PROJECTION_PARENT[proj]}.{proj}"
            bound = fan_in ** -0.5
            tensors[f"{name}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=gen) * 2 - 1) * bound
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": sorted(PROJECTION_PARENT), "bias": "none", "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "modules_to_save": None, "lora_dropout": 0.0}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def random_prompts(model_config, num_requests: int, prompt_len: int, output_len: int, seed: int) -> Workload:
    rng = random.Random(seed)
    vocab = safe_vocab(model_config)
    return Workload("lora", [WorkloadRequest([rng.choice(vocab) for _ in range(prompt_len)], output_len)
                             for _ in range(num_requests)])


def _engine(loaded, tokenizer, **kwargs):
    """An LLM over `loaded` (a load_model result) with these EngineConfig settings."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_engine(LLMEngine(EngineConfig(**kwargs), model=loaded, tokenizer=tokenizer))


def _run(llm, workload: Workload, adapters: list | None, one_at_a_time: bool = False) -> dict:
    """One timed run of the whole workload (adapters: one per request, or None): one generate call,
    or with `one_at_a_time` one call per adapter, in turn."""
    from pagedserve.sampling_params import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=workload.requests[0].output_len, temperature=0.0, ignore_eos=True)
    indices = list(range(len(workload.requests)))
    groups = [[i for i in indices if adapters[i] == a] for a in dict.fromkeys(adapters)] if one_at_a_time \
        else [indices]
    answers: list = [None] * len(indices)
    start = time.perf_counter()
    for group in groups:
        outputs = llm.generate([{"prompt_token_ids": workload.requests[i].prompt_token_ids} for i in group], params,
                               use_tqdm=False, lora_request=None if adapters is None else [adapters[i] for i in group])
        for i, o in zip(group, outputs):
            answers[i] = list(o.outputs[0].token_ids)
    return {"seconds": time.perf_counter() - start, "answers": answers}


def throughput_part(model_path, tokenizer, engine_kwargs: dict, workload: Workload, adapters: list,
                    reps: int, log) -> tuple[dict, object]:
    """The three systems (module docstring), `reps` times in turn. Returns the part's report and the
    LoRA engine (the load part times its model)."""
    engines = {BASE: _engine(_load(model_path, engine_kwargs), tokenizer, **engine_kwargs),
               "lora": _lora_engine(model_path, tokenizer, engine_kwargs, adapters)}
    per_request = [adapters[i % len(adapters)] for i in range(len(workload.requests))]
    mixed = f"{len(adapters)} adapters"
    systems = {BASE: (engines[BASE], None, False), LORA_BASE: (engines["lora"], None, False),
               mixed: (engines["lora"], per_request, False),
               f"{mixed}, one at a time": (engines["lora"], per_request, True)}
    for llm, lora, _ in list(systems.values())[:3]:  # warm: the first steps of an engine pay for lazy set-up
        _run(llm, Workload("warm-up", workload.requests[:2]), None if lora is None else lora[:2])
    rows = {name: {"seconds": [], "ratios": [], "answers": None} for name in systems}
    for rep in range(reps):
        base_seconds = None
        for name, (llm, lora, one_at_a_time) in systems.items():
            r = _run(llm, workload, lora, one_at_a_time)
            base_seconds = r["seconds"] if name == BASE else base_seconds
            rows[name]["seconds"].append(r["seconds"])
            rows[name]["ratios"].append(base_seconds / r["seconds"])
            rows[name]["answers"] = r["answers"]
            log(f"  throughput, rep {rep + 1}/{reps}, {name}: {r['seconds']:.2f} s, "
                f"{workload.num_output_tokens / r['seconds']:.1f} output tok/s")
    base_answers = rows[BASE]["answers"]
    out_rows = []
    for name, row in rows.items():
        same = sum(a == b for a, b in zip(row["answers"], base_answers))
        seconds = statistics.median(row["seconds"])
        out_rows.append({"system": name, "seconds_median": seconds,
                         "output_tps": workload.num_output_tokens / seconds,
                         "tps_ratio": statistics.median(row["ratios"]),
                         "same_as_base": same, "requests": len(base_answers)})
    identical = next(r for r in out_rows if r["system"] == LORA_BASE)["same_as_base"] == len(base_answers)
    # Greedy tokens do not depend on the batch: an adapter's requests alone get what they got mixed.
    batch_invariant = rows[mixed]["answers"] == rows[f"{mixed}, one at a time"]["answers"]
    return {"workload": workload.describe(), "reps": reps, "rows": out_rows, "base_requests_identical": identical,
            "adapters_batch_invariant": batch_invariant, "engine": engine_kwargs}, engines["lora"]


def _load(model_path: str, engine_kwargs: dict):
    """A copy of the model of its own (an engine with LoRA takes its model's linear layers)."""
    import torch

    from pagedserve.models.loader import load_model

    return load_model(model_path, dtype=getattr(torch, engine_kwargs["dtype"]),
                      quantization=engine_kwargs["quantization"])


def _lora_engine(model_path: str, tokenizer, engine_kwargs: dict, adapters: list):
    """An engine with a slot for every adapter, on a copy of the model of its own."""
    rank = max(json.load(open(os.path.join(a.lora_path, "adapter_config.json")))["r"] for a in adapters)
    return _engine(_load(model_path, engine_kwargs), tokenizer, **engine_kwargs, enable_lora=True,
                   max_loras=len(adapters), max_lora_rank=rank)


def load_part(llm, adapter, reps: int) -> dict:
    """Median times of reading `adapter` into host memory and copying it into a free slot."""
    from pagedserve.lora.layers import load_slot
    from pagedserve.lora.weights import load_adapter

    runner = llm.llm_engine.runner
    model, config = runner.model, llm.llm_engine.config
    disk, slot = [], []
    for _ in range(reps):
        start = time.perf_counter()
        weights = load_adapter(adapter.lora_path, runner.model_config, config.max_lora_rank, config.torch_dtype,
                               model.shard)
        disk.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_slot(model, 0, weights)
        slot.append(time.perf_counter() - start)
    llm.llm_engine.scheduler.lora_slots.forget_all()  # slot 0's adapter changed behind the scheduler's back
    return {"reps": reps, "adapter_bytes": weights.nbytes, "disk_to_host_s": statistics.median(disk),
            "host_to_slot_s": statistics.median(slot)}


def run_lora_bench(parts=("throughput", "load"), num_adapters: int = 8, rank: int = 16, num_requests: int = 32,
                   prompt_len: int = 128, output_len: int = 128, reps: int = 5, load_reps: int = 10,
                   model: str | None = None, dtype: str = "float32", quantization: str = "auto",
                   max_num_seqs: int = 256, seed: int = 0, tokenizer=None, log=print) -> dict:
    """The parts' reports (module docstring). `tokenizer`: the model's by default."""
    from pagedserve.lora.request import LoRARequest
    from pagedserve.models.loader import load_config, load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    model_config, tokenizer = load_config(path), tokenizer or load_tokenizer(model)
    engine_kwargs = {"model": model, "dtype": dtype, "quantization": quantization, "max_num_seqs": max_num_seqs,
                     "max_model_len": prompt_len + output_len, "seed": seed}
    report: dict = {"parts": list(parts), "model": path,
                    "num_adapters": num_adapters, "rank": rank, "dtype": dtype, "quantization": quantization}
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-bench-") as root:
        adapters = [LoRARequest(f"adapter-{i}", i + 1, write_random_adapter(os.path.join(root, f"a{i}"), model_config,
                                                                            rank, seed + i))
                    for i in range(max(1, num_adapters))]
        workload = random_prompts(model_config, num_requests, prompt_len, output_len, seed)
        lora_engine = None
        if "throughput" in parts:
            report["throughput"], lora_engine = throughput_part(path, tokenizer, engine_kwargs, workload, adapters,
                                                                reps, log)
        if "load" in parts:
            lora_engine = lora_engine or _lora_engine(path, tokenizer, engine_kwargs, adapters)
            report["load"] = load_part(lora_engine, adapters[0], load_reps)
    throughput = report.get("throughput", {})
    report["all_identical"] = throughput.get("base_requests_identical", True) and \
        throughput.get("adapters_batch_invariant", True)
    return report


def markdown_table(report: dict) -> str:
    lines = [f"LoRA: {report['num_adapters']} adapters of rank {report['rank']} (all 7 projections), "
             f"{report['dtype']}, quantization {report['quantization']}", ""]
    if "throughput" in report:
        t = report["throughput"]
        lines += [f"throughput: {t['workload']}, medians of {t['reps']} reps", "",
                  "| system | output tok/s | x base model | greedy tokens = base model's |",
                  "|---|---:|---:|---:|"]
        for r in t["rows"]:
            lines.append(f"| {r['system']} | {r['output_tps']:.1f} | {r['tps_ratio']:.3f} | "
                         f"{r['same_as_base']}/{r['requests']} |")
        lines += ["", "Adapters' greedy tokens mixed = one adapter at a time: "
                  f"{'yes' if t['adapters_batch_invariant'] else 'NO'}", ""]
    if "load" in report:
        ld = report["load"]
        lines += [f"adapter load ({ld['adapter_bytes'] / 2**20:.1f} MiB in the model's dtype), medians of "
                  f"{ld['reps']}", "", "| step | ms |", "|---|---:|",
                  f"| disk -> host memory (read, check, scale) | {ld['disk_to_host_s'] * 1e3:.1f} |",
                  f"| host memory -> free slot | {ld['host_to_slot_s'] * 1e3:.1f} |",
                  f"| both | {(ld['disk_to_host_s'] + ld['host_to_slot_s']) * 1e3:.1f} |", ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["throughput"]["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(range(len(rows)), [r["output_tps"] for r in rows], color=["tab:grey"] + ["tab:blue"] * (len(rows) - 1))
    ax.set_xticks(range(len(rows)), [r["system"].replace(", ", ",\n") for r in rows], fontsize=7)
    ax.set_ylabel("output tokens/s")
    ax.set_title(report["throughput"]["workload"], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
