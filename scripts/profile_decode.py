"""Where a decode step's time goes, and end-to-end throughput on a sharegpt-like workload.

    .venv/bin/python scripts/profile_decode.py                 # batches 1, 16, 64 + end to end
    .venv/bin/python scripts/profile_decode.py --batches 64 --no-e2e --profile

For each batch size B: B requests with sharegpt-like prompt lengths are prefilled, then decode
steps (every request runs one token) are timed. Each step is split into
  schedule   Scheduler.schedule
  prepare    ModelRunner.execute minus the model (input ids, AttentionMetadata, logits rows)
  forward    DecoderForCausalLM.forward (embedding + all layers + final norm)
  logits     compute_logits (lm_head)
  sample     SamplingBatch.build + Sampler
  engine     the rest of LLMEngine.step: append, detokenize, stop checks, outputs
and "outside" = everything but forward and logits. Medians over the timed steps.

End to end: `pagedserve.bench.workload.sharegpt_like` (64 requests, prompt lengths log-uniform
16..512 of random token ids, outputs log-uniform 16..256 forced with ignore_eos), greedy, engine
defaults; output tok/s and total tok/s over the run.
The machine is shared: compare figures from the same run only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from pagedserve.bench.workload import sharegpt_like
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.sampler import SamplingBatch
from pagedserve.models.loader import load_model, load_tokenizer
from pagedserve.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "forward", "logits", "sample", "engine")


class Timers:
    """Wraps callables on given objects so each call adds its wall time to a named bucket."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self._undo.append((obj, attr, vars(obj).get(attr)))

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t

        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, old in reversed(self._undo):
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
        self._undo.clear()

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def make_engine(model: tuple, tokenizer, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**overrides), model=model, tokenizer=tokenizer)


def decode_breakdown(model, tokenizer, batch: int, steps: int, profile: bool) -> None:
    engine = make_engine(model, tokenizer, num_kv_blocks=4096, max_model_len=2048)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, request in enumerate(sharegpt_like(batch, seed=batch).requests):
        engine.add_request(str(i), request.prompt_token_ids, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()  # warm-up decode steps

    timers = Timers()
    runner = engine.runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "execute", "execute")
    timers.wrap(runner.model, "forward", "forward")
    timers.wrap(runner.model, "compute_logits", "logits")
    timers.wrap(engine, "sampler", "sample")
    timers.wrap(SamplingBatch, "build", "sample_build")
    rows = []
    prof = torch.profiler.profile() if profile else None
    if prof:
        prof.__enter__()
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            p = timers.take()
            rows.append({
                "total": total,
                "schedule": p.get("schedule", 0.0),
                "prepare": p["execute"] - p["forward"] - p["logits"],
                "forward": p["forward"],
                "logits": p["logits"],
                "sample": p.get("sample", 0.0) + p.get("sample_build", 0.0),
            })
            rows[-1]["engine"] = total - sum(rows[-1][k] for k in PARTS if k != "engine")
    finally:
        if prof:
            prof.__exit__(None, None, None)
        timers.restore()
    ctx = statistics.mean(r.num_tokens for r in engine.scheduler.running)
    med = {k: statistics.median(r[k] for r in rows) for k in ("total", *PARTS)}
    outside = statistics.median(r["total"] - r["forward"] - r["logits"] for r in rows)
    print(f"batch {batch:3d} (mean context {ctx:5.0f}): step {med['total'] * 1e3:7.2f} ms "
          f"= {batch / med['total']:6.1f} tok/s; outside the model {outside * 1e3:6.2f} ms "
          f"({outside / med['total']:5.1%})")
    print("    " + "  ".join(f"{k} {med[k] * 1e3:.2f}" for k in PARTS) + "  (ms, medians)")
    if prof:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    for rid in list(engine._groups):
        engine.abort_request(rid)


def end_to_end(model, tokenizer, num_requests: int) -> None:
    engine = make_engine(model, tokenizer)  # the defaults, as `pagedserve bench throughput` runs it
    for i, request in enumerate(sharegpt_like(num_requests, seed=0).requests):
        engine.add_request(str(i), request.prompt_token_ids,
                           SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    prompt_tokens = output_tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                prompt_tokens += len(output.prompt_token_ids)
                output_tokens += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    print(f"end to end: {num_requests} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
          f"in {elapsed:.1f} s, {engine.stats.num_steps} steps: output {output_tokens / elapsed:.1f} tok/s, "
          f"total {(prompt_tokens + output_tokens) / elapsed:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size")
    parser.add_argument("--requests", type=int, default=64, help="end-to-end requests")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end run")
    parser.add_argument("--profile", action="store_true", help="torch profiler table per batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    model = load_model()
    tokenizer = load_tokenizer()
    for batch in args.batches:
        decode_breakdown(model, tokenizer, batch, args.steps, args.profile)
    if not args.no_e2e:
        end_to_end(model, tokenizer, args.requests)


if __name__ == "__main__":
    main()
