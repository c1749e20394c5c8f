"""`pagedserve bench latency`: one request at a time, the same prompt ids for every system; per
system its time to first token, its decode speed after the first token and its peak resident memory,
beside the decode speed this machine's memory bandwidth allows for the weights pagedserve reads.

Systems:
- pagedserve: one row per `quantization` value, each in a fresh process (so that its peak memory is
  its own), timed inside it after a warm-up request from the request's own metrics (arrival, first
  token, finish);
- llamacpp: llama-cpp-python on the same GGUF (one row per thread count);
- vllm: vLLM's CPU build (bfloat16) on an HF directory, bound to every core.
vllm and llamacpp run under their own Python (`--vllm-python`, `--llamacpp-python`) and are skipped
with a message when it is not given.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from pagedserve.bench.throughput import driver_command, run_driver, vllm_all_cores_env
from pagedserve.bench.workload import Workload, single_request

SYSTEMS = ("pagedserve", "llamacpp", "vllm")


@dataclass
class LatencyResult:
    system: str
    ttft_s: list[float] | None = None  # one per repetition
    decode_tps: list[float] | None = None  # tokens after the first / seconds after the first, per repetition
    peak_rss_bytes: int | None = None
    weight_bytes: int | None = None  # weight bytes one decode step reads
    note: str = ""
    skipped: str | None = None  # why it did not run
    token_ids: list[int] | None = None  # the last repetition's output

    @property
    def ttft_ms(self) -> float:
        return 1e3 * statistics.median(self.ttft_s)

    @property
    def decode(self) -> float:
        return statistics.median(self.decode_tps)

    def summary(self) -> dict:
        if self.skipped:
            return {"system": self.system, "skipped": self.skipped}
        return {"system": self.system, "ttft_ms_median": self.ttft_ms, "decode_tps_median": self.decode,
                "ttft_s": self.ttft_s, "decode_tps": self.decode_tps, "peak_rss_bytes": self.peak_rss_bytes,
                "weight_bytes": self.weight_bytes, "note": self.note, "token_ids": self.token_ids}

    @classmethod
    def from_report(cls, system: str, report: dict) -> LatencyResult:
        return cls(system, report["ttft_s"], report["decode_tps"], report.get("peak_rss_bytes"),
                   report.get("weight_bytes"), report.get("note", ""), token_ids=report.get("token_ids"))


# ---- what bounds a decode step ---------------------------------------------------------------


def read_bandwidth(size_bytes: int = 1 << 30, passes: int = 5) -> tuple[float, str]:
    """(bytes per second, the way that reached it) torch reads on its threads: the best of `passes`
    runs each of two reads of one float32 tensor of `size_bytes` (far larger than the caches), a sum
    and a matrix-vector product over it as a [rows, 4096] matrix (a decode step's read; MKL's gemv
    prefetches better than torch's reduction)."""
    x = torch.ones(max(1, size_bytes // (4 * 4096)) * 4096, dtype=torch.float32)
    matrix, vector = x.view(-1, 4096), torch.ones(4096)
    reads = {"torch.sum": lambda: x.sum(), "torch.mv": lambda: torch.mv(matrix, vector)}
    best = {}
    for name, read in reads.items():
        read()  # the pages are touched and the threads started before timing
        for _ in range(passes):
            start = time.perf_counter()
            read()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    name = min(best, key=best.get)
    return x.numel() * 4 / best[name], name


def cpu_seconds_of_others(since: tuple[float, float]) -> float:
    """CPU seconds the whole machine was busy since `since` (a `cpu_clock()` reading), less those of
    this process and its children: what other programs took while a row ran."""
    machine, ours = cpu_clock()
    return (machine - since[0]) - (ours - since[1])


def cpu_clock() -> tuple[float, float]:
    """(CPU seconds the machine has been busy, all cores, from /proc/stat; CPU seconds of this
    process and its finished children)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return machine, sum(r.ru_utime + r.ru_stime for r in own)


def decode_weight_bytes(model) -> int:
    """The bytes of every tensor in the model's state_dict() that a decode step reads: the rotary
    tables left out, and the embedding table too unless it is the LM head (a decode step gathers one
    row of it); a tensor held under two names counted once."""
    embedding = next(name for name, module in model.named_modules() if module is model.model.embed_tokens) + "."
    seen, total = set(), 0
    for name, tensor in model.state_dict().items():
        if "rotary" in name or (name.startswith(embedding) and not model.config.tie_word_embeddings):
            continue
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def gguf_weight_bytes(path: str) -> int:
    """The same figure for a GGUF file as llama.cpp runs it: every tensor, the token embedding only
    when there is no separate output matrix."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


# ---- the systems -----------------------------------------------------------------------------


def run_pagedserve(workload: Workload, reps: int, quantization: str, model: str | None, dtype: str) -> LatencyResult:
    """One quantization setting in a fresh process (this module's __main__)."""
    label = f"pagedserve (quantization={quantization})"
    spec = {"workload": workload.to_json(), "reps": reps, "model": model, "dtype": dtype, "quantization": quantization}
    try:
        report = run_driver([sys.executable, "-m", "pagedserve.bench.latency"], spec)
    except RuntimeError as e:
        return LatencyResult(label, skipped=str(e))
    return LatencyResult.from_report(label, report)


def _pagedserve_child(spec: dict) -> dict:
    """Inside the fresh process: build the engine with a KV pool just big enough for the request,
    warm up with the request once, then time it `reps` times."""
    from pagedserve.config import EngineConfig
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    (request,) = spec["workload"]["requests"]
    max_model_len = len(request["prompt_token_ids"]) + request["output_len"]
    block_size = EngineConfig.block_size
    llm = LLM(spec["model"], dtype=spec["dtype"], quantization=spec["quantization"], max_model_len=max_model_len,
              num_kv_blocks=-(-max_model_len // block_size))
    prompt = {"prompt_token_ids": request["prompt_token_ids"]}
    params = SamplingParams(max_tokens=request["output_len"], temperature=0.0, ignore_eos=True)

    def one() -> tuple[float, float, list[int]]:
        llm.reset_prefix_cache()  # the prompt is prefilled cold every time
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        tokens, m = list(out.outputs[0].token_ids), out.metrics
        return (m["first_token_time"] - m["arrival_time"],
                (len(tokens) - 1) / (m["finish_time"] - m["first_token_time"]), tokens)

    one()
    runs = [one() for _ in range(spec["reps"])]
    config = llm.llm_engine.config
    report = {"ttft_s": [r[0] for r in runs], "decode_tps": [r[1] for r in runs], "token_ids": runs[-1][2],
              "weight_bytes": decode_weight_bytes(llm.llm_engine.model),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "note": f"{spec['dtype']}, {torch.get_num_threads()} threads, paged KV, block {config.block_size}"}
    llm.shutdown()
    return report


def run_llamacpp(workload: Workload, reps: int, python: str | None, gguf: str, threads: int) -> LatencyResult:
    label = f"llamacpp ({threads} thread{'s' * (threads > 1)})"
    if not python:
        return LatencyResult(label, skipped="not run: pass --llamacpp-python PATH to a Python that has llama-cpp-python")
    spec = {"workload": workload.to_json(), "model": gguf, "reps": reps, "threads": threads, "mode": "latency"}
    try:
        report = run_driver(driver_command("llamacpp", python), spec)
    except RuntimeError as e:
        return LatencyResult(label, skipped=str(e))
    return LatencyResult.from_report(label, report | {"weight_bytes": gguf_weight_bytes(gguf)})


def run_vllm(workload: Workload, reps: int, python: str | None, hf_model_dir: str | None) -> LatencyResult:
    label = f"vllm (bfloat16, {os.cpu_count()} threads)"
    if not python:
        return LatencyResult(label, skipped="not run: pass --vllm-python PATH to a Python that has vllm")
    if not hf_model_dir:
        return LatencyResult(label, skipped="not run: vLLM needs the model as an HF directory (--hf-model-dir)")
    spec = {"workload": workload.to_json(), "model": hf_model_dir, "reps": reps, "dtype": "bfloat16",
            "mode": "latency"}
    try:
        report = run_driver(driver_command("vllm", python), spec, env=vllm_all_cores_env())
    except RuntimeError as e:
        return LatencyResult(label, skipped=str(e))
    return LatencyResult.from_report(label, report)


def run_latency_bench(systems: list[str], quantizations: list[str], prompt_len: int = 128, output_len: int = 128,
                      reps: int = 3, seed: int = 0, model: str | None = None, dtype: str = "float32",
                      llamacpp_python: str | None = None, llamacpp_threads: list[int] | None = None,
                      vllm_python: str | None = None, hf_model_dir: str | None = None,
                      bandwidth_bytes: int = 1 << 30, log=print) -> tuple[Workload, list[LatencyResult], float, str]:
    """(the request, a row per system, this machine's read bandwidth in bytes/s and the read that
    reached it). pagedserve runs
    `model` (default: the embedded GGUF), llama.cpp the same file (it must be a GGUF)."""
    from pagedserve.models.loader import embedded_model_path, load_tokenizer

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    if output_len < 2:
        raise ValueError(f"output_len must be at least 2 (decode speed is measured after the first token), got {output_len}")
    tokenizer = load_tokenizer(model)
    special = set(tokenizer.all_special_ids)
    workload = single_request(prompt_len, output_len, seed, [i for i in range(len(tokenizer)) if i not in special])

    runs = []  # (label, thunk returning a LatencyResult)
    for system in systems:
        if system == "pagedserve":
            runs += [(f"pagedserve {q}", lambda q=q: run_pagedserve(workload, reps, q, model, dtype)) for q in quantizations]
        elif system == "llamacpp":
            gguf = model or embedded_model_path()
            if not gguf.endswith(".gguf"):
                runs.append(("llamacpp", lambda: LatencyResult("llamacpp", skipped=f"not run: {gguf} is not a .gguf")))
                continue
            runs += [(f"llamacpp {n} threads", lambda n=n: run_llamacpp(workload, reps, llamacpp_python, gguf, n))
                     for n in llamacpp_threads or [torch.get_num_threads()]]
        else:
            runs.append(("vllm", lambda: run_vllm(workload, reps, vllm_python, hf_model_dir)))
    results = []
    for label, run in runs:
        log(f"running {label} ...")
        # The machine may be shared: what other programs took of it while the row ran shows in its notes.
        start, clock = time.perf_counter(), cpu_clock()
        results.append(run())
        others = cpu_seconds_of_others(clock) / ((time.perf_counter() - start) * os.cpu_count())
        results[-1].note = "; ".join(filter(None, [results[-1].note, f"other programs: {max(others, 0):.0%} CPU"]))
        log("  " + json.dumps({k: v for k, v in results[-1].summary().items() if k != "token_ids"})[:300])
    log("measuring the read bandwidth ...")
    return workload, results, *read_bandwidth(bandwidth_bytes)


# ---- the report ------------------------------------------------------------------------------


def markdown_table(workload: Workload, results: list[LatencyResult], bandwidth: float, bandwidth_bytes: int,
                   bandwidth_read: str) -> str:
    (request,) = workload.requests
    runs = max((len(r.ttft_s) for r in results if not r.skipped), default=0)
    lines = [f"One request at a time: a {len(request.prompt_token_ids)}-token prompt (random ids), "
             f"{request.output_len} greedy output tokens (ignore_eos); median of {runs} runs after a warm-up. "
             "TTFT: from adding the request to its first token. Decode: tokens after the first / seconds after the "
             "first. Peak RSS: the process's peak resident memory (vLLM: the sum of its processes' peaks). "
             "Weights/token: the weight bytes a decode step reads (embedding table excluded unless it is the LM "
             f"head). Read bandwidth: {bandwidth / 1e9:.1f} GB/s, the best of 5 passes each of torch.sum and torch.mv "
             f"over a {bandwidth_bytes / 2**30:g} GiB float32 tensor on {torch.get_num_threads()} threads ({bandwidth_read} "
             "was faster), measured in this run; bound = bandwidth / weights per token (KV reads not counted). Other "
             "programs: the share of the machine's CPU time they took while the row ran (this machine is shared). "
             "Same tokens: the output tokens before the first difference from the first pagedserve row's.", "",
             "| system | TTFT ms | decode tok/s | peak RSS MB | weights/token MB | bound tok/s | % of bound "
             "| same tokens | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    ours = next((r for r in results if r.system.startswith("pagedserve") and not r.skipped), None)
    for r in results:
        if r.skipped:
            lines.append(f"| {r.system} | - | - | - | - | - | - | - | {r.skipped} |")
            continue
        rss = "-" if r.peak_rss_bytes is None else f"{r.peak_rss_bytes / 1e6:.0f}"
        if r.weight_bytes:
            bound = bandwidth / r.weight_bytes
            weights, bound_s, share = f"{r.weight_bytes / 1e6:.1f}", f"{bound:.0f}", f"{r.decode / bound:.0%}"
        else:
            weights = bound_s = share = "-"
        lines.append(f"| {r.system} | {r.ttft_ms:.1f} | {r.decode:.1f} ({min(r.decode_tps):.1f}..{max(r.decode_tps):.1f}) "
                     f"| {rss} | {weights} | {bound_s} | {share} | {agreement(ours, r)} | {r.note} |")
    return "\n".join(lines)


def agreement(ours: LatencyResult | None, other: LatencyResult) -> str:
    """How many of the output tokens `other` produced before its first difference from `ours`."""
    if ours is None or other is ours or not ours.token_ids or not other.token_ids:
        return "-"
    a, b = ours.token_ids, other.token_ids
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{same}/{len(b)}"


def ratios(results: list[LatencyResult]) -> list[str]:
    """Each pagedserve row against each llama.cpp row: decode speed and TTFT as ratios."""
    ran = [r for r in results if not r.skipped]
    lines = []
    for ours in (r for r in ran if r.system.startswith("pagedserve")):
        for theirs in (r for r in ran if r.system.startswith("llamacpp")):
            lines.append(f"{ours.system} / {theirs.system}: decode tokens/s {ours.decode / theirs.decode:.2f}x, "
                         f"TTFT {ours.ttft_ms / theirs.ttft_ms:.2f}x")
    return lines


if __name__ == "__main__":  # the fresh process of one pagedserve row: SPEC.json REPORT.json
    spec_path, report_path = sys.argv[1:3]
    with open(spec_path) as f:
        child_report = _pagedserve_child(json.load(f))
    with open(report_path, "w") as f:
        json.dump(child_report, f)
