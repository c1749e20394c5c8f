"""Batched sampling: one call per engine step turns [num_rows, vocab] logits into token ids.

Order (vLLM v1): raw logprobs are taken from the model's logits; then min_tokens masking,
logit_bias and penalties, which also steer greedy rows; greedy rows take the argmax; sampled rows get
temperature, min-p, top-k, top-p, then an exponential race (argmax of probs / Exp(1) noise,
which picks token i with probability probs[i]). A row with its own generator draws its noise
from it alone, so its tokens do not depend on the other rows of the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.rejection_sampler import rejection_sample
from pagedserve.structured_output.manager import apply_bitmask

_PAD = -1  # pads ragged token-id lists; remapped to a spill column when counting


@dataclass
class SamplingBatch:
    """One step's sampling inputs as tensors. Optional parts are None when no row needs them."""

    num_rows: int
    all_greedy: bool
    # Rows that sample (not greedy); None when every row does.
    random_rows: Tensor | None
    # Per sampled row, aligned with random_rows; a filter no row uses is None. top_k 0 = off.
    temperature: Tensor | None
    top_k: Tensor | None
    top_p: Tensor | None
    min_p: Tensor | None
    generators: list[torch.Generator | None]
    # Per row. seen_token_ids = prompt + output (repetition penalty); output_token_ids for
    # presence/frequency; both [num_rows, max_len] padded with _PAD. Or, from the engine's
    # `TokenCounts`, the same as [num_rows, vocab] tensors already counted: seen (bool) and
    # output_counts (float32); the padded ids are then None.
    repetition_penalty: Tensor | None
    seen_token_ids: Tensor | None
    presence_penalty: Tensor | None
    frequency_penalty: Tensor | None
    output_token_ids: Tensor | None
    # (row, token) pairs forced to -inf because the row is still below min_tokens.
    blocked: tuple[Tensor, Tensor] | None
    # Per row: how many top logprobs to return (None = no logprobs for that row).
    num_logprobs: list[int | None]
    seen: Tensor | None = None
    output_counts: Tensor | None = None
    # (rows, tokens, biases) of every row's logit_bias, added to the logits in one op.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    # (rows, their token bitmasks) of the rows a grammar constrains (structured_output.py).
    grammar_bitmask: tuple[Tensor, Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: set[int] | tuple[int, ...],
        device: torch.device | str,
        counts: TokenCounts | None = None,
        keys: list[Hashable] | None = None,
        grammar_bitmask: tuple[Tensor, Tensor] | None = None,
    ) -> SamplingBatch:
        """`counts` (with each row's request id in `keys`): take the penalties' token counts from
        there, kept from step to step, instead of padding every prompt and output again."""
        n = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == n

        def floats(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def padded(rows: list[list[int]]) -> Tensor:
            width = max(1, max(len(r) for r in rows))
            return torch.tensor([r + [_PAD] * (width - len(r)) for r in rows],
                                dtype=torch.long, device=device)

        rand = [i for i, p in enumerate(params) if not p.is_greedy]
        rp = [params[i] for i in rand]
        all_random = len(rand) == n
        random_rows = None if all_random else torch.tensor(rand, dtype=torch.long, device=device)

        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in rp):
            top_k = torch.tensor([max(p.top_k, 0) for p in rp], dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in rp):
            top_p = floats([p.top_p for p in rp])
        if any(p.min_p > 0.0 for p in rp):
            min_p = floats([p.min_p for p in rp])

        repetition = seen = presence = frequency = outputs = None
        uses_repetition = any(p.repetition_penalty != 1.0 for p in params)
        uses_frequency = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        seen_mask = output_counts = None
        if counts is not None and (uses_repetition or uses_frequency):
            seen_mask, output_counts = counts.rows(keys, prompt_token_ids, output_token_ids)
        if uses_repetition:
            repetition = floats([p.repetition_penalty for p in params])
            if counts is None:
                seen = padded([list(a) + list(b) for a, b in zip(prompt_token_ids, output_token_ids)])
        if uses_frequency:
            presence = floats([p.presence_penalty for p in params])
            frequency = floats([p.frequency_penalty for p in params])
            if counts is None:
                outputs = padded([list(o) for o in output_token_ids])

        # vLLM blocks all stop tokens (eos unless ignore_eos, plus stop_token_ids) below min_tokens.
        blocked_rows: list[int] = []
        blocked_tokens: list[int] = []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                blocked_rows += [i] * len(stops)
                blocked_tokens += sorted(stops)
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        biases: list[float] = []
        for i, p in enumerate(params):
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                biases += p.logit_bias.values()
        logit_bias = None
        if bias_rows:
            logit_bias = (torch.tensor(bias_rows, dtype=torch.long, device=device),
                          torch.tensor(bias_tokens, dtype=torch.long, device=device), floats(biases))

        blocked = None
        if blocked_rows:
            blocked = (torch.tensor(blocked_rows, dtype=torch.long, device=device),
                       torch.tensor(blocked_tokens, dtype=torch.long, device=device))

        return cls(
            num_rows=n,
            all_greedy=not rand,
            random_rows=random_rows,
            temperature=floats([p.temperature for p in rp]) if rand else None,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[generators[i] for i in rand],
            repetition_penalty=repetition,
            seen_token_ids=seen,
            presence_penalty=presence,
            frequency_penalty=frequency,
            output_token_ids=outputs,
            blocked=blocked,
            num_logprobs=[p.logprobs for p in params],
            seen=seen_mask,
            output_counts=output_counts,
            logit_bias=logit_bias,
            grammar_bitmask=grammar_bitmask,
        )


class TokenCounts:
    """Each request's token counts over the vocabulary, for the penalties, kept from step to step.

    Padding every prompt and output into a new tensor each step costs O(all their tokens) of
    Python per step. Here a request's prompt is counted once, and each step adds only the output
    tokens it produced since (outputs only ever grow, even when a request is preempted or a step
    is undone). Made only for requests in a batch where some row uses a penalty; the engine
    forgets the requests the scheduler freed."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._prompt_seen: dict[Hashable, Tensor] = {}  # bool [vocab]
        self._output: dict[Hashable, Tensor] = {}  # float32 [vocab]
        self._num_counted: dict[Hashable, int] = {}  # output tokens in _output

    def rows(self, keys: list[Hashable], prompts: list[list[int]], outputs: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(seen: prompt or output, [rows, vocab] bool; output counts, [rows, vocab] float32)."""
        for key, prompt, output in zip(keys, prompts, outputs):
            if key not in self._output:
                seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seen[torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
                self._prompt_seen[key] = seen
                self._output[key] = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
                self._num_counted[key] = 0
            new = output[self._num_counted[key]:]
            if new:
                ids = torch.tensor(new, dtype=torch.long, device=self.device)
                self._output[key].index_add_(0, ids, torch.ones(len(new), device=self.device))
                self._num_counted[key] = len(output)
        counts = torch.stack([self._output[k] for k in keys])
        seen = torch.stack([self._prompt_seen[k] for k in keys]) | (counts > 0)
        return seen, counts

    def forget(self, keys) -> None:
        for key in keys:
            self._prompt_seen.pop(key, None)
            self._output.pop(key, None)
            self._num_counted.pop(key, None)

    def __len__(self) -> int:
        return len(self._output)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float | None]  # logprob of the sampled token (None if not requested)
    ranks: list[int | None]  # its rank among the vocabulary (1 = most likely)
    top_logprobs: list[list[tuple[int, float]] | None]  # top-k (token, logprob), k = params.logprobs


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        # Draws the noise of rows without their own generator; made on the logits' device.
        self._generator: torch.Generator | None = None

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device)
            if self.seed is None:
                self._generator.seed()  # non-deterministic
            else:
                self._generator.manual_seed(self.seed)
        return self._generator

    @torch.inference_mode()
    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows
        raw = logits.float()
        logits = self._steer(raw, batch)
        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        elif batch.random_rows is None:
            sampled = self._sample(logits, batch)
        else:
            sampled = logits.argmax(dim=-1)
            sampled[batch.random_rows] = self._sample(logits[batch.random_rows], batch)

        return gather_logprobs(raw, sampled, batch.num_logprobs)

    @torch.inference_mode()
    def verify(self, logits: Tensor, batch: SamplingBatch, drafts: list[list[int]],
               generators: list[torch.Generator | None]) -> tuple[list[list[int]], SamplerOutput]:
        """Speculative decoding's verifier. Request i has len(drafts[i]) + 1 rows of `logits` and of
        `batch`, one after another (row j: its distribution after drafts[i][:j]). Greedy requests keep
        the longest prefix of drafts that matches the argmax, then the argmax after it; sampled ones
        keep what rejection sampling accepts, then a token from the target's distribution
        (rejection_sampler.py), drawing from `generators[i]` (None: the engine's). Returns each
        request's tokens (1 to len(drafts[i]) + 1), and every kept token's logprobs, flat in that order."""
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows == sum(len(d) + 1 for d in drafts)
        raw = logits.float()
        steered = self._steer(raw, batch)
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        kept: list[list[int]] = [[] for _ in drafts]
        if batch.all_greedy:
            random_rows = set()
        else:
            random_rows = set(range(batch.num_rows) if batch.random_rows is None else batch.random_rows.tolist())
        random_requests = [i for i in range(len(drafts)) if starts[i] in random_rows]
        if random_requests:
            probs = self._probs(steered if batch.random_rows is None else steered[batch.random_rows], batch)
            engine_generator = self._engine_generator(probs.device)
            accepted = rejection_sample(probs, [drafts[i] for i in random_requests], None,
                                        [generators[i] or engine_generator for i in random_requests])
            for i, tokens in zip(random_requests, accepted):
                kept[i] = tokens
        argmax = steered.argmax(dim=-1).tolist()
        for i, request_drafts in enumerate(drafts):
            if kept[i]:
                continue
            targets = argmax[starts[i] : starts[i + 1]]
            n = 0
            while n < len(request_drafts) and request_drafts[n] == targets[n]:
                n += 1
            kept[i] = targets[: n + 1]  # the accepted drafts (equal to the targets), then the target's own
        rows = [starts[i] + j for i, tokens in enumerate(kept) for j in range(len(tokens))]
        flat = torch.tensor([t for tokens in kept for t in tokens], dtype=torch.long, device=raw.device)
        return kept, gather_logprobs(raw[torch.tensor(rows, device=raw.device)], flat,
                                     [batch.num_logprobs[r] for r in rows])

    @staticmethod
    def _steer(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """What steers every row, greedy ones too: the grammar's bitmask, min_tokens, logit_bias and
        the penalties. Out of place: the caller's (raw) logits stay untouched."""
        if batch.grammar_bitmask is not None:
            logits = apply_bitmask(logits, *batch.grammar_bitmask)
        if batch.blocked is not None:
            logits = logits.index_put(batch.blocked, torch.tensor(float("-inf"), device=logits.device))
        if batch.logit_bias is not None:
            rows, tokens, biases = batch.logit_bias
            logits = logits.index_put((rows, tokens), biases, accumulate=True)
        return apply_penalties(logits, batch)

    @staticmethod
    def _probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """The distribution the (non-greedy) rows of `logits`, aligned with batch.random_rows, sample
        from: temperature, min-p, top-k, top-p."""
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        return logits.softmax(dim=-1)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Samples the (non-greedy) rows of `logits`, aligned with batch.random_rows."""
        probs = self._probs(logits, batch)
        q = torch.empty_like(probs)
        seeded = [(i, g) for i, g in enumerate(batch.generators) if g is not None]
        if len(seeded) < len(batch.generators):
            exponential_noise_(q, self._engine_generator(probs.device))
        # Each seeded row draws exactly one row of noise from its own generator per step.
        for i, g in seeded:
            exponential_noise_(q[i], g)
        return probs.div_(q).argmax(dim=-1)


def exponential_noise_(q: Tensor, generator: torch.Generator) -> Tensor:
    """Fill q with Exp(1) noise, as -log(U) for U uniform: on the CPU 4-5x faster than
    `q.exponential_()` (64 rows of a 49,152-token vocabulary: 9 ms against 54). U is kept at
    least float32's smallest normal, so that no noise is infinite: a token whose noise were
    infinite could not win."""
    return q.uniform_(generator=generator).clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()


def _bin_counts(token_ids: Tensor, vocab_size: int) -> Tensor:
    """[rows, max_len] padded ids -> [rows, vocab] occurrence counts (float32)."""
    # Padding goes to an extra column that is dropped.
    ids = token_ids.masked_fill(token_ids == _PAD, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    vocab_size = logits.shape[1]
    if batch.repetition_penalty is not None:
        # HF/vLLM: seen tokens' positive logits are divided by the penalty, negative multiplied.
        seen = batch.seen if batch.seen is not None else _bin_counts(batch.seen_token_ids, vocab_size) > 0
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        # OpenAI definition, over output tokens only.
        counts = (batch.output_counts if batch.output_counts is not None
                  else _bin_counts(batch.output_token_ids, vocab_size))
        logits = (logits
                  - batch.frequency_penalty.unsqueeze(1) * counts
                  - batch.presence_penalty.unsqueeze(1) * (counts > 0))
    return logits


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Keeps each row's top_k logits (ties at the k-th kept; k <= 0 = off), then the smallest set
    of most likely tokens whose probability reaches top_p (at least one token)."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    if top_k is not None:
        k_off = (top_k <= 0) | (top_k >= vocab_size)
        k = top_k.masked_fill(k_off, 1)
    if top_p is None:
        # Top-k alone needs only the k-th value, not a full sort.
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        kth = kth.masked_fill(k_off.unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        kth = kth.masked_fill(k_off.unsqueeze(1), float("-inf"))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Drop the least likely tokens while the mass they carry stays within 1 - top_p.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def gather_logprobs(raw_logits: Tensor, sampled: Tensor, num_logprobs: list[int | None]) -> SamplerOutput:
    """Each row's token (`sampled`: the one drawn, or the prompt's next token) with, where
    num_logprobs[row] is not None, its raw logprob, its rank and the row's top num_logprobs."""
    n = len(num_logprobs)
    token_ids = sampled.tolist()
    logprobs: list[float | None] = [None] * n
    ranks: list[int | None] = [None] * n
    top: list[list[tuple[int, float]] | None] = [None] * n
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if rows:
        # vLLM v1 "raw_logprobs": log_softmax of the model's logits, before any processing.
        idx = torch.tensor(rows, dtype=torch.long, device=raw_logits.device)
        lp = raw_logits[idx].log_softmax(dim=-1)
        chosen = lp.gather(1, sampled[idx].unsqueeze(1))
        rank = (lp > chosen).sum(dim=-1) + 1
        max_k = min(max(num_logprobs[i] for i in rows), lp.shape[1])
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        chosen_l, rank_l = chosen.squeeze(1).tolist(), rank.tolist()
        vals_l, ids_l = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            k = num_logprobs[i]
            logprobs[i], ranks[i] = chosen_l[j], rank_l[j]
            top[i] = list(zip(ids_l[j][:k], vals_l[j][:k]))
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs, ranks=ranks, top_logprobs=top)
