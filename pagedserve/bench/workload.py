"""Seeded synthetic workloads: length distributions, arrival times, and token-id prompts that every
system in a benchmark sees identically."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose logarithm is uniform: many short, a few long."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def poisson_arrival_steps(rng: random.Random, n: int, rate: float) -> list[int]:
    """Arrival step of each of `n` requests for a Poisson process of `rate` requests per step."""
    t, steps = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        steps.append(int(t))
    return steps


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int  # forced: every system generates exactly this many tokens (ignore_eos)
    n: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[WorkloadRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len * r.n for r in self.requests)

    def describe(self) -> str:
        return (f"{self.name}: {len(self.requests)} requests, {self.num_prompt_tokens:,} prompt + "
                f"{self.num_output_tokens:,} output tokens")

    def with_output_len(self, output_len: int) -> Workload:
        """The same prompts, each generating exactly `output_len` tokens (1: the prompts alone)."""
        if output_len < 1:
            raise ValueError(f"output_len must be at least 1, got {output_len}")
        return replace(self, name=f"{self.name}-out{output_len}",
                       requests=[replace(r, output_len=output_len) for r in self.requests])

    def to_json(self) -> dict:
        return {"name": self.name, "requests": [
            {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len, "n": r.n} for r in self.requests]}


def _random_tokens(rng: random.Random, n: int, vocab: range | list[int]) -> list[int]:
    return [rng.choice(vocab) for _ in range(n)]


def sharegpt_like(num_requests: int = 64, seed: int = 0, prompt_len=(16, 512), output_len=(16, 256),
                  vocab: range = range(100, 49000)) -> Workload:
    """Chat-like lengths: many short prompts and answers, a few long ones."""
    rng = random.Random(seed)
    return Workload("sharegpt-like", [
        WorkloadRequest(_random_tokens(rng, log_uniform(rng, *prompt_len), vocab), log_uniform(rng, *output_len))
        for _ in range(num_requests)])


def shared_prefix(num_requests: int = 32, seed: int = 0, prefix_len: int = 512, suffix_len=(16, 64),
                  output_len=(16, 64), vocab: range = range(100, 49000)) -> Workload:
    """Many requests behind one long common system prompt."""
    rng = random.Random(seed)
    prefix = _random_tokens(rng, prefix_len, vocab)
    return Workload("shared-prefix", [
        WorkloadRequest(prefix + _random_tokens(rng, log_uniform(rng, *suffix_len), vocab), log_uniform(rng, *output_len))
        for _ in range(num_requests)])


def system_prompts(num_prompts: int = 4, requests_per_prompt: int = 16, seed: int = 0, prompt_len: int = 512,
                   suffix_len: int = 16, output_len: int = 1, vocab: range = range(100, 49000)) -> Workload:
    """Several long system prompts, each behind many requests with a short suffix of their own, in
    random order: what a prefix-aware router over replicas is for (`bench routing`)."""
    rng = random.Random(seed)
    prompts = [_random_tokens(rng, prompt_len, vocab) for _ in range(num_prompts)]
    requests = [WorkloadRequest(prompts[i % num_prompts] + _random_tokens(rng, suffix_len, vocab), output_len)
                for i in range(num_prompts * requests_per_prompt)]
    rng.shuffle(requests)
    return Workload("system-prompts", requests)


def parallel_sampling(num_requests: int = 16, seed: int = 0, n: int = 4, prompt_len=(16, 512),
                      output_len=(16, 256), vocab: range = range(100, 49000)) -> Workload:
    """n samples of each prompt (n x the output tokens)."""
    base = sharegpt_like(num_requests, seed, prompt_len, output_len, vocab)
    return Workload("parallel-sampling", [WorkloadRequest(r.prompt_token_ids, r.output_len, n) for r in base.requests])


def long_prompt(num_requests: int = 64, seed: int = 0, prompt_len=(512, 2048), output_len=(32, 256),
                vocab: range = range(100, 49000)) -> Workload:
    """Document-sized prompts (summaries, RAG, code): prompt attention and chunked prefill dominate."""
    base = sharegpt_like(num_requests, seed, prompt_len, output_len, vocab)
    return Workload("long-prompt", base.requests)


def decode_heavy(num_requests: int = 64, seed: int = 0, prompt_len=(16, 512), output_len=(64, 256),
                 vocab: range = range(100, 49000)) -> Workload:
    """sharegpt-like prompts with longer answers (three quarters as many output tokens as prompt
    tokens, against under half): batched decode steps take most of the time."""
    base = sharegpt_like(num_requests, seed, prompt_len, output_len, vocab)
    return Workload("decode-heavy", base.requests)


def long_outputs(num_requests: int = 64, seed: int = 0, prompt_len: int = 16, output_len: int = 256,
                 vocab: range = range(100, 49000)) -> Workload:
    """Short prompts of one length, each generating the same long output: decode steps alone, every
    step the whole batch (the decode half of decode-heavy; its prompt half is `--output-len 1`)."""
    rng = random.Random(seed)
    return Workload("long-outputs", [WorkloadRequest(_random_tokens(rng, prompt_len, vocab), output_len)
                                     for _ in range(num_requests)])


def single_request(prompt_len: int = 128, output_len: int = 128, seed: int = 0,
                   vocab: range | list[int] = range(100, 49000)) -> Workload:
    """One request, a prompt of random ids and an output of a set length: a latency measurement."""
    rng = random.Random(seed)
    return Workload("single-request", [WorkloadRequest(_random_tokens(rng, prompt_len, vocab), output_len)])


WORKLOADS = {"sharegpt-like": sharegpt_like, "decode-heavy": decode_heavy, "long-prompt": long_prompt,
             "long-outputs": long_outputs, "shared-prefix": shared_prefix, "parallel-sampling": parallel_sampling}
