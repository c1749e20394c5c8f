"""`pagedserve bench memory`: contiguous vs paged KV allocation on one trace.

One seeded trace (log-uniform prompt and output lengths, Poisson arrivals) is replayed through
the same continuous-batching admission under one fixed KV budget, with each allocation policy:

- contiguous, max_model_len: every request reserves a slab for the longest possible sequence;
- contiguous, prompt + max_tokens: the slab is sized from what the request asked for;
- paged, block size b: the real `KVCacheManager` hands out blocks as tokens arrive, and
  preempts (frees, recomputes later) the most recently admitted request when blocks run out.

Slabs live in one address space and are placed first-fit, so the contiguous policies also
suffer external fragmentation. Outputs are unknown to every allocator until they end.
Each step, every running request appends one token to its KV; a newly admitted request first
stores its prompt (and any tokens it had produced before a preemption).
"""

from __future__ import annotations

import bisect
import json
import random
from collections import deque
from dataclasses import dataclass, field

from pagedserve.bench.workload import log_uniform, poisson_arrival_steps
from pagedserve.kv import KVCacheManager


@dataclass(frozen=True)
class TraceRequest:
    arrival_step: int
    prompt_len: int
    output_len: int  # when it really stops; the allocator learns it only then
    max_tokens: int  # what the client asked for, >= output_len


def make_trace(num_requests: int, seed: int, min_len: int, max_len: int, max_tokens: int, rate: float) -> list[TraceRequest]:
    rng = random.Random(seed)
    arrivals = poisson_arrival_steps(rng, num_requests, rate)
    return [
        TraceRequest(t, log_uniform(rng, min_len, max_len), log_uniform(rng, min_len, max_tokens), max_tokens)
        for t in arrivals
    ]


class ContiguousAllocator:
    """Per-request slabs placed first-fit in one linear KV address space."""

    def __init__(self, budget_slots: int, slab_size) -> None:
        self.slab_size = slab_size  # TraceRequest -> slots to reserve
        self.free_ranges: list[tuple[int, int]] = [(0, budget_slots)]  # sorted (start, length)
        self.slabs: dict[int, tuple[int, int]] = {}

    def admit(self, rid: int, req: TraceRequest, num_tokens: int) -> bool:
        size = self.slab_size(req)
        for i, (start, length) in enumerate(self.free_ranges):
            if length >= size:
                self.free_ranges[i : i + 1] = [(start + size, length - size)] if length > size else []
                self.slabs[rid] = (start, size)
                return True
        return False

    def grow(self, rid: int) -> bool:
        return True  # the slab was sized for the whole sequence

    def free(self, rid: int) -> None:
        start, size = self.slabs.pop(rid)
        i = bisect.bisect(self.free_ranges, (start, size))
        self.free_ranges.insert(i, (start, size))
        # Merge with the neighbours so that freed space can be reused in one piece.
        if i + 1 < len(self.free_ranges) and start + size == self.free_ranges[i + 1][0]:
            self.free_ranges[i : i + 2] = [(start, size + self.free_ranges[i + 1][1])]
        if i > 0 and self.free_ranges[i - 1][0] + self.free_ranges[i - 1][1] == start:
            prev = self.free_ranges[i - 1]
            self.free_ranges[i - 1 : i + 1] = [(prev[0], prev[1] + self.free_ranges[i][1])]

    def reserved_slots(self) -> int:
        return sum(size for _, size in self.slabs.values())


class PagedAllocator:
    """The engine's real memory manager, one block table per request."""

    def __init__(self, budget_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.manager = KVCacheManager(budget_slots // block_size, block_size, enable_prefix_caching=False)

    def admit(self, rid: int, req: TraceRequest, num_tokens: int) -> bool:
        return self.manager.admit(rid, [0] * num_tokens) is not None

    def grow(self, rid: int) -> bool:
        return self.manager.grow(rid, 1) is not None

    def free(self, rid: int) -> None:
        self.manager.free(rid)

    def reserved_slots(self) -> int:
        return self.manager.pool.num_used * self.block_size


@dataclass
class PolicyResult:
    name: str
    steps: int = 0
    preemptions: int = 0
    reserved: list[int] = field(default_factory=list)  # per step: slots reserved
    filled: list[int] = field(default_factory=list)  # per step: slots holding a token
    resident: list[int] = field(default_factory=list)  # per step: requests holding KV memory

    def waste_series(self) -> list[float]:
        return [1 - f / r if r else 0.0 for r, f in zip(self.reserved, self.filled)]

    def summary(self, budget_slots: int) -> dict:
        reserved, filled = sum(self.reserved), sum(self.filled)
        # Peak over the steps where memory is meaningfully in use, not the first lone request.
        busy = [w for w, r in zip(self.waste_series(), self.reserved) if r >= budget_slots / 10]
        return {
            "policy": self.name,
            "mean_waste": 1 - filled / reserved if reserved else 0.0,
            "peak_waste": max(busy, default=0.0),
            "mean_resident": sum(self.resident) / len(self.resident),
            "mean_tokens_held": filled / len(self.filled) / budget_slots,
            "steps": self.steps,
            "preemptions": self.preemptions,
        }


def simulate(name: str, trace: list[TraceRequest], allocator, max_num_seqs: int) -> PolicyResult:
    """Replay `trace` step by step with continuous batching over `allocator`."""
    result = PolicyResult(name)
    pending = deque(sorted(range(len(trace)), key=lambda i: trace[i].arrival_step))
    waiting: deque[int] = deque()
    running: list[int] = []  # in admission order
    kv_tokens = [0] * len(trace)
    generated = [0] * len(trace)
    step = 0
    while pending or waiting or running:
        while pending and trace[pending[0]].arrival_step <= step:
            waiting.append(pending.popleft())
        # Running requests write one more token each; out of memory preempts the newest.
        for rid in list(running):
            if rid not in running:
                continue  # preempted earlier in this step
            while not allocator.grow(rid):
                victim = running.pop()
                allocator.free(victim)
                waiting.appendleft(victim)
                result.preemptions += 1
                if victim == rid:
                    break
            else:
                kv_tokens[rid] += 1
                generated[rid] += 1
        # Admit waiting requests in arrival order while memory allows (no skipping ahead).
        while waiting and len(running) < max_num_seqs:
            rid = waiting[0]
            need = trace[rid].prompt_len + generated[rid]  # recomputation after a preemption
            if not allocator.admit(rid, trace[rid], need):
                break
            waiting.popleft()
            running.append(rid)
            kv_tokens[rid] = need
            generated[rid] += 1  # the prefill step samples a token too
        result.reserved.append(allocator.reserved_slots())
        result.filled.append(sum(kv_tokens[r] for r in running))
        result.resident.append(len(running))
        for rid in [r for r in running if generated[r] >= trace[r].output_len]:
            running.remove(rid)
            allocator.free(rid)
        step += 1
        if step > 1_000_000:
            raise RuntimeError(f"{name}: the trace does not finish (a request can never fit?)")
    result.steps = step
    return result


def run_memory_bench(
    num_requests: int = 1000,
    seed: int = 0,
    kv_budget_tokens: int = 65536,
    max_model_len: int = 2048,
    min_len: int = 16,
    max_len: int = 1024,
    max_tokens: int = 1024,
    arrival_rate: float = 2.0,
    max_num_seqs: int = 256,
    block_sizes: tuple[int, ...] = (1, 8, 16, 32),
) -> tuple[dict, list[PolicyResult]]:
    if max_len + max_tokens > max_model_len:
        raise ValueError(f"max_len + max_tokens ({max_len + max_tokens}) exceeds max_model_len ({max_model_len})")
    trace = make_trace(num_requests, seed, min_len, max_len, max_tokens, arrival_rate)
    policies = [
        ("contiguous, max_model_len", ContiguousAllocator(kv_budget_tokens, lambda r: max_model_len)),
        ("contiguous, prompt + max_tokens", ContiguousAllocator(kv_budget_tokens, lambda r: r.prompt_len + r.max_tokens)),
    ] + [(f"paged, block {b}", PagedAllocator(kv_budget_tokens, b)) for b in block_sizes]
    results = [simulate(name, trace, alloc, max_num_seqs) for name, alloc in policies]
    setup = {
        "num_requests": num_requests,
        "seed": seed,
        "kv_budget_tokens": kv_budget_tokens,
        "max_model_len": max_model_len,
        "prompt_len": [min_len, max_len],
        "output_len": [min_len, max_tokens],
        "max_tokens": max_tokens,
        "arrival_rate_per_step": arrival_rate,
        "max_num_seqs": max_num_seqs,
        "total_prompt_tokens": sum(r.prompt_len for r in trace),
        "total_output_tokens": sum(r.output_len for r in trace),
    }
    return setup, results


def markdown_table(setup: dict, results: list[PolicyResult]) -> str:
    budget = setup["kv_budget_tokens"]
    base = results[0].summary(budget)
    lines = [
        "| policy | reserved KV holding no token (mean) | (peak) | requests resident (mean) | x contiguous max-len | budget holding tokens (mean) | steps to finish | preemptions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r.summary(budget)
        lines.append(
            f"| {s['policy']} | {s['mean_waste']:.1%} | {s['peak_waste']:.1%} | {s['mean_resident']:.1f} | "
            f"{s['mean_resident'] / base['mean_resident']:.2f}x | {s['mean_tokens_held']:.1%} | {s['steps']} | {s['preemptions']} |"
        )
    return "\n".join(lines)


def plot(results: list[PolicyResult], budget: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for r in results:
        axes[0].plot(r.resident, label=r.name, lw=1)
        axes[1].plot([f / budget for f in r.filled], lw=1)
        axes[2].plot(r.waste_series(), lw=1)
    axes[0].set_ylabel("requests resident")
    axes[1].set_ylabel("KV budget holding tokens")
    axes[2].set_ylabel("reserved KV holding no token")
    axes[2].set_xlabel("step")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].set_title("Contiguous vs paged KV allocation on one trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(setup: dict, results: list[PolicyResult], out_dir: str | None, json_path: str | None) -> str:
    import os

    table = markdown_table(setup, results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_memory.md"), "w") as f:
            f.write(f"Setup: `{json.dumps(setup)}`\n\n{table}\n\n![occupancy and waste](bench_memory.png)\n")
        plot(results, setup["kv_budget_tokens"], os.path.join(out_dir, "bench_memory.png"))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"setup": setup, "results": [r.summary(setup["kv_budget_tokens"]) for r in results]}, f, indent=2)
    return table
