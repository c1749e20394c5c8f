"""`pagedserve bench spec`: speculative decoding against speculation off, in one run, on the same
prompts and engine settings, reported as ratios.

Parts (each a table row per method, the "off" row its baseline):
- batch 1, copy-edit (requests that repeat or lightly edit a given text): n-gram and suffix
  proposers; one request at a time (max_num_seqs=1, one generate call per request);
- batch 1, sharegpt-like: a draft model, the embedded model itself quantized (its GGUF as stored);
- batch 32, sharegpt-like with 64 requests (the `bench throughput` workload), n-gram: total output
  tokens/s of the whole run;
- serving (`--serving`): `pagedserve serve` started with and without `--speculative-config`,
  `bench serving`'s load generator at 1 request/s: TPOT p50;
- the cost curve: a decode step's time with R rows (one request per row) against R = 1, from which
  the engine's adaptivity constants (DRAFT_ROW_COST, DEFAULT_SPECULATION_MAX_BATCH) are read.

Engines share one loaded copy of the weights. Configurations take turns within each repetition
(off, then each method), so that drift in the machine's speed hits them alike; each ratio is taken
within a repetition, and the table gives medians. Greedy outputs with speculation must be the
baseline's token for token: each row counts the requests that are, and the run fails otherwise.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field

from pagedserve.bench.workload import Workload, copy_edit, sharegpt_like

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SUFFIX = {"method": "suffix"}
COST_CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)


def draft_q4() -> dict:
    """A draft model that is the target itself, quantized: the embedded GGUF's own Q4_1 / Q8_0 tensors run
    as stored (quantization "auto"), drafting for the float32 target (same tokenizer)."""
    from pagedserve.models.loader import embedded_model_path

    return {"method": "draft_model", "model": embedded_model_path(), "quantization": "auto",
            "num_speculative_tokens": 4}


@dataclass
class SpecRow:
    part: str  # which comparison the row belongs to
    method: str  # "off" or a speculative method
    unit: str  # what `speeds` measures
    speeds: list[float] = field(default_factory=list)  # one per repetition
    ratios: list[float] = field(default_factory=list)  # against the part's "off" row, per repetition
    acceptance: float | None = None  # accepted / proposed draft tokens
    tokens_per_step: float | None = None  # decode tokens per decode step (1 without speculation)
    identical: tuple[int, int] | None = None  # (requests equal to the baseline's, requests)
    skipped: str | None = None  # why it did not run
    config: dict | None = None

    @property
    def speed(self) -> float:
        return statistics.median(self.speeds)

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None


# ---- one configuration's engine and runs ------------------------------------------------------


def _engine(model, tokenizer, spec: dict | None, **engine_kwargs):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_engine(LLMEngine(EngineConfig(speculative_config=spec, **engine_kwargs), model=model,
                                     tokenizer=tokenizer))


def _params(request):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=request.ignore_eos)


@dataclass
class _Run:
    seconds: float  # decode seconds (batch 1) or wall seconds (batch 32)
    tokens: int  # decode tokens (batch 1) or output tokens (batch 32)
    steps: int  # engine steps that decoded (batch 1)
    token_ids: list[list[int]]


def _one_at_a_time(llm, workload: Workload) -> _Run:
    """Each request alone. Decode time: from its first token to its last, from the request's own
    metrics; decode tokens: those after the first. Its decode steps: the engine's steps while it ran
    less the one that prefilled its prompt (every prompt fits one step)."""
    seconds, tokens, steps, token_ids = 0.0, 0, 0, []
    for request in workload.requests:
        before = llm.get_metrics()["steps"]
        (out,) = llm.generate([{"prompt_token_ids": request.prompt_token_ids}], _params(request), use_tqdm=False)
        m, ids = out.metrics, list(out.outputs[0].token_ids)
        seconds += m["finish_time"] - m["first_token_time"]
        tokens += len(ids) - 1
        steps += llm.get_metrics()["steps"] - before - 1
        token_ids.append(ids)
    return _Run(seconds, tokens, steps, token_ids)


def _all_at_once(llm, workload: Workload) -> _Run:
    """The whole workload in one generate call; wall time."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests],
                           [_params(r) for r in workload.requests], use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return _Run(seconds, sum(len(t) for t in token_ids), 0, token_ids)


def compare(part: str, workload: Workload, configs: dict[str, dict | None], model, tokenizer, reps: int,
            batch: int, engine_kwargs: dict, log=print) -> list[SpecRow]:
    """A row per configuration (the first is the baseline, speculation off) on `workload`: batch 1
    runs the requests one at a time and measures decode tokens/s; otherwise the whole workload at
    once (max_num_seqs=batch) and its output tokens/s."""
    single = batch == 1
    unit = "decode tok/s" if single else "output tok/s"
    kwargs = engine_kwargs | {"max_num_seqs": batch}
    if single:  # each prompt must prefill in one step for the step count above
        longest = max(len(r.prompt_token_ids) for r in workload.requests)
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens", 2048), longest)
    run = _one_at_a_time if single else _all_at_once
    rows, engines = [], {}
    # Warm-up prompts outside the workload: a proposer that learns from finished outputs (suffix)
    # must not have seen the timed ones.
    warm_up = sharegpt_like(2, seed=-1, prompt_len=(16, 64), output_len=(16, 16),
                            vocab=range(3, min(49000, model[1].vocab_size)))

    def start(spec):
        llm = _engine(model, tokenizer, spec, **kwargs)
        stack.callback(llm.shutdown)
        run(llm, warm_up)
        return llm

    with contextlib.ExitStack() as stack:
        for method, spec in configs.items():
            row = SpecRow(part, method, unit, config=spec)
            rows.append(row)
            try:
                engines[method] = start(spec)
            except Exception as exc:  # a method the engine lacks: say so, keep the other rows
                row.skipped = f"not available: {type(exc).__name__}: {exc}"[:200]
                log(f"  {part}, {method}: {row.skipped}")
        if len(engines) < 2 or rows[0].method not in engines:  # nothing to compare: time nothing
            for row in rows:
                row.skipped = row.skipped or "not timed: no configuration to compare it with"
            return rows
        decode = {m: [0, 0] for m in engines}  # decode tokens and steps over the repetitions
        drafts = {m: [0, 0] for m in engines}  # draft tokens proposed and accepted over the repetitions
        for rep in range(reps):
            results = {}
            for method, llm in engines.items():
                if rep and learns_across_requests(configs[method]):  # a fresh one: each repetition's prompts are new to it
                    llm.shutdown()
                    llm = engines[method] = start(configs[method])
                before = _spec_counters(llm)
                results[method] = run(llm, workload)
                for i, (a, b) in enumerate(zip(before, _spec_counters(llm))):
                    drafts[method][i] += b - a
                log(f"  {part}, rep {rep + 1}/{reps}, {method}: "
                    f"{results[method].tokens / results[method].seconds:.1f} {unit}")
            base = results.get(rows[0].method)
            for row in rows:
                r = results.get(row.method)
                if r is None:
                    continue
                row.speeds.append(r.tokens / r.seconds)
                if base is not None:
                    row.ratios.append(row.speeds[-1] / (base.tokens / base.seconds))
                    same = sum(a == b for a, b in zip(r.token_ids, base.token_ids))
                    if row.identical is None or same < row.identical[0]:  # the worst repetition
                        row.identical = (same, len(base.token_ids))
                decode[row.method][0] += r.tokens
                decode[row.method][1] += r.steps
        for row in rows:
            if single and decode.get(row.method, [0, 0])[1]:
                row.tokens_per_step = decode[row.method][0] / decode[row.method][1]
            if row.method in engines and row.config is not None:
                drafted, accepted = drafts[row.method]
                row.acceptance = accepted / drafted if drafted else 0.0
    return rows


def learns_across_requests(spec: dict | None) -> bool:
    """Whether the method drafts from other requests' outputs (and so from an earlier repetition's)."""
    return spec is not None and spec["method"] == "suffix"


def _spec_counters(llm) -> tuple[int, int]:
    m = llm.get_metrics()
    return m.get("spec_num_draft_tokens", 0), m.get("spec_num_accepted_tokens", 0)


# ---- the cost of a row ------------------------------------------------------------------------


def cost_curve(model, tokenizer, rows=COST_CURVE_ROWS, steps: int = 10, prompt_len: int = 64,
               vocab: range = range(100, 49000), log=print) -> list[dict]:
    """A decode step's median time with R requests decoding (one row each, random prompts of
    `prompt_len` ids from `vocab`), relative to R = 1, and the marginal cost of a row between one R
    and the next."""
    from pagedserve.bench.profile import profile_decode

    curve = []
    for r in rows:
        profile = profile_decode(model, tokenizer, r, steps, prompt_len=(prompt_len, prompt_len), vocab=vocab)
        curve.append({"rows": r, "step_s": profile.step_s})
        log(f"  {r} rows: {profile.step_s * 1e3:.1f} ms/step")
    one = curve[0]["step_s"]
    for prev, point in zip([None, *curve], curve):
        point["relative"] = point["step_s"] / one
        point["per_row"] = point["relative"] / point["rows"]
        point["marginal"] = (None if prev is None else
                             (point["step_s"] - prev["step_s"]) / (point["rows"] - prev["rows"]) / one)
    return curve


def weight_bound_until(curve: list[dict]) -> int | None:
    """The largest R whose step costs under twice a one-row step: up to there, reading the weights
    (the part of the step that does not grow with rows) is most of a step."""
    bound = [p["rows"] for p in curve if p["relative"] < 2.0]
    return max(bound) if bound else None


def small_batch_row_cost(curve: list[dict], up_to: int = 8) -> float | None:
    """The mean marginal cost of a row, as a share of a one-row step, for R up to `up_to`: what one
    more draft row costs while steps are small."""
    points = [p["marginal"] for p in curve if p["marginal"] is not None and p["rows"] <= up_to]
    return statistics.mean(points) if points else None


# ---- serving ----------------------------------------------------------------------------------


def serving(spec: dict, num_requests: int, max_output_len: int, rate: float, seed: int, log=print) -> list[dict]:
    """`pagedserve serve` started without and with `--speculative-config`, both running before either
    is measured; `bench serving`'s load generator on the same sharegpt-like prompts at `rate` req/s."""
    import asyncio
    import json

    from pagedserve.bench.servers import launch
    from pagedserve.bench.serving import run_serving_bench, wait_until_idle, warm_up

    workload = sharegpt_like(num_requests=num_requests, seed=seed, output_len=(16, max_output_len))
    warm = sharegpt_like(num_requests=4, seed=seed + 1, output_len=(16, 32))
    name = "SmolLM2-135M-Instruct"
    reports = []
    with contextlib.ExitStack() as servers:
        urls = {}
        for label, extra in (("off", []), (spec["method"], ["--speculative-config", json.dumps(spec)])):
            server = servers.enter_context(launch("pagedserve", name, extra_args=extra))
            log(f"  serve ({label}) ready in {server.startup_s:.1f} s")
            urls[label] = server.url
        for url in urls.values():
            asyncio.run(warm_up(url, warm, name, None, len(warm.requests)))
        for label, url in urls.items():
            wait_until_idle()
            reports.append(asyncio.run(run_serving_bench(url, workload, rate, name, seed=seed, progress=False,
                                                         system=label)))
            log(f"  serving ({label}): TPOT p50 {reports[-1]['tpot_s']['p50'] * 1e3:.1f} ms")
    return reports


# ---- the whole bench --------------------------------------------------------------------------


def run_spec_bench(reps: int = 3, batch_reps: int = 3, copy_requests: int = 8, sharegpt_requests: int = 8,
                   max_tokens: int = 256, batch: int = 32, batch_requests: int = 64, seed: int = 0,
                   parts: tuple[str, ...] = ("copy", "draft", "batch", "cost"), serving_requests: int = 16,
                   serving_rate: float = 1.0, log=print) -> dict:
    """Every part asked for, in order; a dict with the rows, the cost curve and the serving reports."""
    from pagedserve.models.loader import load_model, load_tokenizer

    model, tokenizer = load_model(), load_tokenizer()
    engine_kwargs = {"enable_prefix_caching": False}
    report: dict = {"rows": [], "cost_curve": None, "serving": None, "workloads": {}}

    def add(rows: list[SpecRow]) -> None:
        report["rows"] += rows

    if "copy" in parts:
        workload = copy_edit(tokenizer, copy_requests, seed, max_tokens)
        report["workloads"]["copy"] = workload.describe()
        log(f"batch 1, {workload.describe()}")
        add(compare("batch 1, copy-edit", workload, {"off": None, "ngram": NGRAM, "suffix": SUFFIX}, model,
                    tokenizer, reps, 1, engine_kwargs | {"kv_cache_memory_bytes": 256 << 20}, log))
    if "draft" in parts:
        workload = sharegpt_like(sharegpt_requests, seed)
        report["workloads"]["draft"] = workload.describe()
        log(f"batch 1, {workload.describe()}")
        add(compare("batch 1, sharegpt-like", workload, {"off": None, "draft_model (Q4 self)": draft_q4()},
                    model, tokenizer, reps, 1, engine_kwargs | {"kv_cache_memory_bytes": 256 << 20}, log))
    if "batch" in parts:
        workload = sharegpt_like(batch_requests, seed)
        report["workloads"]["batch"] = workload.describe()
        log(f"batch {batch}, {workload.describe()}")
        add(compare(f"batch {batch}, sharegpt-like", workload, {"off": None, "ngram": NGRAM}, model, tokenizer,
                    batch_reps, batch, engine_kwargs, log))
    if "cost" in parts:
        log("cost curve")
        report["cost_curve"] = cost_curve(model, tokenizer, log=log)
    if "serving" in parts:
        log(f"serving at {serving_rate:g} req/s")
        report["serving"] = serving(NGRAM, serving_requests, 128, serving_rate, seed, log)
    failed = [r for r in report["rows"] if r.identical and r.identical[0] != r.identical[1]]
    report["all_identical"] = not failed
    report["rows"] = [asdict(r) | {"speed": r.speed if r.speeds else None, "ratio": r.ratio} for r in report["rows"]]
    return report


# ---- the report -------------------------------------------------------------------------------


def markdown_table(report: dict) -> str:
    rows = report["rows"]
    reps = max((len(r["speeds"]) for r in rows), default=0)
    lines = []
    if rows:
        lines += ["Each ratio is against speculation off in the same run, on the same prompts and engine settings "
                  f"(prefix caching off), configurations taking turns; medians of {reps} repetitions (min..max of "
                  "the ratio). Batch 1: one request at a time; decode tok/s = tokens after the first / seconds from "
                  "the first token to the last (the request's own metrics), summed over the requests. Batch 32: the "
                  "whole workload in one call, output tokens / wall seconds. Acceptance: accepted / proposed draft "
                  "tokens. Tokens/step: decode tokens per decode step. Same output: greedy outputs equal to the "
                  "baseline's token for token.", "",
                  "| part | method | speed | vs off | acceptance | tokens/step | same output |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["skipped"]:
                lines.append(f"| {r['part']} | {r['method']} | - | - | - | - | {r['skipped']} |")
                continue
            ratio = "-" if r["method"] == "off" or r["ratio"] is None else (
                f"{r['ratio']:.2f}x ({min(r['ratios']):.2f}..{max(r['ratios']):.2f})")
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
            same = "-" if r["method"] == "off" or not r["identical"] else f"{r['identical'][0]}/{r['identical'][1]}"
            lines.append(f"| {r['part']} | {r['method']} | {r['speed']:.1f} {r['unit']} | {ratio} | {acc} | {tps} "
                         f"| {same} |")
    if report.get("serving"):
        off, spec = report["serving"]
        lines += ["", f"Serving: `pagedserve serve` without and with `--speculative-config` ({spec['system']}), "
                  f"{off['workload']}, {off['request_rate']:g} req/s (Poisson), streaming, ignore_eos.", "",
                  "| server | completed | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms | output tok/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for s in (off, spec):
            lines.append(f"| {s['system']} | {s['completed']} of {s['completed'] + s['failed']} | "
                         f"{s['ttft_s']['p50'] * 1e3:.0f} | {s['tpot_s']['p50'] * 1e3:.1f} | "
                         f"{s['tpot_s']['p99'] * 1e3:.1f} | {s['output_throughput']:.1f} |")
        lines.append(f"\nTPOT p50 with speculation / without: {spec['tpot_s']['p50'] / off['tpot_s']['p50']:.2f}x")
    curve = report.get("cost_curve")
    if curve:
        lines += ["", "Cost of a decode row: the median time of a decode step with R requests decoding (contexts of "
                  "about 64 tokens), relative to one; per row = relative / R; marginal = the cost of each row added "
                  "since the previous R, as a share of a one-row step.", "",
                  "| rows R | step ms | relative | per row | marginal |", "|---:|---:|---:|---:|---:|"]
        for p in curve:
            marginal = "-" if p["marginal"] is None else f"{p['marginal']:.3f}"
            lines.append(f"| {p['rows']} | {p['step_s'] * 1e3:.1f} | {p['relative']:.2f} | {p['per_row']:.3f} | "
                         f"{marginal} |")
        bound, cost = weight_bound_until(curve), small_batch_row_cost(curve)
        lines.append("")
        lines.append(f"A row costs {cost:.3f} of a one-row step on average up to R = 8 (DRAFT_ROW_COST); a step stays "
                     f"under twice a one-row step (mostly weight reading) up to R = {bound} "
                     "(DEFAULT_SPECULATION_MAX_BATCH)." if cost is not None else "")
    if rows:
        lines.append("")
        lines.append("Greedy outputs identical with and without speculation: "
                     + ("yes, every request." if report["all_identical"] else "NO: see the same-output column."))
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in report["rows"] if r["method"] != "off" and r["ratio"] is not None]
    curve = report.get("cost_curve") or []
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(11 if curve else 6, 3.6), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['part']}\n{r['method']}" for r in ran]
    ax.barh(labels[::-1], [r["ratio"] for r in ran][::-1], color="tab:blue")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("speed with speculation / without (median)")
    ax.set_title("speculative decoding vs off")
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    if curve:
        ax = axes[0][1]
        rows = [p["rows"] for p in curve]
        ax.plot(rows, [p["relative"] for p in curve], "o-", label="step time / one-row step")
        ax.plot(rows, rows, ":", color="grey", label="proportional to rows")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("rows in the decode step")
        ax.set_title("cost of a decode step by rows")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
