"""Structured output (guided decoding) with xgrammar: grammars compiled once, one matcher per sample.

A request's `StructuredOutputsParams` compiles (cached by the compiler: requests with the same
schema share one compiled grammar) into a grammar over the tokenizer's vocabulary. Each sample
gets its own `GrammarMatcher`, kept on its `Request`: it advances only when a sampled token is
committed, so it survives preemption (recomputation replays no tokens through it) and failed
steps (which commit nothing). Before sampling, the matchers of the constrained rows fill one
bitmask of allowed tokens; the sampler applies it to those rows only, so free rows in the same
batch pay nothing.

Grammars compile on a small thread pool, off the core's step loop: a request waits for its
grammar outside the scheduler (`RequestStatus.WAITING_FOR_GRAMMAR`) while the others step, and
fails with a ParameterError once its compile has taken `grammar_compile_timeout` seconds of CPU
(or it has waited MAX_WAIT_FACTOR times that: a busy machine's steps come first, so a limit on the
wall clock would fail sound schemas for the load). xgrammar's compile releases the GIL but takes a
core for seconds (a 1,000-property schema: about 2 s): the pool's threads run
at the lowest CPU priority (Linux: per thread), so that they never take a core from a step, whose
parallel kernels each wait for their slowest thread; a CPU engine pauses after its steps while
grammars compile (`engine_core.COMPILE_PAUSE`), and the compiles run then. xgrammar cannot
interrupt a compile: one past its time limit keeps its pool thread until it ends (its grammar
then joins the cache, so a retry is quick). `grammar_check`'s limits refuse the specs
that would hold a thread for minutes, and the pool's size bounds how many run at once. (A
compile in another process would not pay: a CompiledGrammar serializes in time and size that
grow faster than its compile, 39 s and 250 MB for 200 properties.)

The core deals in token ids, but the grammar compiler needs the vocabulary's strings: it takes
the front's tokenizer when the core runs in the front's process; in a process of its own, the
core loads the checkpoint's on a thread as soon as it is ready (`preload`), or at the latest on
the first constrained request.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.structured_output.grammar_check import (MAX_JSON_DEPTH, check_ebnf, check_regex, check_size, json_depth,
                                             parse_schema)
from pagedserve.errors import ParameterError
from pagedserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Whitespace characters allowed between two JSON tokens. Unbounded, a small model can emit
# newlines until max_tokens (the 135M default model does, after a prompt ending in "{"), and the
# output no longer parses; one keeps the model's choice of nothing, a space or a newline.
JSON_MAX_WHITESPACE = 1

# Threads that compile grammars. Two: a compile that overruns its time limit (it cannot be
# stopped) leaves one to the others; more would take cores from the model's steps.
COMPILE_THREADS = 2
# Their nice value: the highest (the lowest CPU priority), so that a step's threads come first. On
# Linux they also take the SCHED_IDLE policy: a step's thread that wakes takes the core from them at
# once, where at nice 19 alone it may wait out the compile's time slice (steps measured 3-10x longer).
COMPILE_NICE = 19

# xgrammar's errors start with a timestamp and a C++ source location; the rest is for the user.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@functools.cache
def load_xgrammar():
    """xgrammar, imported on first use: it takes about a second, and most engines never constrain."""
    import xgrammar

    return xgrammar


def lower_compile_thread_priority() -> None:
    """The calling thread at COMPILE_NICE and, on Linux, SCHED_IDLE (setpriority and
    sched_setscheduler on its thread id; elsewhere, or if refused, it keeps its priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _reason(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error).strip())


def _choice_grammar(choices: list[str]) -> str:
    # JSON's string escapes are xgrammar EBNF's too: any choice text is a valid literal.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag(text: str) -> str:
    """xgrammar's structural tag JSON text; vLLM's older form (`structures` and `triggers`) is
    rewritten as the tags it means: free text, each trigger opening one of the tags."""
    tag = json.loads(text)
    if not (isinstance(tag, dict) and "structures" in tag and "format" not in tag):
        return text
    try:
        tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
                 "end": s["end"]} for s in tag["structures"]]
        triggers = tag["triggers"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"each of structures needs begin, schema and end, and triggers are needed: {e!r}") from None
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def _check_tag_schemas(tag: Any) -> None:
    """The limits of grammar_check on a structural tag: its nesting, and each JSON schema in it."""
    if json_depth(tag) > MAX_JSON_DEPTH:
        raise ParameterError("structured_outputs", f"structured_outputs: the structural tag nests deeper than "
                             f"{MAX_JSON_DEPTH} levels")
    stack = [tag]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "json_schema" in item:
                parse_schema(item["json_schema"])
            stack.extend(value for key, value in item.items() if key != "json_schema")
        elif isinstance(item, list):
            stack.extend(item)


def check_grammar(spec: StructuredOutputsParams) -> None:
    """ParameterError (naming structured_outputs) unless the spec is within grammar_check's limits
    and xgrammar can build the grammar. Needs no vocabulary, so the front checks before a request
    reaches the core. Once a spec has passed, checking it again in the same process is free."""
    if getattr(spec, "_checked", False):
        return
    if spec.json is not None:
        parse_schema(spec.json)
    elif spec.regex is not None:
        check_regex(spec.regex, "regex")
    elif spec.grammar is not None:
        check_ebnf(spec.grammar)
    kind, text, _ = spec.key
    check_size(text, f"{kind} spec")
    xgr = load_xgrammar()
    try:
        if kind == "structural_tag":
            _check_tag_schemas(json.loads(_structural_tag(text)))
        if kind == "json":
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_grammar(spec.choice))
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(_structural_tag(text))
    except ParameterError:  # a limit of grammar_check: its message says which
        raise
    except Exception as e:  # xgrammar raises RuntimeError (C++) or ValueError
        raise ParameterError("structured_outputs", f"structured_outputs: the {kind} constraint cannot be compiled: {_reason(e)}") from None
    spec._checked = True  # not a field: a copy that crosses to the core's process is checked again there


# A request waits for its grammar at most this many times grammar_compile_timeout, however little
# CPU its compile got meanwhile: on a busy machine the steps come first (the compile threads run at
# the lowest priority), so a compile's CPU time, not the wall clock, is what the time limit bounds.
MAX_WAIT_FACTOR = 6


@dataclass
class GrammarJob:
    """A request's grammar being compiled, and the limits of its wait."""

    spec: StructuredOutputsParams
    timeout: float  # seconds of CPU time the compile may take
    submitted: float  # time.monotonic()
    future: Future | None = None  # of the CompiledGrammar
    # The compile thread's CPU clock and its reading when the compile started (set by that thread).
    clock: int | None = None
    clock_start: float = 0.0

    def start_clock(self) -> None:
        """Called on the compile thread as the compile starts."""
        try:
            clock = time.pthread_getcpuclockid(threading.get_ident())
            self.clock_start = time.clock_gettime(clock)
        except (AttributeError, OSError):  # no per-thread CPU clock here: the wall-clock limit alone
            return
        self.clock = clock

    def cpu_seconds(self) -> float | None:
        """The CPU time the compile has taken so far, or None before it starts (or without a clock)."""
        if self.clock is None:
            return None
        try:
            return time.clock_gettime(self.clock) - self.clock_start
        except OSError:  # the thread has ended
            return None

    def overdue(self, now: float) -> bool:
        """Whether the request stops waiting: its compile has used `timeout` seconds of CPU, or it has
        waited MAX_WAIT_FACTOR times that."""
        if self.future is not None and self.future.done():
            return False
        used = self.cpu_seconds()
        return now - self.submitted >= MAX_WAIT_FACTOR * self.timeout or (used is not None and used >= self.timeout)

    def timeout_error(self, now: float) -> ParameterError:
        used = self.cpu_seconds()
        if used is not None and used >= self.timeout:
            why = f"did not compile within {self.timeout:g} s of CPU time; simplify it"
        else:
            why = (f"did not compile within {self.timeout:g} s of CPU time before {now - self.submitted:.0f} s "
                   "had passed (the server is busy); retry, or simplify it")
        return ParameterError("structured_outputs", f"structured_outputs: the {self.spec.key[0]} constraint {why}")


class StructuredOutputManager:
    """Compiles grammars and builds each step's bitmask. `load_tokenizer` is called once, on the
    first constrained request; `stop_token_ids` end a grammar (the engine's EOS ids)."""

    def __init__(self, vocab_size: int, stop_token_ids: list[int], load_tokenizer: Callable[[], Any],
                 compile_timeout: float = 10.0) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._pool: ThreadPoolExecutor | None = None  # started with the first constrained request
        self.stop_token_ids = sorted(stop_token_ids)
        self._load_tokenizer = load_tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None  # reused from step to step: [rows, ceil(vocab / 32)] int32
        self._batch: xgr.BatchGrammarMatcher | None = None  # made with the first bitmask
        # Time spent filling bitmasks, over the steps that had constrained rows (`bench structured`).
        self.fill_seconds = 0.0
        self.fill_steps = 0

    def preload(self) -> None:
        """Build the compiler on a thread now, so that the first constrained request does not
        stall the step loop while the vocabulary loads (seconds, for a GGUF's tokenizer)."""
        threading.Thread(target=self._get_compiler, name="grammar-vocabulary", daemon=True).start()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                xgr = load_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # One thread: the engine's step loop is the only caller, and the cores are the model's.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=256 * 2**20)
            return self._compiler

    def submit(self, spec: StructuredOutputsParams) -> GrammarJob:
        """Start checking and compiling `spec` on the pool (`build`)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile",
                                            initializer=lower_compile_thread_priority)
        job = GrammarJob(spec, self.compile_timeout, time.monotonic())
        job.future = self._pool.submit(self._build_job, job)
        return job

    def _build_job(self, job: GrammarJob) -> xgr.CompiledGrammar:
        job.start_clock()
        return self.build(job.spec)

    def build(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The spec checked (again, in the core: it may come from a socket), compiled, and found to
        allow some output. ParameterError if not."""
        check_grammar(spec)
        compiled = self.compile(spec)
        xgr = load_xgrammar()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids).fill_next_token_bitmask(bitmask)
        if not bitmask.any():  # no token may start the output, and it may not be empty either
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: the {spec.key[0]} constraint allows no output at all")
        return compiled

    def matchers_for(self, compiled: xgr.CompiledGrammar, n: int) -> list[xgr.GrammarMatcher]:
        """One matcher per sample, each at the grammar's start."""
        matcher = load_xgrammar().GrammarMatcher
        return [matcher(compiled, override_stop_tokens=self.stop_token_ids) for _ in range(n)]

    def shutdown(self) -> None:
        """Stop taking compiles; one running goes on in its (daemon) thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar (the compiler caches it by its spec). ParameterError if it fails."""
        compiler = self._get_compiler()
        kind, text, compact = spec.key
        try:
            if kind in ("json", "json_object"):
                schema = text if kind == "json" else '{"type": "object"}'
                if compact:
                    return compiler.compile_json_schema(schema, any_whitespace=False)
                return compiler.compile_json_schema(schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.choice))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(_structural_tag(text))
            return compiler.compile_grammar(text)
        except Exception as e:
            raise ParameterError("structured_outputs",
                                 f"structured_outputs: the {kind} constraint cannot be compiled: {_reason(e)}") from None

    def matchers(self, spec: StructuredOutputsParams, n: int) -> list[xgr.GrammarMatcher]:
        """One matcher per sample, each at the grammar's start, compiled on the caller's thread."""
        return self.matchers_for(self.build(spec), n)

    def bitmask(self, matchers: list[xgr.GrammarMatcher | None], device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, their bitmasks) for the rows with a matcher, or None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        start = time.perf_counter()
        xgr = load_xgrammar()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = xgr.allocate_token_bitmask(max(len(rows), 8), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask)
        result = torch.tensor(rows, dtype=torch.long, device=device), bitmask.to(device, copy=True)
        self.fill_seconds += time.perf_counter() - start
        self.fill_steps += 1
        return result

    def draft_bitmask(self, matchers: list[xgr.GrammarMatcher | None], drafts: list[list[int]],
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A speculative step's (rows, bitmasks): request i has len(drafts[i]) + 1 rows, one after
        another; row j allows what its grammar allows after drafts[i][:j]. Each matcher advances
        through the drafts to fill its rows and is rolled back: it ends where it started. Rows after
        a draft the grammar refuses repeat the last mask (the verifier never reaches them)."""
        if all(m is None for m in matchers):
            return None
        start = time.perf_counter()
        xgr = load_xgrammar()
        total = sum(len(d) + 1 for d in drafts)
        bitmask = xgr.allocate_token_bitmask(total, self.vocab_size)
        rows: list[int] = []
        row = 0
        for matcher, request_drafts in zip(matchers, drafts):
            if matcher is None:
                row += len(request_drafts) + 1
                continue
            accepted = 0
            try:
                for j in range(len(request_drafts) + 1):
                    if accepted == j and (j == 0 or not matcher.is_terminated()):
                        matcher.fill_next_token_bitmask(bitmask, row + j)
                        if j < len(request_drafts) and matcher.accept_token(request_drafts[j]):
                            accepted += 1
                    else:
                        bitmask[row + j] = bitmask[row + j - 1]
                    rows.append(row + j)
            finally:
                if accepted:
                    matcher.rollback(accepted)
            row += len(request_drafts) + 1
        result = (torch.tensor(rows, dtype=torch.long, device=device),
                  bitmask[torch.tensor(rows)].to(device, copy=True))
        self.fill_seconds += time.perf_counter() - start
        self.fill_steps += 1
        return result


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token a row's bitmask disallows at -inf, out of place: the caller's
    logits (the raw ones, whose logprobs are returned) stay as they are. Bit j of int32 word w
    allows token 32 * w + j. Unpacked with torch in one pass: on the CPU, 3x faster than
    xgrammar's own kernel on a clone (64 rows of a 49k vocabulary: 3.5 against 10 ms)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    if len(rows) == logits.shape[0]:  # every row constrained (rows are in order)
        return logits.masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), logits.index_select(0, rows).masked_fill(~allowed, float("-inf")))
