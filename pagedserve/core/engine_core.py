"""EngineCore: the scheduler, the KV manager, an executor and the sampler. Token ids in, token ids out.

One step: the scheduler plans, the executor runs the forward pass, the sampler picks a token for
every request whose known tokens are all computed, and the core appends it and applies the stop
conditions it can judge on token ids (EOS, stop tokens, lengths). A request that asks for prompt
logprobs also has its prompt positions scored, chunk by chunk; they are sent once, with its first
token. Text is the front's business (`output_processor.py`): detokenization, stop strings,
logprob text, output assembly. The front tells the core when a stop string ended a sample
(`stop_samples`).

The core runs in the caller's process (`LLM`, tests, the in-thread server) or in a process of
its own (`core_process.py`); it never sees text or a socket. Its one use of a tokenizer is the
vocabulary that grammars compile against (`structured_output.py`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.kv_view import KVView, KVViewer
from pagedserve.core.messages import CoreStats, EngineCoreRequest, SampleOutput, SpecDecodeStats, TokenLogprobs
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sampler import Sampler, SamplerOutput, SamplingBatch, TokenCounts, gather_logprobs
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.core.speculation import Speculation
from pagedserve.executor import make_executor
from pagedserve.executor.base import Executor, ExecutorFailed
from pagedserve.kv import KVCacheManager, KVCacheStats
from pagedserve.kv.groups import KVLayout
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.weights import adapter_identity
from pagedserve.models.loader import load_tokenizer
from pagedserve.models.sharding import kv_heads_per_rank
from pagedserve.ops import native
from pagedserve.sampling_params import ParameterError
from pagedserve.structured_output.manager import GrammarJob, StructuredOutputManager

logger = logging.getLogger(__name__)

# Blocks copied to the KV tier at a time at shutdown: well under the tier's pending-memory bound.
SHUTDOWN_STORE_BATCH = 64
# How long writing the pool's cached blocks to the KV tier may take at shutdown or exit; what is
# not written by then is lost (a hung filesystem must not hang the exit).
SAVE_SECONDS = 10.0
# How long an idle step waits for a grammar to compile before it returns (to read commands).
GRAMMAR_POLL_SECONDS = 0.02
# While a request waits for its grammar, a CPU engine pauses after each step for this fraction of
# the step's time, and the compiles (at the lowest priority) run in the pauses: next to a step they
# would share its cores, and each of its parallel kernels would wait for the thread that lost its
# core (steps up to 100x their time). The neighbours' steps take twice as long meanwhile, evenly.
COMPILE_PAUSE = 1.0


@dataclass
class _StepResult:
    """What a step computed, before it is applied."""

    samplers: list[Request]  # the requests that take a token this step
    sampled: SamplerOutput | None  # one entry per token taken, in samplers' order (None when there are none)
    # Per sampler, the tokens it takes: one, or with speculation the drafts kept and one more.
    tokens: list[list[int]] = field(default_factory=list)
    drafts: list[list[int]] | None = None  # per sampler, the drafts it verified (a speculative step)
    # The prompt positions this step scored, per request that asked: entries to append.
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]] = field(default_factory=list)


def find_culprits(rows: list[int], error: Exception,
                  fails: Callable[[list[int]], Exception | None]) -> dict[int, Exception]:
    """`rows` fail together with `error`; `fails(part)` runs a part alone and returns its error.
    Bisect down to the rows that fail alone, each with its error. Rows that fail only together
    (no smaller part fails) are all returned: the fault cannot be pinned on fewer."""
    if len(rows) == 1:
        return {rows[0]: error}
    half = len(rows) // 2
    culprits: dict[int, Exception] = {}
    for part in (rows[:half], rows[half:]):
        part_error = fails(part)
        if part_error is not None:
            culprits.update(find_culprits(part, part_error, fails))
    return culprits or dict.fromkeys(rows, error)


# The text of the errors torch and Triton raise for a failed CUDA call (older torch has no
# AcceleratorError and raises a plain RuntimeError).
_DEVICE_ERROR_TEXTS = ("CUDA error", "Triton Error [CUDA]")


def is_device_error(error: BaseException) -> bool:
    """Whether `error` came from the device (an illegal memory access, a device-side assert)
    rather than from host code. Such an error leaves the CUDA context unusable: every later call
    fails too, so retrying the step or bisecting it cannot pin it on a request. Running out of
    memory is not one: the device stays usable."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _DEVICE_ERROR_TEXTS)


def validate_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """ValueError unless the prompt is 1..max_model_len token ids of the vocabulary."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(f"the prompt is {len(token_ids)} tokens long, longer than max_model_len ({max_model_len})")
    bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab_size}")


def kv_pool_line(num_blocks: int, block_size: int, bytes_per_block_token: int, layout: KVLayout, max_model_len: int,
                 chunk: int, per_rank: bool = False, masked: bool = False) -> str:
    """The pool in one line for the startup log: its blocks and bytes, its KV cache groups, and the
    blocks the longest request holds at once (computed `chunk` tokens a step). masked: the model has
    sliding windows, kept as one full group (disable_hybrid_kv_cache)."""
    size = _in_units(num_blocks * block_size * bytes_per_block_token)
    return (f"KV pool: {num_blocks:,} blocks of {block_size} tokens ({size}{' per rank' if per_rank else ''}): "
            f"{layout.summary()}{' (sliding windows only masked: disable_hybrid_kv_cache)' if masked else ''}; "
            f"a request of max_model_len ({max_model_len:,}) holds "
            f"{layout.blocks_per_request(max_model_len, block_size, chunk):,} blocks")


def _in_units(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.1f} {unit}"
    return f"{num_bytes} B"


@dataclass
class EngineStats:
    """Running totals since the engine started."""

    num_requests: int = 0  # finished user requests
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    busy_seconds: float = 0.0  # time spent inside step()
    peak_used_blocks: int = 0
    kv_at_peak: KVCacheStats | None = None  # the pool when it was fullest

    @property
    def generation_throughput(self) -> float:
        return self.num_generation_tokens / self.busy_seconds if self.busy_seconds else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, *, eos_token_ids: Iterable[int] = (), model=None,
                 executor: Executor | None = None, tokenizer=None) -> None:
        """`model` = (module, ModelConfig) may be passed in to share loaded weights. The EOS ids
        are the model's plus `eos_token_ids` (the tokenizer's, which the front knows). The
        `tokenizer`'s vocabulary compiles grammars; without one, the first constrained request
        loads the checkpoint's."""
        self.config = config
        if config.device == "cpu":
            native.build_ahead()  # a cold start compiles the C kernels while the weights load
        self.executor = executor or make_executor(config, model)
        self.model_config = model_config = self.executor.model_config
        model_max_len = model_config.max_position_embeddings
        config.check_max_model_len(model_max_len)  # before a profiling pass runs that long a prompt
        measured = self.executor.measure_kv_budget(config.max_model_len or model_max_len) \
            if config.measures_kv_budget else None
        # Under tensor parallelism a block holds each rank's share of the KV heads.
        kv_heads = kv_heads_per_rank(model_config.num_kv_heads, config.tensor_parallel_size)
        layout = model_config.kv_layout(config.disable_hybrid_kv_cache)
        kv_bytes_per_token = model_config.kv_bytes_per_block_token(config.kv_torch_dtype, kv_heads,
                                                                   config.disable_hybrid_kv_cache)
        draft = self.executor.draft_proposer()
        if draft is not None:  # a draft model's K/V shares the pool's blocks: each block holds both
            kv_bytes_per_token += draft.kv_bytes_per_token(config.kv_torch_dtype)
        self.num_blocks, self.max_model_len = config.resolve_kv_pool(kv_bytes_per_token, model_max_len, measured,
                                                                     layout)
        self.executor.initialize_kv_cache(self.num_blocks, self.max_model_len)
        logger.info("%s", kv_pool_line(self.num_blocks, config.block_size, kv_bytes_per_token, layout,
                                       self.max_model_len, config.max_num_batched_tokens,
                                       config.tensor_parallel_size > 1,
                                       masked=config.disable_hybrid_kv_cache and bool(model_config.sliding_windows)))
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                 tier=self.executor.kv_tier(), offload_policy=config.kv_offload_policy,
                                 offload_min_hits=config.kv_offload_min_hits, windows=layout.windows)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preemption_mode, config.max_loras if config.enable_lora else None)
        self.kv_viewer = KVViewer(self.kv, self.scheduler)
        self.sampler = Sampler(seed=config.seed)
        self.token_counts = TokenCounts(model_config.vocab_size, config.device)
        self.eos_token_ids = set(model_config.eos_token_ids) | set(eos_token_ids)
        self.structured_output = StructuredOutputManager(
            model_config.vocab_size, self.eos_token_ids,
            (lambda: tokenizer) if tokenizer is not None else (lambda: load_tokenizer(config.model)),
            config.grammar_compile_timeout)
        self._grammar_jobs: dict[str, GrammarJob] = {}  # user request id -> its grammar, compiling
        self._recent_steps: deque[float] = deque(maxlen=9)  # seconds of the last steps that paused for compiles
        self._adapter_jobs: dict[str, Future] = {}  # user request id -> its LoRA adapter, loading
        self._adapters: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter it stands for
        self.stats = EngineStats()
        self._groups: dict[str, list[Request]] = {}  # user request id -> its samples
        self._pending_forks: dict[Hashable, list[Request]] = {}  # first sample -> samples to fork
        self._device_failure: str | None = None  # set once the device failed: no step runs after it
        self.speculation = None
        if config.speculative_config is not None:
            self.speculation = Speculation(config.speculative_config, draft)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def warm_up(self) -> None:
        """Run one step of the whole token budget on dummy prompts, before the first request. The
        first step of a size pays once for what later ones reuse (memory for its activations, at
        least): a fresh server's first 2,048-token step took 2.54 s, later ones 1.3-1.5 s. A server
        runs this before it reports ready, so that its first burst does not pay; `LLM()` does not,
        to keep its start short. Skipped with calculate_kv_scales: the first real step sets the
        fp8 scales."""
        if self.stats.num_steps or self._groups:  # free blocks may hold cached prefixes by now
            raise RuntimeError("warm_up writes into the pool's first blocks: it must run before the first request")
        if self.config.calculate_kv_scales:
            return
        num_tokens = min(self.config.max_num_batched_tokens, self.num_blocks * self.config.block_size)
        start = time.perf_counter()
        self.executor.warm_up(num_tokens, self.max_model_len)
        logger.info("warm-up step of %d tokens took %.2f s", num_tokens, time.perf_counter() - start)

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; it joins the running batch at the next step. Bad input: ValueError
        (the front validates first; the core checks again, as it may be reached by a socket)."""
        request_id, token_ids, params = request.request_id, request.prompt_token_ids, request.params
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.verify_for_engine(self.vocab_size, self.scheduler.max_num_seqs, grammar=False)
        self.validate_prompt(token_ids)
        adapter, cache_key = request.lora_request, None
        if adapter is not None:
            self._register_adapter(adapter)
            cache_key = ("lora", adapter_identity(adapter.lora_path))
        samples = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                # Each sample its own stream; the first uses the seed as given.
                generator = torch.Generator(self.config.device).manual_seed((params.seed + i * 0x9E3779B1) % 2**63)
            samples.append(Request((request_id, i), token_ids, params, group_id=request_id, sample_index=i,
                                   generator=generator, lora_request=adapter, cache_key=cache_key))
        self._groups[request_id] = samples
        if len(samples) > 1:
            self._pending_forks[samples[0].request_id] = samples[1:]
        if adapter is not None:
            future = self.executor.prefetch_lora(adapter)
            if not future.done():  # loaded off the step loop: the request joins once its adapter is in memory
                self._adapter_jobs[request_id] = future
                for sample in samples:
                    sample.status = RequestStatus.WAITING_FOR_ADAPTER
                return
            if future.exception() is not None:
                del self._groups[request_id]
                self._pending_forks.pop(samples[0].request_id, None)
                raise ValueError(str(future.exception()))
        self._admit(samples)

    def _admit(self, samples: list[Request]) -> None:
        """Send a new request to the scheduler, or first to its grammar's compilation."""
        params, request_id = samples[0].sampling_params, samples[0].group_id
        if params.structured_outputs is None:
            self.scheduler.add(samples[0])
            return
        # Checked and compiled off the step loop: the request joins the scheduler once it has its grammar.
        self._grammar_jobs[request_id] = self.structured_output.submit(params.structured_outputs)
        for sample in samples:
            sample.status = RequestStatus.WAITING_FOR_GRAMMAR

    def validate_prompt(self, token_ids: list[int]) -> None:
        validate_prompt(token_ids, self.max_model_len, self.vocab_size)

    def _register_adapter(self, adapter: LoRARequest) -> None:
        """Note which adapter `adapter.lora_int_id` stands for. An id may be given to another
        adapter only once no request in flight uses the first: the model's slot and the host
        cache are keyed by it."""
        if not self.config.enable_lora:
            raise ValueError(f"this engine serves no LoRA adapters (request for {adapter.lora_name!r}): "
                             "start it with enable_lora=True")
        known = self._adapters.get(adapter.lora_int_id)
        if known is None or known == adapter:
            self._adapters[adapter.lora_int_id] = adapter
            return
        if any(s[0].lora_request == known for s in self._groups.values()):
            raise ValueError(f"lora_int_id {adapter.lora_int_id} stands for adapter {known.lora_name!r} "
                             f"({known.lora_path}) while its requests run; give {adapter.lora_name!r} another id")
        self.remove_lora(adapter.lora_int_id)
        self._adapters[adapter.lora_int_id] = adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: its weights leave host memory and its slot. Requests in flight that use
        it keep running with it (it is loaded again for them if need be). False if it was unknown."""
        adapter = self._adapters.pop(lora_int_id, None)
        if adapter is None:
            return False
        if not any(s[0].lora_request == adapter for s in self._groups.values()):
            self.scheduler.lora_slots.forget(lora_int_id)
            self.executor.remove_lora(lora_int_id)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Stop requests at once, whatever their state, and free everything they hold."""
        for request_id in request_ids:
            self._end_group(self._groups.pop(request_id, []), RequestStatus.FINISHED_ABORTED)

    def stop_samples(self, samples: Iterable[tuple[str, int]]) -> None:
        """The front found a stop string in these samples: end them as stopped. Samples that
        have ended meanwhile (by length, say, when the core runs ahead in its own process) are
        left as they are."""
        for request_id, index in samples:
            group = self._groups.get(request_id)
            if group is None or group[index].is_finished:
                continue
            self._pending_forks.pop(group[index].request_id, None)
            self.scheduler.finish(group[index], RequestStatus.FINISHED_STOPPED)
            self._end_if_done(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[SampleOutput]:
        """Run one step; return what every sample that took a token, or failed, got.

        A step that raises is contained: see `_contain_fault`. One that is interrupted (Ctrl-C)
        before it commits is undone, then the interrupt goes on. A device error is not contained:
        it raises ExecutorFailed, now and at every later step."""
        if self._device_failure is not None:
            raise ExecutorFailed(self._device_failure)
        start = time.perf_counter()
        resolved = self._resolve_adapters() if self._adapter_jobs else []
        resolved += self._resolve_grammars() if self._grammar_jobs else []
        plan = self.scheduler.schedule()
        if not plan.requests:
            jobs = [job.future for job in self._grammar_jobs.values()] + list(self._adapter_jobs.values()) \
                + self.scheduler.tier_reads()
            if jobs and not resolved:  # nothing else to do: wait a little rather than spin
                wait_for_futures(jobs, GRAMMAR_POLL_SECONDS, FIRST_COMPLETED)
            return resolved
        self._record_usage()
        rows, samplers = self._samplers(plan)
        # The generators this step may draw from, to replay it exactly after a fault.
        states = [(r.generator, r.generator.get_state()) for r in samplers
                  if r.generator is not None and not r.sampling_params.is_greedy]
        try:
            try:
                result = self._compute(plan, rows, samplers)
            except ExecutorFailed:
                raise  # no step can run: nothing to contain
            except Exception as error:
                result, failed = self._contain_fault(plan, states, error)
        except BaseException:
            if not plan.undone:  # its prefix blocks must not stay findable, nor its slots reserved
                self._restore_generators(states)
                self.scheduler.undo_step(plan)
            raise
        if result is None:
            outputs = [output for request, message in failed for output in self._fail(request, message)]
        else:
            outputs = self._commit(plan, result)
        self.stats.num_steps += 1
        self.stats.busy_seconds += time.perf_counter() - start
        if self._grammar_jobs and self.config.device == "cpu":
            self._pause_for_compiles(time.perf_counter() - start)
        return resolved + outputs

    def _pause_for_compiles(self, step_seconds: float) -> None:
        """Leave the cores to the grammars being compiled for COMPILE_PAUSE x the step's time (at
        most the recent steps' median: a step slowed by the machine is not made twice as long), or
        until one of them is done."""
        self._recent_steps.append(step_seconds)
        compiling = [job.future for job in self._grammar_jobs.values() if not job.future.done()]
        if compiling:
            typical = sorted(self._recent_steps)[len(self._recent_steps) // 2]
            wait_for_futures(compiling, COMPILE_PAUSE * min(step_seconds, typical), FIRST_COMPLETED)

    def _resolve_grammars(self) -> list[SampleOutput]:
        """Schedule the requests whose grammars have compiled; fail those whose grammars failed or
        are late (their error outputs)."""
        outputs = []
        now = time.monotonic()
        for request_id, job in list(self._grammar_jobs.items()):
            if not job.future.done() and not job.overdue(now):
                continue
            samples = self._groups[request_id]
            del self._grammar_jobs[request_id]
            try:
                if not job.future.done():
                    job.future.cancel()  # a compile that has not started yet never will
                    raise job.timeout_error(now)
                grammars = self.structured_output.matchers_for(job.future.result(), len(samples))
            except ParameterError as e:
                outputs += self._fail(samples[0], str(e), e.param)
                continue
            except Exception as e:
                logger.exception("request %s: its grammar failed to compile", request_id)
                outputs += self._fail(samples[0], f"the engine failed to compile this request's grammar: {e!r}")
                continue
            for sample, grammar in zip(samples, grammars):
                sample.grammar = grammar
                sample.status = RequestStatus.WAITING
            self.scheduler.add(samples[0])
        return outputs

    def _resolve_adapters(self) -> list[SampleOutput]:
        """Admit the requests whose adapters have loaded; fail those whose adapters failed to."""
        outputs = []
        for request_id, future in list(self._adapter_jobs.items()):
            if not future.done():
                continue
            del self._adapter_jobs[request_id]
            samples = self._groups[request_id]
            if future.exception() is not None:
                outputs += self._fail(samples[0], str(future.exception()), "model")
                continue
            for sample in samples:
                sample.status = RequestStatus.WAITING
            self._admit(samples)
        return outputs

    def _samplers(self, plan: SchedulerOutput) -> tuple[list[int], list[Request]]:
        """Who samples this step, and from which plan row: every request whose last known token
        runs now, plus the samples that fork from it when it is a first sample producing its
        first token."""
        rows, samplers = [], []
        for i, (request, n) in enumerate(zip(plan.requests, plan.num_new_tokens)):
            if request.num_computed_tokens + n < request.num_tokens:
                continue  # a prefill chunk with more to come
            for sampler in (request, *self._pending_forks.get(request.request_id, ())):
                rows.append(i)
                samplers.append(sampler)
        return rows, samplers

    def _compute(self, plan: SchedulerOutput, rows: list[int], samplers: list[Request]) -> _StepResult:
        """The part of a step that can fail: the forward pass and sampling. It changes no
        request: only the K/V slots the plan reserved and the draws of the rows' generators. A
        device error raises ExecutorFailed (with it as the cause): no later step can run."""
        try:
            return self._forward_and_sample(plan, rows, samplers)
        except Exception as error:
            if not is_device_error(error):
                raise
            first_line = (str(error).splitlines() or [repr(error)])[0]
            self._device_failure = f"the device failed ({first_line}); the engine can run no more steps"
            logger.error("%s", self._device_failure, exc_info=(type(error), error, error.__traceback__))
            raise ExecutorFailed(self._device_failure) from error

    def _forward_and_sample(self, plan: SchedulerOutput, rows: list[int], samplers: list[Request]) -> _StepResult:
        spans = self._prompt_spans(plan)
        logits = self.executor.execute(plan, rows, spans)
        self.token_counts.forget(plan.freed)
        # The sampled rows' logits come first (with drafts, 1 + k rows per request), then the
        # prompt spans' (ModelRunner.execute).
        drafts = [plan.spec_token_ids[i] for i in rows]
        num_sampled = len(rows) + sum(len(d) for d in drafts)
        prompt_logprobs = self._score_prompts(plan, spans, logits[num_sampled:]) if spans else []
        logits = logits[:num_sampled]
        if not samplers:  # every request of the step is a prefill chunk with more to come
            return _StepResult(samplers, None, prompt_logprobs=prompt_logprobs)
        if plan.has_drafts:
            return self._verify(samplers, drafts, logits, prompt_logprobs)
        batch = SamplingBatch.build(
            [r.sampling_params for r in samplers], [r.prompt_token_ids for r in samplers],
            [r.output_token_ids for r in samplers], [r.generator for r in samplers], self.eos_token_ids,
            logits.device, self.token_counts, [r.request_id for r in samplers],
            self.structured_output.bitmask([r.grammar for r in samplers], logits.device))
        sampled = self.sampler(logits, batch)
        return _StepResult(samplers, sampled, [[t] for t in sampled.token_ids], prompt_logprobs=prompt_logprobs)

    def _verify(self, samplers: list[Request], drafts: list[list[int]], logits: torch.Tensor,
                prompt_logprobs: list) -> _StepResult:
        """Sample a speculative step: request i's 1 + k rows each see the request's output with the
        drafts before them, for everything that reads it (penalties, min_tokens, its grammar)."""
        params, prompts, outputs, generators = [], [], [], []
        for request, request_drafts in zip(samplers, drafts):
            for j in range(len(request_drafts) + 1):
                params.append(request.sampling_params)
                prompts.append(request.prompt_token_ids)
                outputs.append(request.output_token_ids + request_drafts[:j])
                generators.append(request.generator)
        # The penalties' counts are kept per request, not per draft position: padded here instead.
        batch = SamplingBatch.build(
            params, prompts, outputs, generators, self.eos_token_ids, logits.device,
            grammar_bitmask=self.structured_output.draft_bitmask([r.grammar for r in samplers], drafts,
                                                                 logits.device))
        tokens, sampled = self.sampler.verify(logits, batch, drafts, [r.generator for r in samplers])
        return _StepResult(samplers, sampled, tokens, drafts, prompt_logprobs)

    @staticmethod
    def _prompt_spans(plan: SchedulerOutput) -> list[tuple[int, int, int]]:
        """The scheduled tokens whose logits score prompt tokens this step, as (plan row, first of
        the row's tokens, count). The logits at position p score prompt token p + 1, so a prompt
        of P tokens has P - 1 entries; positions scored before a preemption are not scored again."""
        spans = []
        for i, (request, n) in enumerate(zip(plan.requests, plan.num_new_tokens)):
            scored = request.prompt_logprobs
            if scored is None:
                continue
            start = request.num_computed_tokens
            # Holds because such a request skips the prefix cache: no position goes unscored.
            assert start <= len(scored), f"prompt positions {len(scored)}..{start} of {request} have no logits"
            end = min(start + n, request.num_prompt_tokens - 1)
            if len(scored) < end:
                spans.append((i, len(scored) - start, end - len(scored)))
        return spans

    @staticmethod
    def _score_prompts(plan: SchedulerOutput, spans: list[tuple[int, int, int]],
                       logits: torch.Tensor) -> list[tuple[Request, list[TokenLogprobs]]]:
        """The prompt logprobs of the spans (`logits`: theirs, in order): raw log_softmax, as for
        sampled tokens."""
        targets: list[int] = []
        num_top: list[int | None] = []
        for row, first, count in spans:
            request = plan.requests[row]
            position = request.num_computed_tokens + first
            targets += request.prompt_token_ids[position + 1 : position + 1 + count]
            num_top += [request.sampling_params.prompt_logprobs] * count
        scored = gather_logprobs(logits, torch.tensor(targets, dtype=torch.long, device=logits.device), num_top)
        entries = [TokenLogprobs(lp, rank, top)
                   for lp, rank, top in zip(scored.logprobs, scored.ranks, scored.top_logprobs)]
        result, k = [], 0
        for row, _, count in spans:
            result.append((plan.requests[row], entries[k : k + count]))
            k += count
        return result

    def _commit(self, plan: SchedulerOutput, result: _StepResult) -> list[SampleOutput]:
        """Apply a computed step: the tokens are in the cache, forks start, tokens are appended."""
        self.scheduler.finish_step(plan)
        if self.kv.tier is not None and self.kv.write_through:
            self._write_through()
        for request, entries in result.prompt_logprobs:
            request.prompt_logprobs += entries
        for request in result.samplers:
            for child in self._pending_forks.pop(request.request_id, ()):
                self.scheduler.fork(request, child)
        outputs = []
        first = 0  # the sampler's entry of each request's first token
        for k, request in enumerate(result.samplers):
            tokens = result.tokens[k]
            first, entries = first + len(tokens), range(first, first + len(tokens))
            if request.is_finished:
                continue  # its group failed on an earlier row
            try:
                outputs.append(self._append_tokens(request, tokens, result.sampled, entries))
                if result.drafts and result.drafts[k]:
                    self.speculation.record(request, len(result.drafts[k]), len(tokens) - 1)
            except Exception as e:
                logger.exception("request %s failed while taking its token", request.group_id)
                outputs = [o for o in outputs if o.request_id != request.group_id]
                outputs += self._fail(request, f"the engine failed on this request: {e!r}")
        for group_id in dict.fromkeys(o.request_id for o in outputs if o.finish_reason is not None):
            self._end_if_done(group_id)
        if self.speculation is not None:
            for request in plan.requests:
                request.spec_token_ids = []  # run: the next ones are proposed from what it has now
            running = self.scheduler.running
            self.speculation.propose([r for r in running if r.num_computed_tokens == r.num_tokens - 1],
                                     self.max_model_len, len(running))
        return outputs

    def _write_through(self) -> None:
        """Copy the blocks this step filled to the KV tier now, while their K/V is surely theirs (a
        later step may reuse them). A failure costs only the tier's speed-up."""
        stores, _ = self.kv.take_transfers()
        if stores:
            try:
                self.executor.transfer_blocks(stores, [])
            except Exception:
                logger.exception("copying %d blocks to the KV tier failed; they are not kept", len(stores))

    def _append_tokens(self, request: Request, tokens: list[int], sampled: SamplerOutput,
                       entries: range) -> SampleOutput:
        """Append the step's tokens to the request, in order, up to the first that ends it (the
        rest are dropped); a speculative step that kept fewer tokens than it computed rewinds it."""
        params = request.sampling_params
        prompt_logprobs = None
        if request.prompt_logprobs is not None:
            # Its first token: the prompt is computed and scored. Sent once; a recomputation
            # after a preemption scores nothing again.
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        first_output = not request.output_token_ids
        status, stop_reason, taken = None, None, []
        for token in tokens:
            request.append_token(token)
            taken.append(token)
            status, stop_reason = self._stop_condition(request, token)
            if status is not None:
                break
        logprobs = None
        if params.logprobs is not None:
            logprobs = [TokenLogprobs(sampled.logprobs[j], sampled.ranks[j], sampled.top_logprobs[j] or [])
                        for j in entries[: len(taken)]]
        if status is not None:
            self.scheduler.finish(request, status)
        elif request.num_computed_tokens >= request.num_tokens:
            # Drafts were rejected: their K/V is not the request's. Its last token is computed next step.
            self.scheduler.rewind(request, request.num_tokens - 1)
        return SampleOutput(request.group_id, request.sample_index, taken, logprobs,
                            status.value if status else None, stop_reason, request.num_cached_tokens or 0,
                            prompt_logprobs=prompt_logprobs,
                            scheduled_time=request.scheduled_time if first_output else None)

    def _stop_condition(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Whether `token`, just appended, ends the request: (its status, the stop token) or (None,
        None). Conditions on token ids, in vLLM's order; none apply before min_tokens, except the
        length. Stop strings are the front's (it reads text)."""
        params = request.sampling_params
        num_out = len(request.output_token_ids)
        if request.grammar is not None and not self._advance_grammar(request, token):
            return RequestStatus.FINISHED_STOPPED, None  # the grammar is complete: nothing more may follow
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if params.stop_token_ids and token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if num_out >= max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> bool:
        """Feed the sampled token to the request's grammar; False once the grammar has ended (it
        took a stop token, or it admits no token at all: min_tokens blocked the stop tokens of a
        complete grammar, say)."""
        grammar = request.grammar
        if not grammar.accept_token(token):
            logger.warning("request %s: its grammar refused token %d; ending it", request.group_id, token)
            return False
        return not grammar.is_terminated()

    # ---- faults --------------------------------------------------------------------------

    def _contain_fault(self, plan: SchedulerOutput, states: list[tuple[torch.Generator, torch.Tensor]],
                       error: Exception) -> tuple[_StepResult | None, list[tuple[Request, str]]]:
        """A step raised. Run it once more (a transient fault passes, and its result is used);
        if it fails again, find the requests that make it fail by bisecting the plan, undo the
        step (every request in it is recomputed later, the prefix blocks it was to fill are
        forgotten) and fail only those requests. Returns (a result to commit, or None; the
        requests to fail with their messages)."""
        logger.warning("engine step failed (%r); running it again to find the request at fault", error)
        # The first try copied the blocks going to the KV tier, or lost them: once its forward pass
        # has run, a block evicted in this plan may hold another request's K/V, so no retry copies it.
        plan.kv_stores = []
        self._restore_generators(states)
        try:
            return self._compute(plan, *self._samplers(plan)), []
        except ExecutorFailed:
            raise
        except Exception as again:
            error = again

        def fails(rows: list[int]) -> Exception | None:
            part = plan.subset(rows)
            self._restore_generators(states)
            try:
                self._compute(part, *self._samplers(part))
            except ExecutorFailed:
                raise
            except Exception as e:
                return e
            return None

        culprits = find_culprits(list(range(len(plan.requests))), error, fails)
        self._restore_generators(states)
        self.scheduler.undo_step(plan)
        failed = []
        for i, e in culprits.items():
            request = plan.requests[i]
            logger.error("request %s makes the engine fail; failing it alone", request.group_id,
                         exc_info=(type(e), e, e.__traceback__))
            failed.append((request, f"the engine failed on this request: {e!r}"))
        return None, failed

    @staticmethod
    def _restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, state in states:
            generator.set_state(state)

    def _fail(self, request: Request, message: str, param: str | None = None) -> list[SampleOutput]:
        """End the request's whole group with an error: one output per sample, carrying `message`
        and, when the request's own field is at fault, `param` (none if the group has ended
        already: two of its samples were at fault)."""
        samples = self._groups.pop(request.group_id, None)
        if samples is None:
            return []
        self._end_group(samples, RequestStatus.FINISHED_ERROR)
        self._count_finished(samples)
        return [SampleOutput(r.group_id, r.sample_index, [], None, "error", None, r.num_cached_tokens or 0, message,
                             error_param=param)
                for r in samples]

    def fail_all(self, message: str) -> list[SampleOutput]:
        """End every request in flight with an error: their error outputs."""
        outputs = []
        for samples in list(self._groups.values()):
            outputs += self._fail(samples[0], message)
        return outputs

    def _end_group(self, samples: list[Request], status: RequestStatus) -> None:
        """End every sample of a group, whatever its state, and free what it holds."""
        job = self._grammar_jobs.pop(samples[0].group_id, None) if samples else None
        if job is not None:
            job.future.cancel()  # unless it is compiling already: then its result only joins the cache
        if samples:
            self._adapter_jobs.pop(samples[0].group_id, None)  # the load goes on: other requests may want it
        for request in samples:
            if request.status.unscheduled:
                request.status = status  # never scheduled: it holds nothing
            elif not request.is_finished:
                self.scheduler.finish(request, status)
            self._pending_forks.pop(request.request_id, None)
        self._forget_speculation(samples)

    def _end_if_done(self, group_id: str) -> None:
        samples = self._groups.get(group_id)
        if samples is not None and all(r.is_finished for r in samples):
            del self._groups[group_id]
            self._count_finished(samples)
            self._forget_speculation(samples)

    def _forget_speculation(self, samples: list[Request]) -> None:
        if self.speculation is not None:
            for request in samples:
                self.speculation.finish(request)

    def _count_finished(self, samples: list[Request]) -> None:
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(samples[0].prompt_token_ids)
        self.stats.num_generation_tokens += sum(len(r.output_token_ids) for r in samples)

    def _record_usage(self) -> None:
        """Called once a step is planned, when the pool is at its fullest for that step (the
        requests that finish in it free their blocks before it ends)."""
        stats = self.stats
        used = self.kv.pool.num_used
        if used > stats.peak_used_blocks:
            stats.peak_used_blocks = used
            stats.kv_at_peak = self.kv.stats()

    # ---- figures -------------------------------------------------------------------------

    def core_stats(self) -> CoreStats:
        num_waiting = len(self.scheduler.waiting) + len(self.scheduler.reading) + len(self._grammar_jobs) \
            + len(self._adapter_jobs)
        spec = None
        if self.speculation is not None:
            c = self.speculation.counters
            spec = SpecDecodeStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                   list(c.accepted_per_position))
        groups = [(window or 0, used) for window, used in zip(self.kv.windows, self.kv.pool.used_by_group)]
        return CoreStats(len(self.scheduler.running), num_waiting, self.kv.stats(),
                         self.scheduler.num_preemptions, spec, groups)

    def watch_kv(self, seconds: float) -> None:
        """Record the pool's changes for a live view for `seconds` from now (core/kv_view.py)."""
        self.kv_viewer.watch(seconds)

    def kv_view(self) -> KVView | None:
        """The live view due now, if the pool is watched and one is due (called after every step:
        unwatched, one attribute test)."""
        if not self.kv.watched:
            return None
        return self.kv_viewer.take(busy=self.has_unfinished_requests())

    def fast_paths(self) -> dict[str, str | None]:
        """The forward's fast paths (decode replays, the C kernels on CPU): None for each taken, else
        why it is skipped (worker/fast_paths.py)."""
        return self.executor.fast_paths()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing forgotten) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise ExecutorFailed once no step can run (a tensor-parallel worker is gone, the device
        failed)."""
        if self._device_failure is not None:
            raise ExecutorFailed(self._device_failure)
        self.executor.check_health()

    def save_kv_tier(self, timeout: float = SAVE_SECONDS) -> tuple[int, int]:
        """Write the pool's cached blocks that the KV tier lacks to it (by the policy's rule,
        `KVCacheManager.offload_cached`), for at most `timeout` seconds: a restart finds them.
        Returns (blocks written, blocks left unwritten when the time ran out); logged. Between steps
        only. The blocks of a step that never completed (interrupted, say) are forgotten first:
        their K/V may never have been computed."""
        if self.kv.tier is None or not self.kv.tier.writable or self._device_failure is not None:
            return 0, 0
        self.kv.discard_unconfirmed()
        self.kv.offload_cached()
        stores, _ = self.kv.take_transfers()
        if not stores:
            return 0, 0
        deadline = time.monotonic() + timeout
        tier, handed = self.kv.tier, 0
        try:
            for i in range(0, len(stores), SHUTDOWN_STORE_BATCH):  # each batch written before the next
                if time.monotonic() >= deadline:
                    break
                batch = stores[i : i + SHUTDOWN_STORE_BATCH]
                self.executor.transfer_blocks(batch, [])
                handed += len(batch)
                if not tier.flush(max(0.0, deadline - time.monotonic())):
                    break
        except Exception:
            logger.exception("writing the pool's cached blocks to the KV tier failed; a restart computes them")
        left = len(stores) - handed + min(handed, tier.num_pending)
        written = len(stores) - left
        if left:
            logger.warning("KV tier: %d of the pool's %d cached blocks written to %s; %d not, the %.0f s for it "
                           "ran out", written, len(stores), tier.path, left, timeout)
        else:
            logger.info("KV tier: the pool's %d cached blocks written to %s", written, tier.path)
        return written, left

    def shutdown(self) -> None:
        """Stop the executor's workers; the core runs no more steps. With a KV tier, the pool's cached
        blocks it lacks are written to it first (`save_kv_tier`): a restart finds them."""
        self.structured_output.shutdown()
        self.save_kv_tier()
        self.executor.shutdown()
