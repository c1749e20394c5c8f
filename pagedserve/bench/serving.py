"""`pagedserve bench serving`: an async load generator against any OpenAI-compatible server.

Requests of a seeded workload (token-id prompts, fixed output lengths) are sent as streaming
`/v1/completions` calls with Poisson arrivals at `request_rate` per second (inf = all at once).
For each request the client records time to first token (TTFT), the gaps between streamed
chunks (inter-token latency, ITL), time per output token after the first (TPOT) and end-to-end
latency; the report gives p50/p90/p99 of each and request and token throughput. Several servers
(`--url NAME=URL ...`, or servers the bench starts itself: `--systems`, bench/servers.py) take
turns on the same workload and arrival times, and are compared rate by rate. With `--rounds N`
every rate is measured N times, each round on new prompts, and the tables give the medians: on a
small shared machine one run of one system is not enough to tell 10% apart.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from pagedserve.bench.workload import Workload


@dataclass
class RequestRecord:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # seconds from the run's start to this request's send
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                       api_key: str | None) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if record.ttft == 0.0:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
        record.e2e = time.perf_counter() - start
        record.ok = True
    except httpx.HTTPError as e:
        record.error = repr(e)
    return record


def cpu_times() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine since boot, in clock ticks (Linux's /proc/stat).
    Idle and iowait are not busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def wait_until_idle(threshold: float = 0.05, window_s: float = 0.5, timeout_s: float = 30.0, *,
                    read_cpu_times: Callable[[], tuple[int, int]] = cpu_times,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """Wait until the machine's CPUs were busy less than `threshold` of a `window_s` window, at most
    `timeout_s`; return the seconds waited. A server that has just answered may keep a core busy:
    vLLM's CPU worker polls for its next step for a few seconds after its last request (1 CPU-second
    in the 3 s after one request, on the test machine), which would slow whichever system runs next.
    The CPU counters, clock and sleep can be replaced (tests)."""
    start = clock()
    try:
        before = read_cpu_times()
    except OSError:  # not Linux: no way to look, so just give it a few seconds
        sleep(min(5.0, timeout_s))
        return clock() - start
    while clock() - start < timeout_s:
        sleep(window_s)
        after = read_cpu_times()
        if after[1] > before[1] and (after[0] - before[0]) / (after[1] - before[1]) < threshold:
            break
        before = after
    return clock() - start


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"mean": statistics.fmean(values), "p50": q[49], "p90": q[89], "p99": q[98]}


async def warm_up(url: str, workload: Workload, model: str, api_key: str | None = None, num_requests: int = 8,
                  max_tokens: int = 8) -> None:
    """A few requests at once before the timed run, unrecorded: a server's first batch pays for lazy
    set-up (compilation, first allocations) that no later request sees."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(_one_request(client, url, model, r.prompt_token_ids, min(r.output_len, max_tokens), api_key)
                               for r in workload.requests[:num_requests]))


async def run_serving_bench(url: str, workload: Workload, request_rate: float, model: str, seed: int = 0,
                            api_key: str | None = None, progress: bool = True, system: str | None = None) -> dict:
    rng = random.Random(seed)
    pending = []
    bar = tqdm(total=len(workload.requests), desc="requests", disable=not progress)
    limits = httpx.Limits(max_connections=len(workload.requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def send(r):
            sent = time.perf_counter() - start
            record = await _one_request(client, url, model, r.prompt_token_ids, r.output_len, api_key)
            record.sent = sent
            bar.update(1)
            return record

        for r in workload.requests:
            pending.append(asyncio.create_task(send(r)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        records = await asyncio.gather(*pending)
        duration = time.perf_counter() - start
    bar.close()
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "system": system or url,
        "url": url,
        "workload": workload.describe(),
        "request_rate": request_rate,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (sum(r.prompt_tokens for r in ok) + output_tokens) / duration,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        # Each request in the workload's order, so that a percentile can be traced to the requests
        # behind it (a slow first token: a long prompt, or one that arrived behind others).
        "requests": [{"sent_s": round(r.sent, 4), "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                      "ttft_s": round(r.ttft, 4), "e2e_s": round(r.e2e, 4), "ok": r.ok} for r in records],
    }


def format_report(report: dict) -> str:
    lines = [f"{report['workload']} at {report['request_rate']} req/s against {report['url']}",
             f"completed {report['completed']}, failed {report['failed']} in {report['duration_s']:.1f} s",
             f"request throughput {report['request_throughput']:.2f} req/s, output {report['output_throughput']:.1f} tok/s, "
             f"total {report['total_token_throughput']:.1f} tok/s", "",
             "| latency (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = report[name]
        lines.append(f"| {name[:-2].upper()} | {p['mean'] * 1e3:.1f} | {p['p50'] * 1e3:.1f} | {p['p90'] * 1e3:.1f} | "
                     f"{p['p99'] * 1e3:.1f} |")
    return "\n".join(lines)


def format_table(reports: list[dict]) -> str:
    """One row per system and request rate: throughput and p50 / p99 latencies."""
    systems = list(dict.fromkeys(r["system"] for r in reports))
    several = len(systems) > 1
    first = reports[0]
    rounds = first.get("rounds", 1)
    drawn = first["workload"] if len({r["workload"] for r in reports}) == 1 and rounds == 1 else (
        f"{first['workload'].split(':')[0]}: {(first['completed'] + first['failed']) // rounds} requests per rate, "
        "new prompts at each rate" + (f", medians of {rounds} rounds" if rounds > 1 else ""))
    title = f"{drawn} against " + (", ".join(systems) if several else
                                               first["url"] if systems[0] == first["url"] else f"{systems[0]} ({first['url']})")
    lines = [title, "", ("| system " if several else "") + "| request rate (req/s) | completed | req/s | output tok/s | "
             "TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | e2e p50 / p99 (s) |",
             ("|---" if several else "") + "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        lines.append((f"| {r['system']} " if several else "") +
                     f"| {r['request_rate']:g} | {r['completed']} of {r['completed'] + r['failed']} | "
                     f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['ttft_s']['p50'] * 1e3:.0f} / {r['ttft_s']['p99'] * 1e3:.0f} | "
                     f"{r['tpot_s']['p50'] * 1e3:.0f} / {r['tpot_s']['p99'] * 1e3:.0f} | "
                     f"{r['e2e_s']['p50']:.1f} / {r['e2e_s']['p99']:.1f} |")
    return "\n".join(lines)


def median_reports(runs: list[dict]) -> list[dict]:
    """One report per (system, rate): the run itself, or with several rounds the median of each
    throughput and latency percentile over them (completed and failed summed)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["system"], run["request_rate"]), []).append(run)
    reports = []
    for rs in groups.values():
        # The per-request records stay with their runs: a median report has none.
        report = {k: v for k, v in rs[0].items() if k not in ("round", "requests")} | {"rounds": len(rs)}
        if len(rs) > 1:
            report.update(
                completed=sum(r["completed"] for r in rs), failed=sum(r["failed"] for r in rs),
                errors=sorted({e for r in rs for e in r["errors"]})[:5],
                **{k: statistics.median(r[k] for r in rs)
                   for k in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput")},
                **{k: {q: statistics.median(r[k][q] for r in rs) for q in rs[0][k]}
                   for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")})
        reports.append(report)
    return reports


def format_comparison(reports: list[dict], baseline: str, runs: list[dict] | None = None) -> str:
    """Rate by rate, the baseline's latency percentiles against each other system's, with the ratio
    (below 1: the baseline is faster). Given the runs of several rounds, each cell also counts the
    rounds in which the baseline was at least as good (latency no higher, throughput no lower)."""
    by_key = {(r["system"], r["request_rate"]): r for r in reports}
    by_round = {(r["system"], r["request_rate"], r.get("round", 0)): r for r in runs or []}
    rounds = sorted({r.get("round", 0) for r in runs or []})
    others = [s for s in dict.fromkeys(r["system"] for r in reports) if s != baseline]
    lines = [f"{baseline} / other system, ms (ratio; below 1: {baseline} is faster)"
             + (f"; then the rounds, of {len(rounds)}, in which {baseline} was at least as good" if len(rounds) > 1 else ""),
             "", "| request rate (req/s) | vs | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | output tok/s |",
             "|---:|---|---:|---:|---:|---:|---:|"]

    def won(other, rate, key, q) -> str:
        if len(rounds) < 2:
            return ""
        pairs = [(by_round.get((baseline, rate, n)), by_round.get((other, rate, n))) for n in rounds]
        pairs = [(a, b) for a, b in pairs if a and b]
        wins = sum((a[key] >= b[key]) if q is None else (a[key][q] <= b[key][q]) for a, b in pairs)
        return f"; {wins}/{len(pairs)}"

    for rate in dict.fromkeys(r["request_rate"] for r in reports):
        ours = by_key.get((baseline, rate))
        for other in others:
            theirs = by_key.get((other, rate))
            if ours is None or theirs is None:
                continue
            cells = []
            for key, q in (("ttft_s", "p50"), ("ttft_s", "p99"), ("tpot_s", "p50"), ("tpot_s", "p99")):
                a, b = ours[key][q], theirs[key][q]
                cells.append(f"{a * 1e3:.0f} / {b * 1e3:.0f} ({a / b:.2f}x{won(other, rate, key, q)})" if b else "-")
            a, b = ours["output_throughput"], theirs["output_throughput"]
            cells.append(f"{a:.0f} / {b:.0f} ({a / b:.2f}x{won(other, rate, 'output_throughput', None)})" if b else "-")
            lines.append(f"| {rate:g} | {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(reports: list[dict], path: str) -> None:
    """Latency (p50, with p99 dashed) against request rate, one colour per system; 'inf' is drawn
    past the last rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r["request_rate"] for r in reports if r["request_rate"] != float("inf")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for colour, system in enumerate(dict.fromkeys(r["system"] for r in reports)):
        rows = [r for r in reports if r["system"] == system]
        x = [r["request_rate"] if r["request_rate"] != float("inf") else 2 * max(finite, default=1) for r in rows]
        for ax, (key, unit) in zip(axes, [("ttft_s", 1e3), ("tpot_s", 1e3), ("e2e_s", 1)]):
            ax.plot(x, [r[key]["p50"] * unit for r in rows], "o-", color=f"C{colour}", label=f"{system} p50")
            ax.plot(x, [r[key]["p99"] * unit for r in rows], "o--", color=f"C{colour}", label=f"{system} p99")
    for ax, (title, unit) in zip(axes, [("time to first token", "ms"), ("time per output token", "ms"),
                                        ("end-to-end latency", "s")]):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s; rightmost: all at once)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
