"""LLMEngine: the synchronous core. add_request / step / abort_request.

One step: the scheduler plans, the model runner computes, the sampler picks a token for every
request whose known tokens are all computed, and the engine appends it, detokenizes, checks the
stop conditions and frees what finished.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedserve.engine.scheduler import Scheduler, SchedulerOutput
from pagedserve.kv import KVCacheManager, KVCacheStats
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.text import check_unicode

logger = logging.getLogger(__name__)


@dataclass
class _StepResult:
    """What a step computed, before it is applied."""

    samplers: list[Request]  # the requests that take a token this step
    sampled: SamplerOutput | None  # aligned with samplers (None when there are none)


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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model=None, tokenizer=None) -> None:
        """`model` = (module, ModelConfig) and `tokenizer` may be passed in to share loaded weights."""
        from pagedserve.models.loader import load_model, load_tokenizer

        self.config = config = config or EngineConfig()
        self.model, self.model_config = model or load_model(config.model, config.torch_dtype, config.device)
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.runner = ModelRunner(self.model, self.model_config, config)
        model_max_len = self.model_config.max_position_embeddings
        config.check_max_model_len(model_max_len)  # before a profiling pass runs that long a prompt
        measured = self.runner.measure_kv_budget(config.max_model_len or model_max_len) \
            if config.measures_kv_budget else None
        num_blocks, self.max_model_len = config.resolve_kv_pool(
            self.model_config.kv_bytes_per_token(config.kv_torch_dtype), model_max_len, measured)
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_decode_graphs(self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(seed=config.seed)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.stats = EngineStats()
        self._groups: dict[str, list[Request]] = {}  # user request id -> its samples
        self._prompts: dict[str, str | None] = {}
        self._pending_forks: dict[Hashable, list[Request]] = {}  # first sample -> samples to fork
        self._request_counter = itertools.count()

    # ---- requests ------------------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, its token ids), or (None, the ids) for token ids. Text that is not valid
        Unicode is a ValueError saying where, not a TypeError from inside the tokenizer."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(check_unicode(prompt, "the prompt"))
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queue a request; it joins the running batch at the next step. Bad input: ValueError."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.verify_for_engine(self.model_config.vocab_size, self.scheduler.max_num_seqs)
        text, token_ids = self.tokenize(prompt)
        prompt_text = prompt_text if prompt_text is not None else text
        self.validate_prompt(token_ids)
        samples = []
        for i in range(params.n):
            generator = None
            if params.seed is not None:
                # Each sample its own stream; the first uses the seed as given.
                generator = torch.Generator(self.config.device).manual_seed((params.seed + i * 0x9E3779B1) % 2**63)
            request = Request((request_id, i), token_ids, params, group_id=request_id, sample_index=i,
                              generator=generator, arrival_time=arrival_time)
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or (), include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
            samples.append(request)
        self._groups[request_id] = samples
        self._prompts[request_id] = prompt_text
        if len(samples) > 1:
            self._pending_forks[samples[0].request_id] = samples[1:]
        self.scheduler.add(samples[0])

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens long, longer than max_model_len "
                             f"({self.max_model_len})")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range for a vocabulary of {vocab}")

    def abort_request(self, request_id: str) -> None:
        """Stop a request at once, whatever its state, and free everything it holds."""
        self._end_group(self._groups.pop(request_id, []), RequestStatus.FINISHED_ABORTED)
        self._prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every user request that advanced or finished.

        A step that raises is contained: see `_contain_fault`. One that is interrupted (Ctrl-C)
        before it commits is undone, then the interrupt goes on."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.requests:
            return []
        self._record_usage()
        rows, samplers = self._samplers(plan)
        # The generators this step may draw from, to replay it exactly after a fault.
        states = [(r.generator, r.generator.get_state()) for r in samplers
                  if r.generator is not None and not r.sampling_params.is_greedy]
        try:
            try:
                result = self._compute(plan, rows, samplers)
            except Exception as error:
                result, failed = self._contain_fault(plan, states, error)
        except BaseException:
            if not plan.undone:  # its prefix blocks must not stay findable, nor its slots reserved
                self._restore_generators(states)
                self.scheduler.undo_step(plan)
            raise
        if result is None:
            self._record_step(time.perf_counter() - start)
            return [output for request, message in failed if (output := self._fail(request, message))]
        outputs = self._commit(plan, result)
        self._record_step(time.perf_counter() - start)
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
        request: only the K/V slots the plan reserved and the draws of the rows' generators."""
        logits = self.runner.execute(plan, rows)
        if not samplers:  # every request of the step is a prefill chunk with more to come
            return _StepResult(samplers, None)
        batch = SamplingBatch.build(
            [r.sampling_params for r in samplers], [r.prompt_token_ids for r in samplers],
            [r.output_token_ids for r in samplers], [r.generator for r in samplers], self.eos_token_ids,
            logits.device)
        return _StepResult(samplers, self.sampler(logits, batch))

    def _commit(self, plan: SchedulerOutput, result: _StepResult) -> list[RequestOutput]:
        """Apply a computed step: the tokens are in the cache, forks start, tokens are appended."""
        self.scheduler.finish_step(plan)
        for request in result.samplers:
            for child in self._pending_forks.pop(request.request_id, ()):
                self.scheduler.fork(request, child)
        touched: dict[str, None] = {}
        outputs = []
        now = time.monotonic()
        for k, request in enumerate(result.samplers):
            if request.is_finished:
                continue  # its group failed on an earlier row
            try:
                self._append_token(request, result.sampled, k, now)
            except Exception as e:  # e.g. in its detokenizer: only its own group ends
                logger.exception("request %s failed while taking its token", request.group_id)
                touched.pop(request.group_id, None)
                if output := self._fail(request, f"the engine failed on this request: {e!r}"):
                    outputs.append(output)
                continue
            touched[request.group_id] = None
        return [self._make_output(group_id) for group_id in touched] + outputs

    # ---- faults --------------------------------------------------------------------------

    def _contain_fault(self, plan: SchedulerOutput, states: list[tuple[torch.Generator, torch.Tensor]],
                       error: Exception) -> tuple[_StepResult | None, list[tuple[Request, str]]]:
        """A step raised. Run it once more (a transient fault passes, and its result is used);
        if it fails again, find the requests that make it fail by bisecting the plan, undo the
        step (every request in it is recomputed later, the prefix blocks it was to fill are
        forgotten) and fail only those requests. Returns (a result to commit, or None; the
        requests to fail with their messages)."""
        logger.warning("engine step failed (%r); running it again to find the request at fault", error)
        self._restore_generators(states)
        try:
            return self._compute(plan, *self._samplers(plan)), []
        except Exception as again:
            error = again

        def fails(rows: list[int]) -> Exception | None:
            part = plan.subset(rows)
            self._restore_generators(states)
            try:
                self._compute(part, *self._samplers(part))
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

    def _fail(self, request: Request, message: str) -> RequestOutput | None:
        """End the request's whole group with an error; its final output, carrying `message`
        (None if the group has ended already: two of its samples were at fault)."""
        group_id = request.group_id
        if group_id not in self._groups:
            return None
        self._end_group(self._groups[group_id], RequestStatus.FINISHED_ERROR)
        output = self._make_output(group_id)
        output.error = message
        return output

    def _end_group(self, samples: list[Request], status: RequestStatus) -> None:
        """End every sample of a group, whatever its state, and free what it holds."""
        for request in samples:
            if not request.is_finished:
                self.scheduler.finish(request, status)
            self._pending_forks.pop(request.request_id, None)

    def _append_token(self, request: Request, sampled, j: int, now: float) -> None:
        token = sampled.token_ids[j]
        params = request.sampling_params
        request.append_token(token)
        if request.first_token_time is None:
            request.first_token_time = now
        if request.logprobs is not None:
            request.cumulative_logprob += sampled.logprobs[j]
            entry = {token: Logprob(sampled.logprobs[j], sampled.ranks[j], self._decode_one(token))}
            for rank, (tok, lp) in enumerate(sampled.top_logprobs[j] or [], start=1):
                entry.setdefault(tok, Logprob(lp, rank, self._decode_one(tok)))
            request.logprobs.append(entry)

        # Stop conditions, in vLLM's order. None apply before min_tokens, except the length.
        status, stop_reason = None, None
        num_out = len(request.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        # A stop token's text is left out of the output unless asked for.
        if status is None or params.include_stop_str_in_output:
            request.output_text += request.detokenizer.add_tokens([token])
            if status is None and request.detokenizer.stop_matched:
                status, stop_reason = RequestStatus.FINISHED_STOPPED, request.detokenizer.stop_matched
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if status is None and (num_out >= max_tokens or request.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            request.stop_reason = stop_reason
            request.finish_time = now
            request.output_text += request.detokenizer.finish()
            self.scheduler.finish(request, status)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _make_output(self, group_id: str) -> RequestOutput:
        samples = self._groups[group_id]
        first = samples[0]
        finished = all(r.is_finished for r in samples)
        output = RequestOutput(
            request_id=group_id,
            prompt=self._prompts[group_id],
            prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=r.sample_index,
                    text=r.output_text,
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=list(r.logprobs) if r.logprobs is not None else None,
                    finish_reason=r.status.value if r.is_finished else None,
                    stop_reason=r.stop_reason,
                )
                for r in samples
            ],
            finished=finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time,
                     "finish_time": max((r.finish_time or 0.0) for r in samples) if finished else None},
        )
        if finished:
            del self._groups[group_id]
            del self._prompts[group_id]
            self.stats.num_requests += 1
            self.stats.num_prompt_tokens += len(first.prompt_token_ids)
            self.stats.num_generation_tokens += sum(len(r.output_token_ids) for r in samples)
        return output

    def _record_step(self, seconds: float) -> None:
        self.stats.num_steps += 1
        self.stats.busy_seconds += seconds

    def _record_usage(self) -> None:
        """Called once a step is planned, when the pool is at its fullest for that step (the
        requests that finish in it free their blocks before it ends)."""
        stats = self.stats
        used = self.kv.pool.num_used
        if used > stats.peak_used_blocks:
            stats.peak_used_blocks = used
            stats.kv_at_peak = self.kv.stats()

    # ---- figures -------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing forgotten) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
