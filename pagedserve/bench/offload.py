"""`pagedserve bench offload`: the KV offload tier (`kv_offload_dir`, a file-backed second tier behind the
block pool, keyed by the prefix cache's block hashes) against the engine without it, in one run, on the
same prompts and engine settings, reported as ratios.

Parts (each a table; the engine without the tier is the baseline, measured in the same run):
- multiturn: chat sessions whose context grows turn by turn (`multi_turn_chat`), interleaved: round r
  runs every session's turn r, `concurrency` sessions per `generate` call. The KV pool holds about a
  quarter of all sessions' final contexts (`pool_ratio`), so a session's earlier turns are evicted
  from the pool before it comes back: without the tier its whole context is computed again each
  turn; with it, read back from files. Systems: no tier, the tier (write_through), and, if asked, the
  tier with kv_offload_policy="evicted". TTFT p50/p90 over turns >= 2 and over all turns.
- noreuse: unique prompts (no shared prefix), all at once: what the tier costs when nothing is
  read back. Tier off vs on (evicted, the default: the pool holds them all, so nothing is written;
  write_through: every block is written).
- restart: a long system prompt and a short question. An engine with the tier in a directory D serves
  one request and is dropped; a new engine (same process) on D serves the same system prompt with
  another question: the TTFT of its first request, against a new engine without the tier.
- swap: a pool too small for the batch, so that requests are preempted: preemption_mode="recompute"
  (tier off) vs "swap" (tier on), output tokens/s.

Every tier runs in a fresh temporary directory, removed afterwards. Engines share one loaded copy of
the weights, and each run gets a new engine (a cold pool). Configurations take turns within each
repetition; ratios are taken within a repetition and the table gives medians. Greedy outputs with
the tier must be the baseline's token for token: each row counts the requests that are, and the CLI
fails otherwise. The tier's figures come from `get_metrics()` (kv_offload_hit_tokens,
kv_offload_stored_blocks, kv_offload_loaded_blocks; zeros when absent): when no engine with the
tier stored or loaded a block, the table says that the tier did nothing.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import tempfile
import time

from pagedserve.bench.workload import MultiTurnWorkload, Workload, multi_turn_chat, unique_prompts

PARTS = ("multiturn", "noreuse", "restart", "swap")
POLICIES = ("write_through", "evicted")
TIER_METRICS = ("kv_offload_hit_tokens", "kv_offload_stored_blocks", "kv_offload_loaded_blocks")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "prompt_tokens", "generation_tokens",
            *TIER_METRICS)
OFF = "no tier"
SWAP_ONLY = 1 << 30  # kv_offload_min_hits no evicted block reaches: only swap writes to the tier


def safe_vocab(model_config) -> range:
    """Token ids for random prompts: clear of the special tokens at the start of the vocabulary (the
    other workloads' range(100, 49000) for a real model; from 3 up for a tiny test model)."""
    size = model_config.vocab_size
    return range(100, min(49000, size)) if size > 1000 else range(3, size)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p90 as `bench serving` takes them (inclusive quantiles)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49], "p90": q[89]}


# ---- engines, tiers and runs -------------------------------------------------------------------


def _engine(model, tokenizer, **kwargs):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.entrypoints.llm import LLM

    return LLM.from_engine(LLMEngine(EngineConfig(**kwargs), model=model, tokenizer=tokenizer))


@contextlib.contextmanager
def _tier_dir(root: str | None):
    """A fresh, empty directory for one tier, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-kv-tier-", dir=root) as path:
        yield path


def _dir_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(folder, name))
    return total


def _counters(llm) -> dict:
    m = llm.get_metrics()
    return {k: m.get(k, 0) for k in COUNTERS}  # a build without the tier has no kv_offload_* figures: zeros


def _delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in COUNTERS}
    d["prefix_hit_rate"] = d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else 0.0
    return d


def _params(output_len: int):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def _ttft(output) -> float:
    return output.metrics["first_token_time"] - output.metrics["arrival_time"]


def _warm_up(llm, vocab) -> None:
    """One short request of its own before the timed run: a new engine's first steps pay for lazy
    set-up that no later request sees. Its counters are left out (the figures are differences)."""
    import random

    rng = random.Random(-1)
    llm.generate([{"prompt_token_ids": [rng.choice(vocab) for _ in range(8)]}], _params(2), use_tqdm=False)


def _tier_kwargs(system: str, path: str | None, offload_bytes: int | None) -> dict:
    """The engine settings of a system: OFF, a kv_offload_policy, or "swap"."""
    if system == OFF or path is None:
        return {}
    kwargs = {"kv_offload_dir": path, "kv_offload_bytes": offload_bytes}
    if system == "swap":  # the tier receives the preempted requests' blocks and nothing else
        return kwargs | {"preemption_mode": "swap", "kv_offload_policy": "evicted", "kv_offload_min_hits": SWAP_ONLY}
    if system == "swap+write_through":
        return kwargs | {"preemption_mode": "swap"}
    return kwargs | {"kv_offload_policy": system}


def _settings(kwargs: dict) -> dict:
    """The engine settings a row reports (the tier's path is a temporary one: left out)."""
    return {k: ("<temporary directory>" if k == "kv_offload_dir" else v) for k, v in kwargs.items()}


# ---- multiturn ---------------------------------------------------------------------------------


def multiturn_pool(workload: MultiTurnWorkload, concurrency: int, pool_ratio: float, block_size: int = 16) -> dict:
    """The pool for the multi-turn part: every session's final context / pool_ratio, at least what
    `concurrency` sessions at their longest hold at once (so that a group runs without preemption);
    max_model_len the longest session's final context."""
    longest = max(workload.context_len(s) for s in range(len(workload.sessions)))
    total = sum(workload.context_len(s) for s in range(len(workload.sessions)))
    share = math.ceil(total / pool_ratio / block_size)
    group = min(concurrency, len(workload.sessions)) * math.ceil(longest / block_size)
    return {"num_kv_blocks": max(share, group), "max_model_len": longest, "context_tokens": total,
            "context_over_pool": total / (max(share, group) * block_size), "raised_for_concurrency": group > share}


def run_multiturn(workload: MultiTurnWorkload, model, tokenizer, engine_kwargs: dict, concurrency: int,
                  vocab) -> dict:
    """The workload on one new engine: round r runs every session's turn r, `concurrency` sessions per
    generate call, each prompt built from the engine's own earlier answers."""
    llm = _engine(model, tokenizer, **engine_kwargs)
    _warm_up(llm, vocab)
    before = _counters(llm)
    sessions = range(len(workload.sessions))
    answers: list[list[list[int]]] = [[] for _ in sessions]
    ttft: list[tuple[int, float]] = []  # (turn, seconds)
    cached: list[int] = []
    params = _params(workload.answer_len)
    start = time.perf_counter()
    for turn in range(workload.num_turns):
        for first in range(0, len(sessions), concurrency):
            group = sessions[first:first + concurrency]
            prompts = [{"prompt_token_ids": workload.prompt(s, turn, answers[s])} for s in group]
            for s, out in zip(group, llm.generate(prompts, params, use_tqdm=False)):
                answers[s].append(list(out.outputs[0].token_ids))
                ttft.append((turn, _ttft(out)))
                cached.append(out.num_cached_tokens)
    seconds = time.perf_counter() - start
    counters = _delta(before, _counters(llm))
    llm.shutdown()  # then dropped: the tier's files closed, the pool's memory returned before the next engine
    del llm
    gc.collect()
    return {"seconds": seconds, "ttft": ttft, "num_cached_tokens": sum(cached), "answers": answers,
            "counters": counters}


def _same_answers(a: list[list[list[int]]], b: list[list[list[int]]]) -> tuple[int, int]:
    pairs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return sum(x == y for x, y in pairs), len(pairs)


def multiturn_part(workload: MultiTurnWorkload, model, tokenizer, systems: tuple[str, ...], concurrency: int,
                   pool_ratio: float, reps: int, offload_root: str | None, offload_bytes: int | None,
                   engine_kwargs: dict, vocab, log=print) -> dict:
    block_size = engine_kwargs.get("block_size", 16)
    pool = multiturn_pool(workload, concurrency, pool_ratio, block_size)
    base_kwargs = engine_kwargs | {"num_kv_blocks": pool["num_kv_blocks"], "max_model_len": pool["max_model_len"]}
    rows = {s: {"system": s, "ttft_later": [], "ttft_all": [], "seconds": [], "ratios": [], "identical": None,
                "counters": [], "tier_bytes": [], "num_cached_tokens": [],
                "settings": _settings(base_kwargs | _tier_kwargs(s, "x", offload_bytes))} for s in systems}
    for rep in range(reps):
        results = {}
        for system in systems:
            with _tier_dir(offload_root) if system != OFF else contextlib.nullcontext() as path:
                r = run_multiturn(workload, model, tokenizer, base_kwargs | _tier_kwargs(system, path, offload_bytes),
                                  concurrency, vocab)
                rows[system]["tier_bytes"].append(_dir_bytes(path) if path else 0)
            results[system] = r
            later = [t for turn, t in r["ttft"] if turn >= 1]
            log(f"  multiturn, rep {rep + 1}/{reps}, {system}: {r['seconds']:.1f} s, TTFT p50 (turns >= 2) "
                f"{percentiles(later)['p50'] * 1e3:.0f} ms, prefix hit rate {r['counters']['prefix_hit_rate']:.0%}")
        base = results[systems[0]]
        base_p50 = percentiles([t for turn, t in base["ttft"] if turn >= 1])["p50"]
        for system, r in results.items():
            row = rows[system]
            later = [t for turn, t in r["ttft"] if turn >= 1]
            row["ttft_later"] += later
            row["ttft_all"] += [t for _, t in r["ttft"]]
            row["seconds"].append(r["seconds"])
            row["counters"].append(r["counters"])
            row["num_cached_tokens"].append(r["num_cached_tokens"])
            p50 = percentiles(later)["p50"]
            row["ratios"].append(base_p50 / p50 if p50 else 0.0)
            same = _same_answers(r["answers"], base["answers"])
            if row["identical"] is None or same[0] < row["identical"][0]:  # the worst repetition
                row["identical"] = same
    out_rows = []
    for row in rows.values():
        later, every = percentiles(row.pop("ttft_later")), percentiles(row.pop("ttft_all"))
        counters = _sum_counters(row.pop("counters"))
        out_rows.append(row | {
            "ttft_p50_s": later["p50"], "ttft_p90_s": later["p90"], "ttft_all_p50_s": every["p50"],
            "ttft_all_p90_s": every["p90"], "seconds_median": statistics.median(row["seconds"]),
            "ttft_ratio": statistics.median(row["ratios"]), **counters})
    return {"workload": workload.describe(), "concurrency": concurrency, "pool": pool, "reps": reps,
            "rows": out_rows}


def _sum_counters(counters: list[dict]) -> dict:
    """The counters summed over repetitions, and the hit rate of the sums."""
    total = {k: sum(c[k] for c in counters) for k in COUNTERS}
    total["prefix_hit_rate"] = (total["prefix_cache_hits"] / total["prefix_cache_queries"]
                                if total["prefix_cache_queries"] else 0.0)
    return total


# ---- one workload at once (noreuse, swap) -------------------------------------------------------


def run_batch(workload: Workload, model, tokenizer, engine_kwargs: dict, vocab) -> dict:
    """The whole workload in one generate call on a new engine: wall seconds and outputs."""
    llm = _engine(model, tokenizer, **engine_kwargs)
    _warm_up(llm, vocab)
    before = _counters(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests],
                           [_params(r.output_len) for r in workload.requests], use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = _delta(before, _counters(llm))
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    llm.shutdown()  # then dropped: the tier's files closed, the pool's memory returned before the next engine
    del llm
    gc.collect()
    return {"seconds": seconds, "token_ids": token_ids, "counters": counters}


def batch_part(name: str, workload: Workload, model, tokenizer, systems: dict[str, str], reps: int,
               offload_root: str | None, offload_bytes: int | None, engine_kwargs: dict, vocab, log=print) -> dict:
    """A row per system (label -> OFF, a policy or "swap"; the first the baseline), taking turns in
    each repetition: seconds, total and output tokens/s, the ratio of seconds to the baseline's."""
    rows = {label: {"system": label, "seconds": [], "ratios": [], "identical": None, "counters": [], "tier_bytes": [],
                    "settings": _settings(engine_kwargs | _tier_kwargs(kind, "x", offload_bytes))}
            for label, kind in systems.items()}
    tokens = workload.num_prompt_tokens + workload.num_output_tokens
    for rep in range(reps):
        results = {}
        for label, kind in systems.items():
            with _tier_dir(offload_root) if kind != OFF else contextlib.nullcontext() as path:
                r = run_batch(workload, model, tokenizer, engine_kwargs | _tier_kwargs(kind, path, offload_bytes), vocab)
                rows[label]["tier_bytes"].append(_dir_bytes(path) if path else 0)
            results[label] = r
            log(f"  {name}, rep {rep + 1}/{reps}, {label}: {r['seconds']:.1f} s, {tokens / r['seconds']:.0f} tok/s, "
                f"{r['counters']['preemptions']} preemptions")
        base = next(iter(results.values()))
        for label, r in results.items():
            row = rows[label]
            row["seconds"].append(r["seconds"])
            row["ratios"].append(r["seconds"] / base["seconds"])
            row["counters"].append(r["counters"])
            same = (sum(a == b for a, b in zip(r["token_ids"], base["token_ids"])), len(base["token_ids"]))
            if row["identical"] is None or same[0] < row["identical"][0]:
                row["identical"] = same
    out_rows = []
    for row in rows.values():
        seconds = statistics.median(row["seconds"])
        out_rows.append(row | {"seconds_median": seconds, "total_tps": tokens / seconds,
                               "output_tps": workload.num_output_tokens / seconds,
                               "seconds_ratio": statistics.median(row["ratios"]),
                               **_sum_counters(row.pop("counters"))})
    return {"workload": workload.describe(), "reps": reps, "engine": _settings(engine_kwargs), "rows": out_rows}


# ---- restart -------------------------------------------------------------------------------------


def _first_request(model, tokenizer, engine_kwargs: dict, prompt: list[int], output_len: int) -> dict:
    """A new engine's first request (no warm-up: that is the restart): its TTFT, output and cached
    prompt tokens; the engine is dropped before this returns."""
    llm = _engine(model, tokenizer, **engine_kwargs)
    before = _counters(llm)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _params(output_len), use_tqdm=False)
    result = {"ttft": _ttft(out), "token_ids": list(out.outputs[0].token_ids),
              "num_cached_tokens": out.num_cached_tokens, "counters": _delta(before, _counters(llm))}
    llm.shutdown()  # then dropped: the tier's files closed, the pool's memory returned before the next engine
    del llm
    gc.collect()
    return result


def restart_part(model, tokenizer, prefix_len: int, question_len: int, output_len: int, reps: int,
                 offload_root: str | None, offload_bytes: int | None, engine_kwargs: dict, vocab, seed: int,
                 log=print) -> dict:
    """Each repetition: a fresh tier directory D; engine 1 on D serves system prompt + question A and
    is dropped; a new engine without the tier serves system prompt + question B (the baseline); a new
    engine on D serves system prompt + question B: the TTFT of each second engine's first request."""
    import random

    rng = random.Random(seed)
    system = [rng.choice(vocab) for _ in range(prefix_len)]
    first, second = ([rng.choice(vocab) for _ in range(question_len)] for _ in range(2))
    length = prefix_len + question_len + output_len
    block_size = engine_kwargs.get("block_size", 16)
    kwargs = engine_kwargs | {"max_model_len": length, "num_kv_blocks": 2 * math.ceil(length / block_size) + 1}
    base_ttft, tier_ttft, fill_ttft, ratios, cached, counters, tier_bytes = [], [], [], [], [], [], []
    identical = True
    for rep in range(reps):
        with _tier_dir(offload_root) as path:
            tier = kwargs | _tier_kwargs("evicted", path, offload_bytes)  # the default: written at shutdown
            fill = _first_request(model, tokenizer, tier, system + first, output_len)
            tier_bytes.append(_dir_bytes(path))
            base = _first_request(model, tokenizer, kwargs, system + second, output_len)
            again = _first_request(model, tokenizer, tier, system + second, output_len)
        fill_ttft.append(fill["ttft"])
        base_ttft.append(base["ttft"])
        tier_ttft.append(again["ttft"])
        ratios.append(base["ttft"] / again["ttft"])
        cached.append(again["num_cached_tokens"])
        counters.append(again["counters"])
        identical = identical and again["token_ids"] == base["token_ids"]
        log(f"  restart, rep {rep + 1}/{reps}: new engine without the tier {base['ttft'] * 1e3:.0f} ms, with the "
            f"tier {again['ttft'] * 1e3:.0f} ms ({again['num_cached_tokens']} cached prompt tokens)")
    return {"prompt": f"system prompt {prefix_len} tokens + question {question_len} tokens, {output_len} output "
                      "tokens", "reps": reps, "engine": _settings(kwargs),
            "fill_ttft_s": statistics.median(fill_ttft),
            "base_ttft_s": statistics.median(base_ttft), "tier_ttft_s": statistics.median(tier_ttft),
            "base_ttfts": base_ttft, "tier_ttfts": tier_ttft, "ratios": ratios, "ttft_ratio": statistics.median(ratios),
            "tier_bytes": statistics.median(tier_bytes), "identical": identical, **_sum_counters(counters),
            "num_cached_tokens": min(cached), "prompt_tokens": prefix_len + question_len}  # per request


def _warm_process(model, tokenizer, engine_kwargs: dict, vocab) -> None:
    """A throwaway engine runs a few prompts before anything is timed: the process's first large
    prefill and first batched decode steps pay one-time costs (the allocator growing, lazy set-up)
    that would otherwise land on whichever system runs first."""
    prompt_len = min(256, model[1].max_position_embeddings // 2)
    block_size = engine_kwargs.get("block_size", 16)
    workload = unique_prompts(4, -1, (prompt_len, prompt_len), 8, vocab)
    run_batch(workload, model, tokenizer,
              engine_kwargs | {"num_kv_blocks": 4 * math.ceil((prompt_len + 8) / block_size) + 1}, vocab)


# ---- the whole bench -----------------------------------------------------------------------------


def run_offload_bench(parts: tuple[str, ...] = PARTS, *, sessions: int = 8, turns: int = 4, system_prompt_len: int = 512,
                      user_len: int = 64, answer_len: int = 32, shared_system_prompt: bool = False,
                      concurrency: int = 2, pool_ratio: float = 4.0, policies: tuple[str, ...] = POLICIES,
                      noreuse_requests: int = 32, noreuse_prompt_len: tuple[int, int] = (256, 512),
                      noreuse_output_len: int = 64, restart_prefix_len: int = 2000, restart_question_len: int = 16,
                      restart_output_len: int = 4, restart_reps: int = 3, swap_requests: int = 32,
                      swap_prompt_len: int = 64, swap_output_len: int = 128, swap_max_num_seqs: int = 16,
                      swap_blocks: int | None = None, reps: int = 2, seed: int = 0, offload_root: str | None = None,
                      offload_bytes: int | None = None, engine_kwargs: dict | None = None, model=None,
                      tokenizer=None, log=print) -> dict:
    """Every part asked for, in order; a dict of plain data (the --json report)."""
    from pagedserve.models.loader import load_model, load_tokenizer

    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    bad = set(policies) - set(POLICIES)
    if bad:
        raise ValueError(f"unknown kv_offload_policy {sorted(bad)}; known: {', '.join(POLICIES)}")
    model, tokenizer = model or load_model(), tokenizer or load_tokenizer()
    vocab = safe_vocab(model[1])
    engine_kwargs = dict(engine_kwargs or {})
    block_size = engine_kwargs.get("block_size", 16)
    report: dict = {"parts": list(parts), "seed": seed}
    _warm_process(model, tokenizer, engine_kwargs, vocab)
    if "multiturn" in parts:
        workload = multi_turn_chat(sessions, turns, system_prompt_len, user_len, answer_len, shared_system_prompt,
                                   seed, vocab)
        log(workload.describe())
        report["multiturn"] = multiturn_part(workload, model, tokenizer, (OFF, *policies), concurrency, pool_ratio,
                                             reps, offload_root, offload_bytes, engine_kwargs, vocab, log)
    if "noreuse" in parts:
        workload = unique_prompts(noreuse_requests, seed, noreuse_prompt_len, noreuse_output_len, vocab)
        log(workload.describe())
        needed = sum(math.ceil((len(r.prompt_token_ids) + r.output_len) / block_size) for r in workload.requests)
        kwargs = engine_kwargs | {"num_kv_blocks": needed + 16}  # all at once, no preemption, no eviction
        report["noreuse"] = batch_part("noreuse", workload, model, tokenizer, {OFF: OFF, "evicted": "evicted", "write_through": "write_through"},
                                       reps, offload_root, offload_bytes, kwargs, vocab, log)
    if "restart" in parts:
        log(f"restart: system prompt {restart_prefix_len} tokens")
        report["restart"] = restart_part(model, tokenizer, restart_prefix_len, restart_question_len,
                                         restart_output_len, restart_reps, offload_root, offload_bytes,
                                         engine_kwargs, vocab, seed, log)
    if "swap" in parts:
        workload = unique_prompts(swap_requests, seed + 1, (swap_prompt_len, swap_prompt_len), swap_output_len, vocab)
        log(workload.describe())
        per_request = math.ceil((swap_prompt_len + swap_output_len) / block_size)
        blocks = swap_blocks or max(per_request + 1, min(swap_max_num_seqs, swap_requests) * per_request // 2)
        kwargs = engine_kwargs | {"num_kv_blocks": blocks, "max_num_seqs": swap_max_num_seqs,
                                  "max_model_len": swap_prompt_len + swap_output_len}
        report["swap"] = batch_part("swap", workload, model, tokenizer, {"recompute (no tier)": OFF, "swap": "swap",
                                                                  "swap + write-through": "swap+write_through"},
                                    reps, offload_root, offload_bytes, kwargs, vocab, log)
    report["tier_active"] = _tier_active(report)
    report["all_identical"] = all(_identical(report))
    return report


def _tier_active(report: dict) -> bool:
    """Whether any engine with the tier stored or loaded a block (else the tier did nothing: a build
    without it wired, or a broken one)."""
    rows = [r for part in ("multiturn", "noreuse", "swap") for r in report.get(part, {}).get("rows", [])]
    rows += [report["restart"]] if "restart" in report else []
    return any(r["kv_offload_stored_blocks"] or r["kv_offload_loaded_blocks"] for r in rows)


def _identical(report: dict):
    for part in ("multiturn", "noreuse", "swap"):
        for row in report.get(part, {}).get("rows", []):
            yield row["identical"] is None or row["identical"][0] == row["identical"][1]
    if "restart" in report:
        yield report["restart"]["identical"]


# ---- the report ----------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 or not n else f"{n / 2**10:,.1f} KiB"


def _target(met: bool) -> str:
    return "met" if met else "NOT met"


def markdown_table(report: dict) -> str:
    lines = ["The KV offload tier (kv_offload_dir: a directory of block files behind the pool, keyed by the prefix "
             "cache's block hashes) against the engine without it, in one run: the same prompts, one loaded model, a "
             "new engine for every run, the tier in a fresh temporary directory each time. Same output: greedy outputs "
             "equal to the baseline's token for token."]
    if not report.get("tier_active"):
        lines += ["", "**No engine with the tier stored or loaded a block (kv_offload_stored_blocks and "
                  "kv_offload_loaded_blocks are 0, or absent from get_metrics()): the tier did nothing in this run, "
                  "and its rows measure the engine without it.**"]
    mt = report.get("multiturn")
    if mt:
        pool = mt["pool"]
        raised = (f" (less than asked: the pool holds at least {mt['concurrency']} sessions' final contexts, so that "
                  "a generate call runs without preemption)" if pool.get("raised_for_concurrency") else "")
        lines += ["", "### Multi-turn chat", "",
                  f"{mt['workload']}. Round r runs every session's turn r, {mt['concurrency']} sessions per generate "
                  f"call. KV pool {pool['num_kv_blocks']} blocks, max_model_len {pool['max_model_len']}: the sessions' "
                  f"final contexts are {pool['context_over_pool']:.1f}x the pool"
                  f"{raised}. TTFT = first token - arrival (the "
                  f"request's metrics; a request waits for the others of its call), over turns >= 2 and over all "
                  f"turns, {mt['reps']} repetition(s) pooled; TTFT ratio: the baseline's p50 (turns >= 2) / this "
                  "row's, median over repetitions. Counters summed over repetitions.", "",
                  "| system | TTFT p50 ms (turns >= 2) | p90 | TTFT p50 ms (all) | p90 | seconds | prefix hit rate | "
                  "tier hit tokens | stored / loaded blocks | tier on disk | preemptions | TTFT ratio | same output |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mt["rows"]:
            ratio = "-" if r["system"] == OFF else f"{r['ttft_ratio']:.2f}x ({min(r['ratios']):.2f}..{max(r['ratios']):.2f})"
            lines.append(
                f"| {r['system']} | {r['ttft_p50_s'] * 1e3:.0f} | {r['ttft_p90_s'] * 1e3:.0f} | "
                f"{r['ttft_all_p50_s'] * 1e3:.0f} | {r['ttft_all_p90_s'] * 1e3:.0f} | {r['seconds_median']:.1f} | "
                f"{r['prefix_hit_rate']:.1%} | {r['kv_offload_hit_tokens']:,} | {r['kv_offload_stored_blocks']:,} / "
                f"{r['kv_offload_loaded_blocks']:,} | {_mib(max(r['tier_bytes']))} | {r['preemptions']} | {ratio} | "
                f"{_same(r)} |")
        best = max((r["ttft_ratio"] for r in mt["rows"] if r["system"] != OFF), default=None)
        if best is not None:
            lines.append(f"\nTTFT p50 (turns >= 2) without the tier / with it: {best:.2f}x at best (target >= 2x: "
                         f"{_target(best >= 2)}).")
    nr = report.get("noreuse")
    if nr:
        lines += ["", "### No reuse", "", f"{nr['workload']}, all in one generate call; the pool holds them all. "
                  f"What the tier costs when nothing is read back (evicted: no block is evicted, none written; write_through: every block written). Medians of {nr['reps']} "
                  "repetition(s); seconds ratio: this row / the baseline's, per repetition, median.", "",
                  "| system | seconds | total tok/s | output tok/s | stored blocks | tier on disk | seconds ratio "
                  "| same output |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in nr["rows"]:
            lines.append(f"| {r['system']} | {r['seconds_median']:.1f} | {r['total_tps']:.1f} | {r['output_tps']:.1f} | "
                         f"{r['kv_offload_stored_blocks']:,} | {_mib(max(r['tier_bytes']))} | "
                         f"{r['seconds_ratio']:.3f}x | {_same(r)} |")
        for tier in nr["rows"][1:]:
            lines.append(f"\nWith the tier ({tier['system']}) / without: {tier['seconds_ratio']:.3f}x the seconds "
                         f"(target <= 1.05x: {_target(tier['seconds_ratio'] <= 1.05)}).")
    rs = report.get("restart")
    if rs:
        lines += ["", "### Restart", "",
                  f"{rs['prompt']}. An engine with the tier in a fresh directory D serves the system prompt with "
                  "question A and is shut down and dropped; then a new engine without the tier, and a new engine on D, "
                  "each serve the system prompt with question B: the TTFT of that first request. The restart is a new "
                  "engine in the same process, not a new process: the OS page cache may still hold the tier's files. "
                  f"Medians of {rs['reps']} repetition(s).", "",
                  "| new engine | TTFT ms (first request) | cached prompt tokens | tier hit tokens | loaded blocks "
                  "| same output |", "|---|---:|---:|---:|---:|---:|",
                  f"| without the tier | {rs['base_ttft_s'] * 1e3:.0f} | - | - | - | - |",
                  f"| with the tier (same D) | {rs['tier_ttft_s'] * 1e3:.0f} | {rs['num_cached_tokens']:,} of "
                  f"{rs['prompt_tokens']:,} | {rs['kv_offload_hit_tokens'] // rs['reps']:,} | "
                  f"{rs['kv_offload_loaded_blocks'] // rs['reps']:,} | "
                  f"{'yes' if rs['identical'] else 'NO'} |",
                  "", f"The engine that filled the tier: TTFT {rs['fill_ttft_s'] * 1e3:.0f} ms, "
                  f"{_mib(rs['tier_bytes'])} written. TTFT without the tier / with it: {rs['ttft_ratio']:.2f}x "
                  f"({min(rs['ratios']):.2f}..{max(rs['ratios']):.2f}; target >= 3x: {_target(rs['ttft_ratio'] >= 3)})."]
    sw = report.get("swap")
    if sw:
        e = sw["engine"]
        lines += ["", "### Preemption: recompute vs swap", "",
                  f"{sw['workload']}, all in one generate call; max_num_seqs {e['max_num_seqs']}, a pool of "
                  f"{e['num_kv_blocks']} blocks (too small for them all: requests are preempted). Swap: the tier receives "
                  "the preempted requests' blocks only; swap + write-through: every full block too; recompute runs "
                  "no tier. Prefix caching is on in all. Medians of "
                  f"{sw['reps']} repetition(s).", "",
                  "| preemption mode | seconds | output tok/s | preemptions | loaded blocks | seconds ratio "
                  "| same output |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sw["rows"]:
            lines.append(f"| {r['system']} | {r['seconds_median']:.1f} | {r['output_tps']:.1f} | "
                         f"{r['preemptions']} | {r['kv_offload_loaded_blocks']:,} | {r['seconds_ratio']:.3f}x | "
                         f"{_same(r)} |")
        off, swap = sw["rows"][0], sw["rows"][1]
        if not off["preemptions"] or not swap["preemptions"]:
            lines.append("\n**A run without preemptions: the pool is too large for this comparison to mean anything.**")
        faster = "swap" if swap["seconds_ratio"] < 1 else "recompute"
        lines.append(f"\nSwap / recompute: {swap['output_tps'] / off['output_tps']:.2f}x the output tokens/s "
                     f"({faster} is faster here).")
    lines += ["", "Greedy outputs identical with and without the tier: "
              + ("yes, every request." if report["all_identical"] else "NO: see the same-output columns.")]
    return "\n".join(lines)


def _same(row: dict) -> str:
    if row["system"] in (OFF, "recompute (no tier)") or not row["identical"]:
        return "-"
    return f"{row['identical'][0]}/{row['identical'][1]}"


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if report.get("multiturn"):
        rows = report["multiturn"]["rows"]
        panels.append(("multi-turn: TTFT p50, turns >= 2 (ms)", [r["system"] for r in rows],
                       [r["ttft_p50_s"] * 1e3 for r in rows]))
    if report.get("noreuse"):
        rows = report["noreuse"]["rows"]
        panels.append(("no reuse: total tokens/s", [r["system"] for r in rows], [r["total_tps"] for r in rows]))
    if report.get("restart"):
        rs = report["restart"]
        panels.append(("restart: first request's TTFT (ms)", ["new engine", "new engine\n+ tier"],
                       [rs["base_ttft_s"] * 1e3, rs["tier_ttft_s"] * 1e3]))
    if report.get("swap"):
        rows = report["swap"]["rows"]
        panels.append(("preemption: output tokens/s", [r["system"] for r in rows], [r["output_tps"] for r in rows]))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(3.6 * max(1, len(panels)), 3.4), squeeze=False)
    for ax, (title, labels, values) in zip(axes[0], panels):
        ax.bar(range(len(values)), values, color=["tab:grey"] + ["tab:blue"] * (len(values) - 1))
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
