"""`pagedserve bench throughput`: pagedserve and the systems users would otherwise pick, run on the
same token-id workload in one invocation, reported as ratios to pagedserve.

Systems:
- pagedserve: this engine (`LLM.generate`, greedy, ignore_eos so outputs have their set length);
- pagedserve-fp8: the same with an fp8 KV cache (kv_cache_dtype="fp8");
- hf-static: transformers `generate` in left-padded static batches (the contiguous-cache system:
  each batch runs until its longest output ends, and its cache is sized for that);
- hf-cb: transformers' own continuous batching (`init_continuous_batching`), if present;
- vllm / llamacpp: run by their own Python (`--vllm-python`, `--llamacpp-python`) as
  subprocesses over the same workload; skipped with a message when not given or not importable.
  vLLM runs twice, with its default threads (every core but one) and bound to every core;
  vllm-all-cores only the second way.
Every system runs the same weights: the embedded SmolLM2 in float32, except llama.cpp which
runs the GGUF (Q4_1) natively.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from pagedserve.bench.workload import Workload

DRIVERS = os.path.join(os.path.dirname(__file__), "drivers")
SYSTEMS = ("pagedserve", "pagedserve-fp8", "hf-static", "hf-cb", "vllm", "vllm-all-cores", "llamacpp")


@dataclass
class SystemResult:
    system: str
    seconds: list[float] = field(default_factory=list)  # one per repetition
    prompt_tokens: int = 0
    output_tokens: int = 0
    note: str = ""
    skipped: str | None = None  # why it did not run
    startup_s: float | None = None  # from building the engine to ready (weights, caches, compiling)
    token_ids: list[list[int]] | None = None  # the last run's outputs (greedy rows are compared)

    def output_tps(self, pick=statistics.median) -> float:
        return self.output_tokens / pick(self.seconds)

    def total_tps(self, pick=statistics.median) -> float:
        return (self.prompt_tokens + self.output_tokens) / pick(self.seconds)

    def summary(self) -> dict:
        if self.skipped:
            return {"system": self.system, "skipped": self.skipped}
        return {
            "system": self.system, "note": self.note, "seconds": self.seconds,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "output_tps_median": self.output_tps(), "output_tps_min": self.output_tps(max),
            "output_tps_max": self.output_tps(min), "total_tps_median": self.total_tps(),
            "startup_s": self.startup_s,
        }


def timed(run, reps: int, warm_up=None) -> list[float]:
    """Warm up (by default one whole run), then time `reps` runs."""
    (warm_up or run)()
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return seconds


# ---- the systems -----------------------------------------------------------------------------


def run_pagedserve(workload: Workload, reps: int, model, tokenizer, label: str = "pagedserve",
                   model_path: str | None = None, **engine_kwargs) -> SystemResult:
    """`model`: loaded weights to share, or (with tensor parallelism, where each rank loads its
    shard) None and the checkpoint's `model_path`."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    start = time.perf_counter()
    config = EngineConfig(model=model_path, **engine_kwargs)
    tp = config.tensor_parallel_size
    llm = LLM.from_engine(LLMEngine(config, model=model if tp == 1 else None, tokenizer=tokenizer))
    startup_s = time.perf_counter() - start
    if tp > 1:  # time rank 0's collectives (waits for the other ranks included)
        from pagedserve.bench.profile import Timers

        timers = Timers()
        timers.wrap(llm.llm_engine.runner.model.tp, "all_reduce", "collectives")
        timers.wrap(llm.llm_engine.runner.model.tp, "gather_columns", "collectives")
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [SamplingParams(n=r.n, max_tokens=r.output_len, temperature=0.0 if r.n == 1 else 1.0, seed=i,
                             ignore_eos=True) for i, r in enumerate(workload.requests)]
    token_ids: list[list[int]] = []

    def run():
        llm.reset_prefix_cache()  # every repetition prefills cold, as the first did
        outputs = llm.generate(prompts, params, use_tqdm=False)
        produced = sum(len(o.token_ids) for out in outputs for o in out.outputs)
        assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
        token_ids[:] = [list(out.outputs[0].token_ids) for out in outputs]

    from pagedserve.models.quantized import describe_weights

    kv = "" if config.kv_cache_dtype == "auto" else f" {config.kv_cache_dtype}"
    note = f"paged{kv} KV, block {config.block_size}; weights {describe_weights(llm.llm_engine.runner.model)}"
    try:
        seconds = timed(run, reps)
    finally:
        if tp > 1:
            executor = llm.llm_engine.core.executor
            steps = max(1, executor.num_steps)
            note += (f"; {tp} ranks, per step: {executor.broadcast_seconds / steps * 1e3:.2f} ms broadcast, "
                     f"{timers.totals['collectives'] / steps * 1e3:.1f} ms collectives")
        llm.shutdown()
    return SystemResult(label, seconds, workload.num_prompt_tokens, workload.num_output_tokens,
                        note=note, startup_s=startup_s, token_ids=token_ids)


def _hf_generation_kwargs(n: int) -> dict:
    sampling = dict(do_sample=True, temperature=1.0, num_return_sequences=n) if n > 1 else dict(do_sample=False)
    # No eos: every sequence runs to its set length, as with ignore_eos.
    return dict(eos_token_id=None, pad_token_id=0, **sampling)


def run_hf_static(workload: Workload, reps: int, hf_model, batch_size: int) -> SystemResult:
    """Static batching: fixed batches in arrival order, each padded to its longest prompt and run
    to its longest output; useful output = each request's own length."""
    reqs = workload.requests

    def run(reqs=reqs):
        for batch in [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]:
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
            mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
            steps = max(r.output_len for r in batch)
            with torch.inference_mode():
                hf_model.generate(ids.to(hf_model.device), attention_mask=mask.to(hf_model.device), max_new_tokens=steps,
                                  min_new_tokens=steps, **_hf_generation_kwargs(batch[0].n))
        if hf_model.device.type == "cuda":
            torch.cuda.synchronize()

    # transformers needs no long warm-up: a few requests load its kernels, and save minutes.
    return SystemResult(f"hf-static (batch {batch_size})", timed(run, reps, lambda: run(reqs[:2])), workload.num_prompt_tokens,
                        workload.num_output_tokens, note="transformers generate, padded static batches")


def run_hf_cb(workload: Workload, reps: int, hf_model) -> SystemResult:
    """transformers' continuous batching manager, one request per workload request."""
    if not hasattr(hf_model, "init_continuous_batching"):
        return SystemResult("hf-cb", skipped="this transformers has no continuous batching")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    if any(r.n > 1 for r in workload.requests):
        return SystemResult("hf-cb", skipped="parallel sampling is not driven through hf-cb here")
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    # A cache that holds every request whole, and pagedserve's default token budget per step. Left
    # to size itself, the manager takes a share of all free memory, which costs ~25 s per start here.
    pages = sum(-(-(len(r.prompt_token_ids) + r.output_len) // 256) for r in workload.requests)
    cb_config = ContinuousBatchingConfig(page_size=256, num_blocks=pages, max_batch_tokens=2048)

    def run(reqs=workload.requests):
        manager = hf_model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        manager.start()
        try:
            for i, r in enumerate(reqs):
                manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len)
            done = 0
            while done < len(reqs):
                result = manager.get_result(timeout=600)  # the first finish can take minutes
                if result is None:
                    raise RuntimeError("transformers' continuous batching stalled")
                if result.is_finished():
                    done += 1
        finally:
            manager.stop(block=True)

    return SystemResult("hf-cb", timed(run, reps, lambda: run(workload.requests[:2])), workload.num_prompt_tokens,
                        workload.num_output_tokens,
                        note="transformers continuous batching")


def run_driver(command: list[str], spec: dict, env: dict | None = None) -> dict:
    """Run `command SPEC.json REPORT.json` (a driver script under some Python) on `spec` and return
    the report it wrote; a RuntimeError with the driver's last error line when it wrote none."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, report_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "report.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.run([*command, spec_path, report_path], capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
        if proc.returncode != 0 or not os.path.exists(report_path):
            raise RuntimeError(f"failed: {proc.stderr.strip().splitlines()[-1:]}")
        with open(report_path) as f:
            return json.load(f)


def driver_command(system: str, python: str) -> list[str]:
    """How to run the driver of vllm / llamacpp under that system's own Python."""
    return [python, os.path.join(DRIVERS, f"{system}_driver.py")]


def vllm_all_cores_env() -> dict:
    """vLLM's CPU build bound to every core (its default leaves one out)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def run_external(system: str, python: str | None, workload: Workload, reps: int, model_path: str,
                 extra: dict, env: dict | None = None, label: str | None = None) -> SystemResult:
    """vllm / llamacpp: a driver script run by that system's own Python, timing inside."""
    label = label or system
    if not python:
        return SystemResult(label, skipped=f"not run: pass --{system}-python PATH to a Python that has it")
    try:
        report = run_driver(driver_command(system, python),
                            {"workload": workload.to_json(), "model": model_path, "reps": reps, **extra}, env)
    except RuntimeError as e:
        return SystemResult(label, skipped=str(e))
    return SystemResult(label, report["seconds"], workload.num_prompt_tokens, report["output_tokens"],
                        note=report.get("note", ""), startup_s=report.get("startup_s"),
                        token_ids=report.get("token_ids"))


# ---- the report ------------------------------------------------------------------------------


def greedy_agreement(workload: Workload, ours: SystemResult, other: SystemResult) -> str:
    """How many greedy requests produced the same tokens in both systems, and the mean share of
    tokens they agree on before the first difference."""
    rows = [i for i, r in enumerate(workload.requests) if r.n == 1]
    if not rows or not ours.token_ids or not other.token_ids:
        return "-"
    prefixes = []
    for i in rows:
        a, b = ours.token_ids[i], other.token_ids[i]
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same / max(len(a), 1))
    identical = sum(ours.token_ids[i] == other.token_ids[i] for i in rows)
    return f"{identical}/{len(rows)} ({sum(prefixes) / len(prefixes):.0%})"


def markdown_table(workload: Workload, results: list[SystemResult]) -> str:
    ours = next((r for r in results if r.system == "pagedserve" and not r.skipped), None)
    runs = max((len(r.seconds) for r in results if not r.skipped), default=0)
    lines = [f"Workload {workload.describe()}; median of {runs} runs (min..max). Startup: from building the "
             "engine to ready (pagedserve: loading the weights, cached, and the tokenizer, plus building the engine; "
             "not the imports). Greedy agreement: requests whose greedy output is "
             "pagedserve's token for token (mean share of tokens before the first difference).", "",
             "| system | output tok/s | total tok/s | output vs pagedserve | startup s | greedy agreement | notes |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.system} | - | - | - | - | - | {r.skipped} |")
            continue
        ratio = f"{r.output_tps() / ours.output_tps():.2f}x" if ours else "-"
        startup = "-" if r.startup_s is None else f"{r.startup_s:.1f}"
        agreement = greedy_agreement(workload, ours, r) if ours and r is not ours else "-"
        lines.append(f"| {r.system} | {r.output_tps():.1f} ({r.output_tps(max):.1f}..{r.output_tps(min):.1f}) | "
                     f"{r.total_tps():.1f} | {ratio} | {startup} | {agreement} | {r.note} |")
    return "\n".join(lines)


def plot(results: list[SystemResult], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if not r.skipped]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(ran)))
    ax.barh([r.system for r in ran][::-1], [r.output_tps() for r in ran][::-1], color="tab:blue")
    ax.set_xlabel("output tokens/s (median)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_throughput_bench(workload: Workload, systems: list[str], reps: int = 3, hf_batch_sizes=(8, 32, 64),
                         vllm_python: str | None = None, llamacpp_python: str | None = None,
                         hf_model_dir: str | None = None, engine_kwargs: dict | None = None,
                         device: str = "cpu", dtype: str = "float32", model: str | None = None,
                         quantizations: tuple[str, ...] = ("none",), log=print) -> list[SystemResult]:
    """pagedserve and transformers run `model` (default: the embedded one) on `device` in `dtype`;
    vLLM (in `dtype` too) `hf_model_dir`, else `model`, and llama.cpp (CPU builds) the embedded
    model on the CPU. pagedserve runs once per weight format in `quantizations` (EngineConfig's
    `quantization`): the first is the "pagedserve" row the others are compared with."""
    from pagedserve.models.loader import embedded_model_path, load_model, load_tokenizer

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")

    @functools.cache  # loaded once per weight format, by the first run that needs it
    def ours(quantization: str = quantizations[0]):
        start = time.perf_counter()
        loaded = load_model(model, getattr(torch, dtype), device, quantization=quantization), load_tokenizer(model)
        return loaded, time.perf_counter() - start

    def run_ours(quantization: str = quantizations[0], **kwargs) -> SystemResult:
        """run_pagedserve on the shared weights; its startup counts their loading, as a fresh start would."""
        (loaded_model, tokenizer), load_s = ours(quantization)
        result = run_pagedserve(workload, reps, loaded_model, tokenizer, **kwargs)
        result.startup_s += load_s
        return result

    @functools.cache
    def hf_model():
        return load_hf_reference(getattr(torch, dtype), device, model)

    engine_kwargs = {"device": device, "dtype": dtype} | (engine_kwargs or {})
    vllm_model = hf_model_dir or model or ""

    runs = []  # (label, thunk returning a SystemResult): one per row of the table
    for system in systems:
        if system == "pagedserve":
            tp = engine_kwargs.get("tensor_parallel_size", 1)
            runs.append(("pagedserve", lambda: run_ours(**(engine_kwargs | {"tensor_parallel_size": 1}))))
            runs += [(f"pagedserve ({q})", lambda q=q: run_ours(q, label=f"pagedserve (quantization={q})", **(
                engine_kwargs | {"tensor_parallel_size": 1}))) for q in quantizations[1:]]
            if tp > 1:  # against TP=1 on the same cores: the ranks share the threads TP=1 has
                runs.append((f"pagedserve-tp{tp}", lambda: run_pagedserve(
                    workload, reps, None, ours()[0][1], label=f"pagedserve (TP={tp})", model_path=model, **engine_kwargs)))
        elif system == "pagedserve-fp8":
            runs.append(("pagedserve-fp8", lambda: run_ours(
                label="pagedserve (fp8 KV)", **(engine_kwargs | {"kv_cache_dtype": "fp8", "tensor_parallel_size": 1}))))
        elif system == "hf-static":
            runs += [(f"hf-static (batch {b})", lambda b=b: run_hf_static(workload, reps, hf_model(), b))
                     for b in hf_batch_sizes]
        elif system == "hf-cb":
            runs.append(("hf-cb", lambda: run_hf_cb(workload, reps, hf_model())))
        elif system in ("vllm", "vllm-all-cores"):
            # vLLM's CPU default computes on all cores but one; "vllm" also runs it on every core,
            # "vllm-all-cores" only that way.
            if system == "vllm":
                runs.append(("vllm (default threads)", lambda: run_external(
                    "vllm", vllm_python, workload, reps, vllm_model, {"dtype": dtype},
                    label="vllm (default threads)")))
            if vllm_python:
                label = f"vllm ({os.cpu_count()} threads)"
                runs.append((label, lambda label=label: run_external(
                    "vllm", vllm_python, workload, reps, vllm_model, {"dtype": dtype},
                    env=vllm_all_cores_env(),
                    label=label)))
        else:
            runs.append(("llamacpp", lambda: run_external("llamacpp", llamacpp_python, workload, reps,
                                                          embedded_model_path(), {"threads": os.cpu_count()})))
    results = []
    for label, run in runs:
        log(f"running {label} ...")
        try:
            results.append(run())
        except Exception as exc:  # one system failing must not lose the others' figures
            results.append(SystemResult(label, skipped=f"failed: {type(exc).__name__}: {exc}"[:200]))
        log("  " + json.dumps(results[-1].summary())[:300])
    return results


def load_hf_reference(dtype: torch.dtype = torch.float32, device: str = "cpu", model: str | None = None):
    """transformers' own load of a Hugging Face directory, or of the embedded GGUF; sdpa attention."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from pagedserve.models.loader import embedded_model_path

    if model is not None:
        return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    path = Path(embedded_model_path())
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device).eval()


if __name__ == "__main__":
    sys.exit("use `pagedserve bench throughput`")
