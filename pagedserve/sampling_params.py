"""Per-request sampling parameters, with vLLM's names, defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import ParameterError
from pagedserve.structured_output.params import StructuredOutputsParams

# Below this temperature a request is sampled greedily (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# Every integer field ends up in an int64 tensor or a torch seed; every float one in float32.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_int64(x: object) -> bool:
    return _is_int(x) and INT64_MIN <= x <= INT64_MAX


def _is_real(x: object) -> bool:
    """A number that float32 holds without overflowing (so neither NaN nor infinite)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -FLOAT32_MAX <= x <= FLOAT32_MAX


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the parameter.

    top_k 0 or -1 and top_p 1.0 and min_p 0.0 disable those filters; temperature 0 is greedy;
    max_tokens None means up to the model's context limit. `stop` and `stop_token_ids` are
    normalised to lists on construction.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # Per prompt token after the first: its logprob, rank and the top-k (vLLM's name and meaning).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # guided decoding: see the class

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        self._verify()

    def _verify(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ParameterError(name, f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not _is_int64(self.n) or self.n < 1:
            fail("n", "an int >= 1")
        # `not (lo <= x <= hi)` also rejects NaN.
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                fail(name, "a number in [-2, 2]")
        # Positive and finite in float32: the penalty divides and multiplies float32 logits.
        if not _is_real(self.repetition_penalty) or not self.repetition_penalty >= _FLOAT32_TINY:
            fail("repetition_penalty", "a finite number > 0")
        if not _is_real(self.temperature) or not self.temperature >= 0:
            fail("temperature", "a finite number >= 0")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "a number in (0, 1]")
        if not _is_int64(self.top_k) or self.top_k < -1:
            fail("top_k", "an int >= 1, or 0 or -1 (disabled)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "a number in [0, 1]")
        if self.seed is not None and not _is_int64(self.seed):
            fail("seed", "a 64-bit int or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a non-empty string, a list of non-empty strings, or None")
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int64(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative ints or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if self.max_tokens is not None and (not _is_int64(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an int >= 1 or None")
        if not _is_int64(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int64(value) or value < 0):
                fail(name, "an int >= 0 or None")
        if self.logit_bias is not None and not (isinstance(self.logit_bias, dict) and all(
                _is_int64(t) and t >= 0 and _is_real(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items())):
            fail("logit_bias", "a dict of token ids (ints >= 0) to biases in [-100, 100], or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "a StructuredOutputsParams or None")

    def verify_for_engine(self, vocab_size: int, max_num_seqs: int, *, grammar: bool = True) -> None:
        """The checks that need the engine: token ids and counts within the vocabulary, and no
        more samples than can run at once (a request's samples run together); with `grammar`,
        the structured-output spec's too (the core checks it off its step loop instead)."""
        def fail(name: str, rule: str) -> None:
            raise ParameterError(name, f"{name} must be {rule}, got {getattr(self, name)!r}")

        if self.top_k > vocab_size:
            fail("top_k", f"<= the vocabulary size ({vocab_size}), or 0 or -1 (disabled)")
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise ParameterError("stop_token_ids",
                                 f"stop_token_ids: {bad} is out of range for a vocabulary of {vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                fail(name, f"<= the vocabulary size ({vocab_size})")
        bad = next((t for t in self.logit_bias or () if t >= vocab_size), None)
        if bad is not None:
            raise ParameterError("logit_bias", f"logit_bias: token id {bad} is out of range for a vocabulary of {vocab_size}")
        if self.n > max_num_seqs:
            fail("n", f"<= max_num_seqs ({max_num_seqs})")
        if grammar and self.structured_outputs is not None:
            from pagedserve.structured_output.manager import check_grammar  # xgrammar only when asked for

            check_grammar(self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


@dataclass(frozen=True)
class BeamSearchParams:
    """How to beam-search one prompt (vLLM's names); invalid values raise ParameterError."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted for vLLM compatibility; only 0 (deterministic) is supported
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        # Each round asks the engine for 2 x beam_width logprobs: that count must fit int64 too.
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= INT64_MAX // 2:
            raise ParameterError("beam_width", f"beam_width must be an int >= 1, got {self.beam_width!r}")
        if not _is_int64(self.max_tokens) or self.max_tokens < 1:
            raise ParameterError("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ParameterError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.temperature != 0.0:
            raise ParameterError("temperature", f"temperature must be 0 for beam search, got {self.temperature!r}")
        # A hypothesis scores cum_logprob / length ** length_penalty: beyond +-50 the power overflows.
        if not _is_real(self.length_penalty) or not -50 <= self.length_penalty <= 50:
            raise ParameterError("length_penalty",
                                 f"length_penalty must be a number in [-50, 50], got {self.length_penalty!r}")
