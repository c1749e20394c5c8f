import dataclasses
import math

import pytest

from pagedserve.sampling_params import ParameterError, SamplingParams

# vLLM's defaults (vllm.SamplingParams), after its normalisation of stop / stop_token_ids.
VLLM_DEFAULTS = dict(
    n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
    top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
    max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, skip_special_tokens=True,
    include_stop_str_in_output=False,
)


def test_defaults_equal_vllm():
    p = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(p, name) == value, name
    assert dataclasses.is_dataclass(p)
    assert not p.is_greedy


def test_stop_normalised_to_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


@pytest.mark.parametrize("temperature, greedy", [(0, True), (0.0, True), (1e-6, True), (1e-4, False), (2, False)])
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=1.0),
    dict(temperature=0), dict(presence_penalty=-2, frequency_penalty=2), dict(repetition_penalty=0.01),
    dict(max_tokens=None, min_tokens=10_000), dict(max_tokens=1, min_tokens=1), dict(logprobs=0),
    dict(prompt_logprobs=0),    dict(seed=0), dict(seed=-3), dict(n=4), dict(stop_token_ids=[0, 2]),
])
def test_valid_edges_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


@pytest.mark.parametrize("name, value", [
    ("n", 0), ("n", 1.0), ("n", True),
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.1), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", -3), ("frequency_penalty", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("max_tokens", 0), ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 1.0), ("prompt_logprobs", -1), ("prompt_logprobs", True),
    ("seed", 1.5), ("seed", "7"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 3),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]), ("stop_token_ids", 2),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
])
def test_invalid_value_error_names_parameter(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be "):
        SamplingParams(**{name: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_message_shows_value():
    with pytest.raises(ValueError, match=r"temperature must be .*>= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, top_k=3).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(p, top_k=-5)


# Every integer ends up in an int64 tensor or a torch seed, every float in a float32 tensor: a value
# that does not fit is refused here, before it can fail a batch that other requests share.
@pytest.mark.parametrize("name, value", [
    ("top_k", 2**63), ("top_k", 10**30), ("seed", 2**63), ("seed", -(2**63) - 1), ("n", 2**63),
    ("max_tokens", 2**63), ("min_tokens", 2**63), ("logprobs", 2**63), ("prompt_logprobs", 2**63),
    ("stop_token_ids", [2**63]),
    ("temperature", 1e39), ("repetition_penalty", 1e39), ("repetition_penalty", 1e-40),
    ("logit_bias", {2**63: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {"5": 1.0}),
])
def test_values_beyond_int64_or_float32_are_refused(name, value):
    kwargs = {name: value} | ({"max_tokens": None} if name == "min_tokens" else {})
    with pytest.raises(ParameterError, match=rf"^{name} must be ") as e:
        SamplingParams(**kwargs)
    assert e.value.param == name


@pytest.mark.parametrize("kwargs", [
    dict(top_k=2**63 - 1), dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(temperature=3.4e38),
    dict(repetition_penalty=1.2e-38),
])
def test_the_extremes_that_fit_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_k=101), "top_k"), (dict(logprobs=101), "logprobs"),
    (dict(prompt_logprobs=101), "prompt_logprobs"), (dict(stop_token_ids=[3, 100]), "stop_token_ids"),
    (dict(n=9), "n"), (dict(logit_bias={3: 1.0, 100: -5.0}), "logit_bias"),
])
def test_engine_limits_are_checked_against_the_model(kwargs, param):
    params = SamplingParams(**kwargs)
    with pytest.raises(ParameterError, match=param) as e:
        params.verify_for_engine(vocab_size=100, max_num_seqs=8)
    assert e.value.param == param
    SamplingParams(top_k=100, logprobs=100, prompt_logprobs=100, stop_token_ids=[99], n=8,
                   logit_bias={99: -100, 0: 100}).verify_for_engine(vocab_size=100, max_num_seqs=8)


def test_every_validation_error_names_its_parameter():
    with pytest.raises(ParameterError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.param == "min_tokens"
    with pytest.raises(ParameterError) as e:
        SamplingParams(stop=[""])
    assert e.value.param == "stop"
