"""`pagedserve bench profile`: where a decode step's time goes, and how close decoding comes to the
machine's float32 matmul ceiling for this model.

For each batch size B, B requests with sharegpt-like prompts are prefilled, then decode steps (one
new token per request) are timed and split into
  schedule   Scheduler.schedule
  prepare    the executor's step minus the model (input ids, AttentionMetadata, logits rows)
  broadcast  tensor parallelism: sending the step's inputs to the other ranks (two broadcasts)
  forward    the model's forward (embedding, all layers, final norm)
  logits     compute_logits (the LM head)
  sample     SamplingBatch.build + Sampler
  engine     the rest of LLMEngine.step (append tokens, detokenize, stop checks, outputs)
"outside the model" is everything but forward and logits. With tensor parallelism, "collectives"
is the part of forward and logits that rank 0 spends in all-reduces and the logits gather (waiting
for the other ranks included). Figures are medians over the steps.

The ceiling: the model's own weight matrices multiplied by a 512-token activation, one layer after
another as a forward runs them, through torch's default CPU matmul and through oneDNN's; the
better FLOPs / seconds is the float32 matmul rate this machine reaches on these shapes, and that
rate over 2 x (matmul parameters) FLOPs per token is the most tokens/s any engine could compute
with it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedserve.bench.workload import sharegpt_like
from pagedserve.config import EngineConfig
from pagedserve.core.sampler import SamplingBatch
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.models.layers import PackedWeight, linear
from pagedserve.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "broadcast", "forward", "logits", "sample", "engine")


@dataclass
class StepProfile:
    batch: int
    mean_context: float
    step_s: float
    parts_s: dict[str, float]

    @property
    def outside_s(self) -> float:
        return self.step_s - self.parts_s["forward"] - self.parts_s["logits"]

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


class Timers:
    """Wraps methods of given objects so each call adds its wall time to a named bucket."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        self._undo.append((obj, attr, vars(obj).get(attr)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start

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


def profile_decode(model, tokenizer, batch: int, steps: int = 20, torch_profile: bool = False,
                   tensor_parallel_size: int = 1, model_path: str | None = None, **workload_kwargs) -> StepProfile:
    """Decode steps of `batch` requests from `sharegpt_like(batch, seed=batch, **workload_kwargs)`.
    With tensor parallelism the ranks load their shards of `model_path` (the loaded `model` is unused)."""
    config = EngineConfig(model=model_path, num_kv_blocks=4096, tensor_parallel_size=tensor_parallel_size)
    engine = LLMEngine(config, model=model if tensor_parallel_size == 1 else None, tokenizer=tokenizer)
    try:
        return _profile_steps(engine, batch, steps, torch_profile, **workload_kwargs)
    finally:
        engine.shutdown()


def _profile_steps(engine: LLMEngine, batch: int, steps: int, torch_profile: bool, **workload_kwargs) -> StepProfile:
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)  # outlasts the timed steps
    for i, request in enumerate(sharegpt_like(batch, seed=batch, **workload_kwargs).requests):
        engine.add_request(str(i), request.prompt_token_ids, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()  # prefill everything
    for _ in range(3):
        engine.step()  # warm-up decode steps

    timers = Timers()
    executor, model = engine.core.executor, engine.runner.model
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(executor, "execute", "execute")
    timers.wrap(model, "forward", "forward")
    if engine.runner.decode_graphs is not None:  # decode steps replay the forward instead of calling it
        timers.wrap(engine.runner.decode_graphs, "run", "forward")
    timers.wrap(model, "compute_logits", "logits")
    if model.tp.size > 1:
        timers.wrap(model.tp, "all_reduce", "collectives")
        timers.wrap(model.tp, "gather_columns", "collectives")
    timers.wrap(engine.core, "sampler", "sample")
    timers.wrap(SamplingBatch, "build", "sample_build")
    rows = []
    try:
        with torch.profiler.profile() if torch_profile else contextlib.nullcontext() as profiler:
            for _ in range(steps):
                sent = getattr(executor, "broadcast_seconds", 0.0)
                start = time.perf_counter()
                engine.step()
                total = time.perf_counter() - start
                t = timers.take()
                broadcast = getattr(executor, "broadcast_seconds", 0.0) - sent
                row = {"schedule": t.get("schedule", 0.0), "broadcast": broadcast,
                       "prepare": t["execute"] - t["forward"] - t["logits"] - broadcast,
                       "forward": t["forward"], "logits": t["logits"],
                       "sample": t.get("sample", 0.0) + t.get("sample_build", 0.0)}
                row["engine"] = total - sum(row.values())
                row["collectives"] = t.get("collectives", 0.0)
                rows.append((total, row))
        if torch_profile:
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    finally:
        timers.restore()
    context = statistics.mean(r.num_tokens for r in engine.scheduler.running)
    for i in range(batch):
        engine.abort_request(str(i))
    return StepProfile(batch, context, statistics.median(total for total, _ in rows),
                       {k: statistics.median(row[k] for _, row in rows) for k in (*PARTS, "collectives")})


def matmul_params(model) -> int:
    """Parameters multiplied once per token: every Linear, plus the LM head (tied or not)."""
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.model.embed_tokens.weight.numel() if model.lm_head is None else 0
    return linears + head


@torch.inference_mode()
def matmul_ceiling(model, tokens: int = 512, reps: int = 3) -> float:
    """FLOP/s of x[tokens, in] @ W.T over the model's weights in forward order, best of reps and
    of the two CPU matmul paths (torch's default, and oneDNN's that the model's layers use)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights.append(model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight)
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=w.dtype) for w in weights}
    packed = [PackedWeight() for _ in weights]
    paths = [lambda x, w, _: F.linear(x, w), lambda x, w, p: linear(x, w, None, p)]
    flops = 2 * tokens * sum(w.numel() for w in weights)
    best = float("inf")
    for matmul in paths:
        for _ in range(reps + 1):  # the first pass warms up (and packs the oneDNN copies)
            start = time.perf_counter()
            for w, p in zip(weights, packed):
                matmul(inputs[w.shape[1]], w, p)
            best = min(best, time.perf_counter() - start)
    return flops / best


def run_profile_bench(batches=(1, 16, 64), steps: int = 20, torch_profile: bool = False,
                      tensor_parallel_size: int = 1, log=print) -> dict:
    from pagedserve.models.loader import load_model, load_tokenizer

    model, tokenizer = load_model(), load_tokenizer()
    net = model[0]
    flop_rate = matmul_ceiling(net)
    flops_per_token = 2 * matmul_params(net)
    ceiling = flop_rate / flops_per_token
    log(f"matmul ceiling: {flop_rate / 1e9:.1f} GFLOP/s = {ceiling:.0f} tok/s at {flops_per_token / 1e6:.1f} MFLOP/token")
    rows = []
    for batch in batches:
        rows.append(profile_decode(model, tokenizer, batch, steps, torch_profile, tensor_parallel_size))
        log(f"  batch {batch}: {rows[-1].step_s * 1e3:.1f} ms/step, {rows[-1].tokens_per_s:.1f} tok/s, "
            f"{rows[-1].outside_s / rows[-1].step_s:.1%} outside the model")
    return {"threads": torch.get_num_threads(), "tensor_parallel_size": tensor_parallel_size,
            "matmul_gflops": flop_rate / 1e9,
            "flops_per_token": flops_per_token, "ceiling_tokens_per_s": ceiling,
            "steps": [{**asdict(r), "tokens_per_s": r.tokens_per_s, "outside_share": r.outside_s / r.step_s}
                      for r in rows]}


def format_table(report: dict) -> str:
    ceiling = report["ceiling_tokens_per_s"]
    lines = [f"float32 matmul ceiling on this model's weights: {report['matmul_gflops']:.1f} GFLOP/s = "
             f"{ceiling:.0f} tokens/s ({report['flops_per_token'] / 1e6:.1f} MFLOP per token), "
             f"{report['threads']} threads, tensor parallel size {report.get('tensor_parallel_size', 1)}.", "",
             "| batch | mean context | step ms | decode tok/s | vs ceiling | outside the model | "
             + " | ".join(f"{p} ms" for p in PARTS) + " | of which collectives ms |",
             "|" + "---:|" * (7 + len(PARTS))]
    for s in report["steps"]:
        lines.append(f"| {s['batch']} | {s['mean_context']:.0f} | {s['step_s'] * 1e3:.1f} | {s['tokens_per_s']:.1f} | "
                     f"{s['tokens_per_s'] / ceiling:.0%} | {s['outside_share']:.1%} | "
                     + " | ".join(f"{s['parts_s'].get(p, 0.0) * 1e3:.2f}" for p in PARTS)
                     + f" | {s['parts_s'].get('collectives', 0.0) * 1e3:.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    labels = [f"batch {s['batch']}" for s in steps]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    left = [0.0] * len(steps)
    for part in PARTS:
        shares = [s["parts_s"].get(part, 0.0) / s["step_s"] * 100 for s in steps]
        ax.barh(labels, shares, left=left, label=part)
        left = [a + b for a, b in zip(left, shares)]
    ax.set_xlabel("share of a decode step (%)")
    ax.set_title("Where a decode step goes")
    ax.legend(ncol=len(PARTS), fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.12))
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
