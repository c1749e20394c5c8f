"""`pagedserve bench overhead`: the engine's host cost per step, with the model forward replaced
by a no-op (`DryRunModel`), so that what is left is the engine's own Python and tensor building.

Each scenario is R requests with distinct random prompts of C tokens (no prefix is shared) on a
pool of P blocks of 16 tokens. All R are prefilled in one untimed step (the scheduler's token
budget is raised to R x C for that step only, so that no request decodes while others still
prefill and all contexts stay equal), then run 3 untimed decode steps under the configured
budget, so that every step timed is a steady decode of exactly R requests (one new token each,
contexts C+4 .. C+3+N). N decode steps are then timed, each split into parts by wrapping the
engine's methods on the instance (`Timers`, monkeypatch-style; the engine's code is unchanged):

  schedule  Scheduler.schedule
  prepare   ModelRunner.execute minus the dry-run model (input ids, AttentionMetadata, the
            logits rows: everything the runner does around the forward)
  forward   DryRunModel.forward + compute_logits: the no-op; should be ~0
  sample    SamplingBatch.build + Sampler (greedy argmax over [R, vocab] fixed logits)
  commit    EngineCore._commit: finish_step, append the token, stop checks on token ids
  transport what the core in its own process adds: the step's sample outputs and the core's
            figures encoded as msgpack (msgspec), sent and received over a ZMQ ipc PUSH/PULL pair
            (both ends in this process: the kernel's socket path without a second scheduler
            slice), decoded. The front then works on the decoded outputs
  view      the live KV view (the dashboard): the core's kv_view() after every step (a no-op
            unwatched), and when one is due, the front applying it and building the page's frame.
            Its recording during the step (the pool noting changed blocks, the event log) falls
            in the parts above: pool state "watched" has a viewer all along, "fresh" none
  stats     EngineCore._record_usage and core_stats(), plus the front's snapshot that the
            server publishes after every step (RequestTracker.snapshot)
  other     the rest of the step (_samplers, generator states, list building)
  total     all of the above: engine.step() with the transport in the middle, + the snapshot

Figures are medians over the N steps (robust to a neighbour's load on a shared machine); the
mean total is kept too, since a rare slow step (a cyclic-GC pass over a large pool's blocks, say)
shows only there. Torch runs on 1 intra-op thread by default (see run_overhead_bench). A
scenario whose blocks do not fit the pool is reported as not applicable: it would preempt, and
that is not a steady decode.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import msgspec
import torch
import zmq

from pagedserve.bench.profile import Timers
from pagedserve.config import EngineConfig
from pagedserve.core.messages import CoreStats, EngineCoreOutputs
from pagedserve.core.sampler import SamplingBatch
from pagedserve.dashboard.live import KVWatch
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.streams import RequestTracker
from pagedserve.kv.kv_cache_manager import cdiv
from pagedserve.models.config import ModelConfig
from pagedserve.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "forward", "sample", "commit", "transport", "output", "view", "stats", "other")
WARMUP_STEPS = 3
DEFAULT_TOKEN = 260  # " the" in SmolLM2's vocabulary: a plain word, not EOS, not special


class DryRunModel(torch.nn.Module):
    """A stand-in for `DecoderForCausalLM` that computes nothing, for measuring the engine around it.

    Same interface as the model runner uses: `forward(input_ids, positions, kv_caches,
    attn_metadata)` returns hidden states [num_tokens, hidden_size] and `compute_logits(hidden)`
    returns logits [rows, vocab_size]; `config` is the ModelConfig. It is an nn.Module, so the
    runner calls it through Module.__call__ as it calls the real model.

    What it skips: the embedding, every layer (attention, K/V slot writes, block gathers, MLP
    matmuls), the final norm and the LM head. `forward` returns one zero row expanded (a
    zero-stride view, no memory) to [num_tokens, hidden_size]; `compute_logits` returns a view of
    a preallocated [rows, vocab] tensor whose every row is the same fixed vector: seeded random
    normal values with `token_id` raised above the maximum. So greedy decoding always picks
    `token_id`, which must not be an EOS id (checked), and a request ends only by max_tokens. The
    sampler works out of place, so sharing the tensor between steps is safe.

    What remains measured is all of the engine's own work: scheduling and KV bookkeeping
    (Scheduler, KVCacheManager, BlockPool), the runner's input and AttentionMetadata building and
    its indexing of the logits rows, sampling (SamplingBatch.build and the Sampler's argmax over
    the real vocabulary), output processing (append, incremental detokenization with the real
    tokenizer, stop checks, RequestOutput assembly) and the stats.

    The KV cache: `dry_model_config` gives the engine the real config with head_dim=0, so the
    runner's own `allocate_kv_cache` still makes one K and one V tensor per layer with
    num_blocks rows, but of zero bytes: a pool of 1M blocks costs nothing in tensors. Nothing on
    the host path reads head_dim (AttentionMetadata depends on block ids and lengths only; block
    copies would index the empty tensors, and none happen here: no request forks).
    """

    def __init__(self, config: ModelConfig, token_id: int = DEFAULT_TOKEN, max_rows: int = 256,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        if not 0 <= token_id < config.vocab_size:
            raise ValueError(f"token_id {token_id} is outside the vocabulary of {config.vocab_size}")
        if token_id in config.eos_token_ids:
            raise ValueError(f"token_id {token_id} is an EOS id: decoding would stop")
        self.config = config
        self.token_id = token_id
        self._hidden = torch.zeros(1, config.hidden_size, dtype=dtype, device=device)
        row = torch.randn(config.vocab_size, generator=torch.Generator().manual_seed(seed))
        row[token_id] = row.max() + 1.0
        self._row = row.to(device)
        self._logits = self._row.expand(max_rows, -1).contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, attn_metadata) -> torch.Tensor:
        return self._hidden.expand(input_ids.shape[0], -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self._logits.shape[0]:
            self._logits = self._row.expand(rows, -1).contiguous()
        return self._logits[:rows]


def dry_model_config(config: ModelConfig) -> ModelConfig:
    """`config` with head_dim=0: the runner's KV tensors keep their per-layer layout and their
    num_blocks rows, and hold zero bytes (see DryRunModel)."""
    return dataclasses.replace(config, head_dim=0)


def build_dry_engine(num_blocks: int, tokenizer=None, model_config: ModelConfig | None = None,
                     token_id: int = DEFAULT_TOKEN, **engine_kwargs) -> LLMEngine:
    """An LLMEngine on the CPU over a DryRunModel and a pool of `num_blocks` blocks; the model
    config defaults to the embedded SmolLM2's and the tokenizer to its real one."""
    from pagedserve.models.loader import load_config, load_tokenizer

    config = dry_model_config(model_config or load_config())
    engine_config = EngineConfig(device="cpu", num_kv_blocks=num_blocks, **engine_kwargs)
    model = DryRunModel(config, token_id, max_rows=engine_config.max_num_seqs)
    return LLMEngine(engine_config, model=(model, config), tokenizer=tokenizer or load_tokenizer())


def kv_tensor_bytes(engine: LLMEngine) -> int:
    """Bytes the runner's KV cache tensors hold."""
    return sum(t.untyped_storage().nbytes() for cache in engine.runner.kv_caches for t in cache)


@dataclass
class OverheadRow:
    requests: int
    context: int
    pool_blocks: int
    steps: int = 0
    blocks_needed: int = 0
    parts_ms: dict[str, float] = field(default_factory=dict)  # medians per step
    total_ms: float | None = None  # median per step
    core_ms: float | None = None  # median per step of total - output: the core's part when the front has its own process
    mean_total_ms: float | None = None
    skipped: str | None = None  # why the scenario was not run
    cached_pool: bool = False  # every free block held a cached prefix when the scenario began
    watched: bool = False  # the live KV view was on (a dashboard viewer) throughout


def blocks_needed(requests: int, context: int, steps: int, block_size: int = 16) -> int:
    """Blocks R requests hold at the end of a scenario: prompt, warm-up and timed tokens."""
    return requests * cdiv(context + WARMUP_STEPS + steps + 1, block_size)


class ZmqLoopback:
    """The core-to-front wire of `AsyncLLM`, both ends in this process: a ZMQ PUSH/PULL pair
    over ipc, msgpack frames of EngineCoreOutputs. `wrap(core)` returns a step function that
    runs the core's step and sends its outputs through; `take()` gives the seconds spent on the
    wire since the last call."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedserve-bench-")
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/outputs")
        self._push = self._context.socket(zmq.PUSH)
        self._push.connect(f"ipc://{self._dir}/outputs")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._seconds = 0.0
        self._view_seconds = 0.0
        self.last_stats: CoreStats | None = None
        self.watch = KVWatch()  # the front's copy of the pool, as AsyncLLM keeps it

    def wrap(self, core):
        step = core.step

        def step_over_the_wire():
            outputs = step()
            stats = core.core_stats()
            start = time.perf_counter()
            view = core.kv_view()
            viewed = time.perf_counter()
            self._push.send(self._encoder.encode(EngineCoreOutputs(outputs, stats, view)))
            message = self._decoder.decode(self._pull.recv())
            sent = time.perf_counter()
            if message.kv_view is not None:  # the server builds one frame per view at most
                self.watch.apply(message.kv_view, message.stats, 0)
                self.watch.encoded()
            self._seconds += sent - viewed
            self._view_seconds += (viewed - start) + (time.perf_counter() - sent)
            self.last_stats = message.stats
            return message.outputs

        return step_over_the_wire

    def take(self) -> tuple[float, float]:
        """Seconds on the wire and in the live view since the last call."""
        seconds, view, self._seconds, self._view_seconds = self._seconds, self._view_seconds, 0.0, 0.0
        return seconds, view

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def fill_prefix_cache(engine: LLMEngine) -> int:
    """Make every free block a cached free block, as in a server that has run a while: each
    holds a made-up prefix (a 14-byte key that no 32-byte SHA-256 block hash can equal, so no
    request ever hits it), findable until the LRU queue hands the block out again. Only the
    pool's own API is used (allocate, cache, release). Returns how many blocks it cached."""
    pool = engine.kv.pool
    blocks = pool.allocate(pool.num_free)
    for i, block in enumerate(blocks):
        pool.cache(block, i.to_bytes(8, "little") + b"filler")
    pool.release(blocks)
    return len(blocks)


def run_scenario(engine: LLMEngine, requests: int, context: int, steps: int = 50, seed: int = 0,
                 cached_pool: bool = False, watched: bool = False) -> OverheadRow:
    """Time `steps` steady decode steps of `requests` requests with `context`-token prompts on
    `engine` (a dry-run engine with nothing in flight); every block is free again afterwards.
    cached_pool: fill the pool's prefix cache first (`fill_prefix_cache`); watched: a dashboard
    viewer watches the pool from before the requests arrive."""
    kv = engine.kv
    row = OverheadRow(requests, context, kv.pool.num_blocks, steps,
                      blocks_needed(requests, context, steps, kv.block_size), cached_pool=cached_pool,
                      watched=watched)
    if row.blocks_needed > kv.pool.num_blocks:
        row.skipped = f"needs {row.blocks_needed:,} blocks"
        return row
    if requests > engine.scheduler.max_num_seqs:
        row.skipped = f"more than max_num_seqs ({engine.scheduler.max_num_seqs})"
        return row
    if cached_pool:
        fill_prefix_cache(engine)
    if watched:
        engine.core.watch_kv(float("inf"))
    token_id = engine.model.token_id
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=WARMUP_STEPS + steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        rng = random.Random(seed * 1_000_003 + i)
        engine.add_request(f"o{i}", [rng.randrange(1000, vocab) for _ in range(context)], params)
    scheduler = engine.scheduler
    budget, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, requests * context
    try:
        engine.step()  # every prefill at once, untimed
    finally:
        scheduler.max_num_batched_tokens = budget
    if scheduler.waiting or len(scheduler.running) != requests:
        raise RuntimeError(f"{len(scheduler.running)} of {requests} requests were admitted by the prefill step")
    for _ in range(WARMUP_STEPS):
        engine.step()
    preemptions = scheduler.num_preemptions
    tracker = RequestTracker()  # the server's per-step snapshot, as AsyncLLM publishes it
    loopback = ZmqLoopback()
    engine.core.step = loopback.wrap(engine.core)  # on the instance: the core's step, then the wire

    timers = Timers()
    timers.wrap(scheduler, "schedule", "schedule")
    timers.wrap(engine.runner, "execute", "execute")
    timers.wrap(engine.model, "forward", "forward")
    timers.wrap(engine.model, "compute_logits", "logits")
    timers.wrap(engine.core, "sampler", "sampler")
    timers.wrap(SamplingBatch, "build", "sample_build")
    timers.wrap(engine.core, "_commit", "commit")
    timers.wrap(engine.output_processor, "process", "front")
    timers.wrap(engine.core, "_record_usage", "usage")  # the peak check, made once the step is planned
    timers.wrap(engine.core, "core_stats", "core_stats")
    samples: list[tuple[float, dict[str, float]]] = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            outputs = engine.step()
            stepped = time.perf_counter()
            tracker.snapshot(loopback.last_stats)
            end = time.perf_counter()
            if len(outputs) != requests:
                raise RuntimeError(f"a timed step advanced {len(outputs)} of {requests} requests")
            t = timers.take()
            forward = t["forward"] + t["logits"]
            transport, view = loopback.take()
            part = {"schedule": t["schedule"], "prepare": t["execute"] - forward, "forward": forward,
                    "sample": t["sampler"] + t["sample_build"], "commit": t["commit"], "output": t["front"],
                    "transport": transport, "view": view,
                    "stats": t.get("usage", 0.0) + t["core_stats"] + (end - stepped)}
            part["other"] = (end - start) - sum(part.values())
            samples.append((end - start, part))
    finally:
        timers.restore()
        del engine.core.step
        loopback.close()

    running = list(scheduler.running)
    if scheduler.num_preemptions != preemptions or len(running) != requests:
        raise RuntimeError("the timed steps preempted a request: not a steady decode")
    wrong = {t for r in running for t in r.output_token_ids} - {token_id}
    if wrong:
        raise RuntimeError(f"the dry run sampled {sorted(wrong)[:5]}, not its fixed token {token_id}")
    for i in range(requests):
        engine.abort_request(f"o{i}")
    if watched:
        engine.core.watch_kv(0.0)
        engine.core.kv_view()  # the watch lapses: the pool records nothing again
    if kv.pool.num_free != kv.pool.num_blocks:
        raise RuntimeError(f"{kv.pool.num_used} blocks still used after every request ended")
    row.parts_ms = {p: statistics.median(s[p] for _, s in samples) * 1e3 for p in PARTS}
    row.total_ms = statistics.median(total for total, _ in samples) * 1e3
    row.core_ms = statistics.median(total - part["output"] for total, part in samples) * 1e3
    row.mean_total_ms = statistics.fmean(total for total, _ in samples) * 1e3
    return row


POOL_STATES = {"fresh": {}, "cached": {"cached_pool": True}, "watched": {"watched": True}}


def run_overhead_bench(requests=(1, 64, 256), contexts=(512, 4096), pools=(10_000, 1_000_000), steps: int = 50,
                       pool_states=("fresh", "cached"), threads: int | None = 1, tokenizer=None,
                       model_config: ModelConfig | None = None, log=print, **engine_kwargs) -> list[OverheadRow]:
    """Every (pool state, pool, context, requests) scenario, each on a fresh dry-run engine.

    pool_states: "fresh" (a new engine: only the running requests' blocks are cached), "cached" (every
    free block first holds a cached prefix: `fill_prefix_cache`) and/or "watched" (fresh, with the
    live KV view on throughout).
    threads: torch's intra-op threads while it runs (None: leave as is). 1 by default: the step's
    tensors are tiny, and on a machine whose other cores are busy a 2-thread op waits for a
    scheduler slice (about 8 ms per op on a shared 2-core VM), which measures the neighbours."""
    from pagedserve.models.loader import load_config, load_tokenizer

    model_config = model_config or load_config()
    tokenizer = tokenizer or load_tokenizer()
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    try:
        # Pool sizes innermost, so that the cells compared for pool independence run back to back
        # (a neighbour's load on a shared machine then affects both alike); listed sorted.
        for state in pool_states:
            for context in contexts:
                for n in requests:
                    for pool in pools:
                        if blocks_needed(n, context, steps) > pool:
                            row = OverheadRow(n, context, pool, steps, blocks_needed(n, context, steps),
                                              **POOL_STATES[state])
                            row.skipped = f"needs {row.blocks_needed:,} blocks"
                        else:
                            engine = build_dry_engine(pool, tokenizer, model_config, **engine_kwargs)
                            row = run_scenario(engine, n, context, steps, **POOL_STATES[state])
                            del engine
                        rows.append(row)
                        log(f"  {state} pool of {pool:,}, {n} requests, context {context}: "
                            + (f"n/a ({row.skipped})" if row.skipped else f"{row.total_ms:.2f} ms/step"))
    finally:
        torch.set_num_threads(before)
    order = {(state, pool, context, n): i for i, (state, pool, context, n) in enumerate(
        (s, p, c, n) for s in pool_states for p in pools for c in contexts for n in requests)}
    return sorted(rows, key=lambda r: order[(_state(r), r.pool_blocks, r.context, r.requests)])


def _state(row: OverheadRow) -> str:
    return "watched" if row.watched else "cached" if row.cached_pool else "fresh"


def check_targets(rows: list[OverheadRow]) -> list[tuple[str, bool | None, str]]:
    """The three overhead targets: (target, holds (None: nothing to judge), the figures)."""
    ran = {(_state(r), r.requests, r.context, r.pool_blocks): r.total_ms for r in rows if not r.skipped}
    results = []

    at256 = {k: v for k, v in ran.items() if k[1] == 256}
    results.append(("at 256 running decodes, < 2 ms per step", all(v < 2.0 for v in at256.values()) if at256 else None,
                    ", ".join(f"{s} pool {p:,} ctx {c}: {v:.2f} ms" for (s, _, c, p), v in sorted(at256.items()))))

    pools = sorted({k[3] for k in ran})
    pairs = []
    if len(pools) > 1:
        small, large = pools[0], pools[-1]
        pairs = [(s, n, c, ran[(s, n, c, small)], ran[(s, n, c, large)]) for (s, n, c, p) in sorted(ran)
                 if p == small and (s, n, c, large) in ran]
    results.append((f"pool-independent: {pools[-1]:,} blocks within 10% of {pools[0]:,}" if len(pools) > 1
                    else "pool-independent", all(b <= 1.1 * a for *_, a, b in pairs) if pairs else None,
                    ", ".join(f"{s} {n} req ctx {c}: {b / a:.2f}x" for s, n, c, a, b in pairs)))

    growth = []
    for s, c, p in sorted({(k[0], k[2], k[3]) for k in ran}):
        counts = sorted(k[1] for k in ran if (k[0], k[2], k[3]) == (s, c, p))
        for a, b in zip(counts, counts[1:]):
            growth.append((s, c, p, a, b, ran[(s, b, c, p)] / ran[(s, a, c, p)]))
    results.append(("at most linear in the running count (time ratio <= 1.1 x request ratio)",
                    all(g <= 1.1 * b / a for *_, a, b, g in growth) if growth else None,
                    ", ".join(f"{s} pool {p:,} ctx {c} {a}->{b} req: {g:.1f}x" for s, c, p, a, b, g in growth)))
    return results


def format_table(rows: list[OverheadRow], threads: int | None = 1) -> str:
    steps = max((r.steps for r in rows), default=0)
    lines = [f"Host time per decode step, dry-run model (forward is a no-op), block size 16, torch threads: "
             f"{threads or torch.get_num_threads()}; median of {steps} timed steps (mean total in the last column; "
             "core = total - output, the core's own time when the front runs in the API process). "
             "Pool \"fresh\": a new engine; \"cached\": every free block held a cached prefix first; "
             "\"watched\": fresh, with a live KV view (dashboard) on.", "",
             "| pool | pool blocks | requests | context | " + " | ".join(f"{p} ms" for p in PARTS)
             + " | total ms | core ms | mean total ms |",
             "|---|" + "---:|" * (6 + len(PARTS))]
    for r in rows:
        head = f"| {_state(r)} | {r.pool_blocks:,} | {r.requests} | {r.context:,} |"
        if r.skipped:
            lines.append(head + f" n/a: {r.skipped}, more than the pool |" + " |" * (len(PARTS) + 2))
        else:
            lines.append(head + "".join(f" {r.parts_ms[p]:.3f} |" for p in PARTS)
                         + f" **{r.total_ms:.3f}** | {r.core_ms:.3f} | {r.mean_total_ms:.3f} |")
    lines += ["", "Targets:"]
    for target, holds, figures in check_targets(rows):
        verdict = "n/a" if holds is None else "holds" if holds else "does NOT hold"
        lines.append(f"- {target}: **{verdict}** ({figures})")
    return "\n".join(lines)


def plot(rows: list[OverheadRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for state, context, pool in sorted({(_state(r), r.context, r.pool_blocks) for r in rows}):
        series = sorted((r.requests, r.total_ms) for r in rows
                        if (_state(r), r.context, r.pool_blocks) == (state, context, pool) and not r.skipped)
        if series:
            ax.plot(*zip(*series), marker="o", linestyle={"fresh": "-", "cached": "--", "watched": ":"}[state],
                    label=f"{state} pool of {pool:,} blocks, context {context:,}")
    ax.axhline(2.0, color="gray", linestyle="--", linewidth=1, label="target: 2 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("running requests (steady decode)")
    ax.set_ylabel("host ms per step (median)")
    ax.set_title("Engine overhead per step, dry-run model")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(rows: list[OverheadRow], threads: int | None = 1) -> dict:
    return {"threads": threads, "parts": list(PARTS), "warmup_steps": WARMUP_STEPS, "rows": [asdict(r) for r in rows],
            "targets": [{"target": t, "holds": h, "figures": f} for t, h, f in check_targets(rows)]}
