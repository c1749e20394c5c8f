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
    # False: output_len is only a limit and the output ends where the model ends it (the copy
    # workload, whose outputs are what the model makes of its input).
    ignore_eos: bool = True


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



# ---- multi-turn chat -------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatSession:
    """One conversation: a system prompt, then a user message per turn. The answers are not part of
    the workload: the engine produces them, and each is appended to the context before the next turn."""
    system_prompt: list[int]
    user_messages: list[list[int]]


@dataclass(frozen=True)
class MultiTurnWorkload:
    name: str
    sessions: list[ChatSession]
    answer_len: int  # forced: every answer is exactly this many tokens (ignore_eos, greedy)

    @property
    def num_turns(self) -> int:
        return len(self.sessions[0].user_messages) if self.sessions else 0

    def prompt(self, session: int, turn: int, answers: list[list[int]]) -> list[int]:
        """The prompt of `session`'s turn `turn` (0-based): its system prompt, then each earlier
        turn's user message and answer (`answers`, the engine's, in order), then this turn's message."""
        s = self.sessions[session]
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
        ids = list(s.system_prompt)
        for message, answer in zip(s.user_messages[:turn], answers[:turn]):
            ids += message + list(answer)
        return ids + s.user_messages[turn]

    def prompt_len(self, session: int, turn: int) -> int:
        """The length of that prompt when every earlier answer has answer_len tokens."""
        s = self.sessions[session]
        return len(s.system_prompt) + sum(len(m) for m in s.user_messages[:turn + 1]) + turn * self.answer_len

    def context_len(self, session: int) -> int:
        """The session's whole context after its last answer: the most KV it ever holds."""
        return self.prompt_len(session, self.num_turns - 1) + self.answer_len

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over every turn of every session (each turn's prompt holds the whole context)."""
        return sum(self.prompt_len(s, t) for s in range(len(self.sessions)) for t in range(self.num_turns))

    @property
    def num_output_tokens(self) -> int:
        return len(self.sessions) * self.num_turns * self.answer_len

    def describe(self) -> str:
        shared = len({tuple(s.system_prompt) for s in self.sessions}) == 1 < len(self.sessions)
        return (f"{self.name}: {len(self.sessions)} sessions x {self.num_turns} turns, system prompt "
                f"{len(self.sessions[0].system_prompt)} tokens ({'shared' if shared else 'one per session'}), "
                f"user messages {len(self.sessions[0].user_messages[0])} tokens, answers {self.answer_len} "
                f"tokens; final context {max(self.context_len(s) for s in range(len(self.sessions))):,} tokens per "
                f"session; {self.num_prompt_tokens:,} prompt + {self.num_output_tokens:,} output tokens in all")


def multi_turn_chat(num_sessions: int = 8, num_turns: int = 4, system_prompt_len: int = 512, user_len: int = 64,
                    answer_len: int = 32, shared_system_prompt: bool = False, seed: int = 0,
                    vocab: range | list[int] = range(100, 49000)) -> MultiTurnWorkload:
    """Chat sessions whose context grows turn by turn: each starts with a system prompt (one per
    session, or one shared by all), and each turn adds a user message of `user_len` random ids and
    an answer of `answer_len` tokens that the engine generates. Build each turn's prompt with
    `MultiTurnWorkload.prompt`."""
    if min(num_sessions, num_turns, user_len, answer_len) < 1 or system_prompt_len < 0:
        raise ValueError("num_sessions, num_turns, user_len and answer_len must be >= 1, system_prompt_len >= 0")
    rng = random.Random(seed)
    shared = _random_tokens(rng, system_prompt_len, vocab) if shared_system_prompt else None
    sessions = []
    for _ in range(num_sessions):
        system = shared if shared is not None else _random_tokens(rng, system_prompt_len, vocab)
        sessions.append(ChatSession(list(system), [_random_tokens(rng, user_len, vocab) for _ in range(num_turns)]))
    return MultiTurnWorkload("multi-turn-chat", sessions, answer_len)


def unique_prompts(num_requests: int = 32, seed: int = 0, prompt_len=(256, 512), output_len: int = 64,
                   vocab: range | list[int] = range(100, 49000)) -> Workload:
    """Prompts of uniform random length in `prompt_len`, no two sharing a prefix block (random ids),
    each generating exactly `output_len` tokens: nothing for a cache to reuse."""
    rng = random.Random(seed)
    return Workload("unique-prompts", [WorkloadRequest(_random_tokens(rng, rng.randint(*prompt_len), vocab), output_len)
                                       for _ in range(num_requests)])

# ---- outputs that copy their inputs ----------------------------------------------------------

COPY_TEXTS = [
    "A paged cache keeps the keys and values of every request in blocks of a fixed size. Each request "
    "owns a table that maps its logical blocks to physical ones, so its memory grows one block at a time "
    "and no request reserves room it may never use. When two requests begin with the same prompt, they "
    "share the blocks that hold it, and a block is copied only when one of them writes into it.",
    "The river rose slowly through the night. By morning the lower fields were under water, and the "
    "farmers moved their animals to the hill behind the church. Nobody was hurt, but the bridge on the "
    "old road was closed for a week, and the children walked the long way round to school.",
    "To make bread, mix the flour, the salt and the yeast in a large bowl. Add warm water a little at a "
    "time and knead the dough for ten minutes, until it is smooth. Leave it to rise in a warm place for "
    "an hour, shape it, let it rise again, and bake it in a hot oven for about forty minutes.",
    "The meeting is moved from Tuesday to Thursday at ten o'clock. Please bring the figures for the "
    "third quarter and a short note on the new supplier. If you cannot come, send your questions to "
    "Maria before Wednesday evening so that she can answer them at the meeting.",
    "def moving_average(values, window):\n"
    "    \"\"\"The mean of each run of `window` consecutive values.\"\"\"\n"
    "    if window < 1:\n"
    "        raise ValueError(\"window must be at least 1\")\n"
    "    total = sum(values[:window])\n"
    "    result = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        result.append(total / window)\n"
    "    return result\n",
    "def count_words(text):\n"
    "    counts = {}\n"
    "    for word in text.lower().split():\n"
    "        word = word.strip(\".,;:!?\")\n"
    "        if word:\n"
    "            counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda item: -item[1])\n",
    "class Stack:\n"
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n\n"
    "    def pop(self):\n"
    "        if not self.items:\n"
    "            raise IndexError(\"pop from an empty stack\")\n"
    "        return self.items.pop()\n\n"
    "    def __len__(self):\n"
    "        return len(self.items)\n",
]


def _with_typos(rng: random.Random, text: str, every: int = 8) -> str:
    """About one word in `every` with two neighbouring letters swapped."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and word.isalpha() and rng.random() < 1 / every:
            j = rng.randrange(len(word) - 1)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def _copy_task(rng: random.Random, text: str) -> str:
    """A request whose answer is `text` again, as given or lightly edited."""
    code = text.startswith(("def ", "class "))
    kind = rng.choice(["repeat", "rename"] if code else ["repeat", "typos"])
    if kind == "repeat":
        return f"Repeat the following {'code' if code else 'text'} exactly, word for word:\n\n{text}"
    if kind == "typos":
        return ("Correct the spelling mistakes in the following text and write out the whole corrected "
                f"text:\n\n{_with_typos(rng, text)}")
    old = text.split()[1].split("(")[0].rstrip(":")
    new = {"moving_average": "rolling_mean", "count_words": "word_counts", "Stack": "LifoStack"}.get(old, old + "2")
    return f"Rewrite the following code with `{old}` renamed to `{new}`. Write out the whole code:\n\n{text}"


def copy_edit(tokenizer, num_requests: int = 8, seed: int = 0, max_tokens: int = 256) -> Workload:
    """Chat requests (the tokenizer's chat template) to repeat, correct or lightly edit a given
    paragraph or code snippet: outputs that mostly copy their prompts, ending where the model ends
    them (at most `max_tokens`). Texts cycle through COPY_TEXTS in a seeded order."""
    rng = random.Random(seed)
    order = list(range(len(COPY_TEXTS)))
    rng.shuffle(order)
    requests = []
    for i in range(num_requests):
        content = _copy_task(rng, COPY_TEXTS[order[i % len(order)]])
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        requests.append(WorkloadRequest(tokenizer.encode(text, add_special_tokens=False), max_tokens, ignore_eos=False))
    return Workload("copy-edit", requests)


WORKLOADS = {"sharegpt-like": sharegpt_like, "decode-heavy": decode_heavy, "long-prompt": long_prompt,
             "long-outputs": long_outputs, "shared-prefix": shared_prefix, "parallel-sampling": parallel_sampling}
