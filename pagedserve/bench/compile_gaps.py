"""`pagedserve bench structured --part gaps`: a streaming neighbour's token gaps while big schemas compile.

A real server (`python -m pagedserve.entrypoints.cli serve` on loopback, the engine core in its own
process by default, the default grammar_compile_timeout) streams one long free answer. Once it
flows, its gaps are timed for a few seconds alone; then `concurrent` requests are sent at once, each
with a JSON schema of `properties` optional properties that no compiler has seen (so each
compiles) and a prompt of a few tokens, and the gaps are timed until the last of them has answered
(200 once compiled and generated, 400 past the time limit). Each repetition has a server of its
own: a compile past its time limit goes on after its 400, and would run into the next one. The
target: the neighbour's longest gap while the compiles run <= 5x its median (its tokens may come
slower, not in bursts). The machine's load average is part of the report: another process's load
slows a CPU engine's thread team as a compile beside it would.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import uuid

# The big requests' prompt: a few tokens, whose prefill is a step like the others, so that the
# window measures the compiles rather than the requests' own work.
COMPILE_PROMPT = "A record:"
NEIGHBOUR_PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def big_schema(properties: int) -> dict:
    """An object of `properties` optional integers, named so that no compiler's cache holds it."""
    prefix = "p" + uuid.uuid4().hex[:8]
    return {"type": "object", "properties": {f"{prefix}_{i}": {"type": "integer"} for i in range(properties)}}


def gap_figures(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {"count": len(gaps), "median_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if gaps else 0.0,
            "max_ms": ordered[-1] * 1e3 if gaps else 0.0}


def measure_compile_gaps(url: str, model_name: str, concurrent: int = 3, properties: int = 1000,
                         baseline_s: float = 3.0, timeout_s: float = 120.0) -> dict:
    """The neighbour's gaps alone and while `concurrent` big schemas compile, on the server at `url`."""
    import httpx

    client = httpx.Client(base_url=url, timeout=timeout_s)
    stamps: list[float] = []  # when each content chunk of the neighbour arrived
    phase = {"compiles_started": None, "compiles_done": None}
    flowing, stop = threading.Event(), threading.Event()

    def neighbour() -> None:
        body = {"model": model_name, "messages": NEIGHBOUR_PROMPT, "max_tokens": 1800, "temperature": 0,
                "stream": True, "ignore_eos": True, "min_tokens": 1800}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    stamps.append(time.monotonic())
                    if len(stamps) == 20:
                        flowing.set()
                if stop.is_set():
                    return

    results: list[dict] = []

    def compile_request(schema: dict) -> None:
        start = time.monotonic()
        response = client.post("/v1/completions", json={
            "model": model_name, "prompt": COMPILE_PROMPT, "max_tokens": 4, "temperature": 0,
            "structured_outputs": {"json": schema}})
        results.append({"status": response.status_code, "seconds": time.monotonic() - start})

    load_before = os.getloadavg()[0]
    reader = threading.Thread(target=neighbour, daemon=True)
    reader.start()
    if not flowing.wait(timeout_s):
        raise RuntimeError("the neighbour's stream did not start")
    time.sleep(baseline_s)
    schemas = [big_schema(properties) for _ in range(concurrent)]
    senders = [threading.Thread(target=compile_request, args=(s,), daemon=True) for s in schemas]
    phase["compiles_started"] = time.monotonic()
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout_s)
    phase["compiles_done"] = time.monotonic()
    time.sleep(0.5)  # a gap that spans the last answer ends after it
    stop.set()
    reader.join(timeout_s)
    if reader.is_alive() or len(results) < concurrent:
        raise RuntimeError("the neighbour or a compile request did not finish in time")

    gaps = [(b - a, b) for a, b in zip(stamps, stamps[1:])]
    start, end = phase["compiles_started"], phase["compiles_done"]
    baseline = [g for g, t in gaps if start - baseline_s <= t < start]
    during = [g for g, t in gaps if t >= start and t - g <= end]  # every gap that overlaps the window
    report = {"concurrent": concurrent, "properties": properties, "statuses": sorted(r["status"] for r in results),
              "compile_request_s": sorted(r["seconds"] for r in results), "window_s": end - start,
              "load_average": [load_before, os.getloadavg()[0]],
              "baseline": gap_figures(baseline), "during": gap_figures(during)}
    # When the longest gaps ended, in seconds from the compiles' start (where the time goes).
    report["longest_gaps"] = [(round(t - start, 2), round(g * 1e3, 1))
                              for g, t in sorted((x for x in gaps if x[1] >= start), reverse=True)[:5]]
    report["max_over_median"] = report["during"]["max_ms"] / max(report["during"]["median_ms"], 1e-9)
    report["max_over_baseline_median"] = report["during"]["max_ms"] / max(report["baseline"]["median_ms"], 1e-9)
    return report


def run_compile_gaps_bench(concurrent: int = 3, properties: int = 1000, reps: int = 1,
                           extra_args: list[str] | None = None) -> list[dict]:
    """measure_compile_gaps `reps` times, each on a server started for it; `extra_args`: more of
    the server's flags."""
    from pagedserve.bench.servers import launch

    name = "bench-model"
    reports = []
    for _ in range(reps):
        with launch("pagedserve", name, extra_args=extra_args) as server:
            reports.append(measure_compile_gaps(server.url, name, concurrent, properties))
    return reports


def format_gaps_table(reports: list[dict]) -> str:
    r0 = reports[0]
    lines = [f"A streaming neighbour's token gaps while {r0['concurrent']} schemas of {r0['properties']:,} "
             "properties compile at once (real server, loopback; the machine's 1-minute load average before and "
             f"after, on {os.cpu_count()} cores)", "",
             "| rep | load | statuses | compile requests (s) | alone: median / max (ms) | during: median / p99 / max (ms) "
             "| max / median | max / median alone |", "|---:|---|---|---|---:|---:|---:|---:|"]
    for i, r in enumerate(reports):
        b, d = r["baseline"], r["during"]
        lines.append(f"| {i + 1} | {r['load_average'][0]:.1f}, {r['load_average'][1]:.1f} "
                     f"| {', '.join(map(str, r['statuses']))} | "
                     f"{', '.join(f'{s:.2f}' for s in r['compile_request_s'])} | {b['median_ms']:.1f} / {b['max_ms']:.1f} "
                     f"| {d['median_ms']:.1f} / {d['p99_ms']:.1f} / {d['max_ms']:.1f} | {r['max_over_median']:.1f}x "
                     f"| {r['max_over_baseline_median']:.1f}x |")
    lines.append("\nTarget: the longest gap while they compile <= 5x the median.")
    return "\n".join(lines)
