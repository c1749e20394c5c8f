"""Structured output on the real embedded model: every constrained output parses against its
schema, even sampled from the 135M model; greedy constrained decoding equals transformers' with
xgrammar's own logits processor; free rows in a mixed batch are untouched; the grammar state
survives preemption and is per sample for n > 1; a spec that cannot compile is a ValueError
naming structured_outputs; nothing leaks."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import ParameterError, SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON:", "Here is a user record:", "The capital of France is", "{"]


def make_llm(embedded_model, embedded_tokenizer, **overrides) -> LLM:
    settings = dict(num_kv_blocks=256, max_model_len=1024) | overrides
    return LLM.from_engine(LLMEngine(EngineConfig(**settings), model=embedded_model, tokenizer=embedded_tokenizer))


def assert_all_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.fixture(scope="module")
def llm(embedded_model, embedded_tokenizer):
    return make_llm(embedded_model, embedded_tokenizer)


def constrained(max_tokens=96, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def reference(embedded_hf_model, embedded_tokenizer):
    """transformers' greedy generate with xgrammar's logits processor, one prompt at a time."""
    info = xgr.TokenizerInfo.from_huggingface(embedded_tokenizer, vocab_size=embedded_hf_model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON), max_whitespace_cnt=1)
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([embedded_tokenizer.encode(prompt)])
        with torch.no_grad():
            seq = embedded_hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96,
                                             do_sample=False, pad_token_id=2,
                                             logits_processor=[LogitsProcessor(compiled)])
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def test_greedy_json_schema_matches_transformers_with_xgrammar(llm, reference):
    outputs = llm.generate(PROMPTS, constrained(json=PERSON), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    for o in outputs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        assert o.outputs[0].finish_reason == "stop"
    assert_all_free(llm)


def test_sampled_outputs_always_parse(llm):
    """32 sampled requests at temperature 1, with n = 2 each: every sample is valid."""
    params = [SamplingParams(n=2, max_tokens=128, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputsParams(json=PERSON)) for i in range(32)]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(32)], params, use_tqdm=False)
    texts = [c.text for o in outputs for c in o.outputs]
    assert len(texts) == 64
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 16  # sampled, not one answer repeated
    # n = 2 samples of one request follow their own grammar states: they differ somewhere.
    assert any(o.outputs[0].text != o.outputs[1].text for o in outputs)
    assert_all_free(llm)


def test_free_rows_are_untouched_by_constrained_rows_in_their_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [constrained(json=PERSON)] * len(PROMPTS),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[len(PROMPTS):]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_grammar_state_survives_preemption(embedded_model, embedded_tokenizer, llm):
    """A pool that fits one sequence at a time: requests are preempted and recomputed mid-JSON;
    their grammar has accepted exactly their output tokens, so they finish as they would have."""
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, constrained(json=PERSON), use_tqdm=False)]
    tight = make_llm(embedded_model, embedded_tokenizer, block_size=2, num_kv_blocks=40, max_model_len=80,
                     enable_prefix_caching=False)
    outputs = tight.generate(PROMPTS, constrained(json=PERSON), use_tqdm=False)
    assert tight.llm_engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_free(tight)


@pytest.mark.parametrize("spec,check", [
    ({"choice": ["yes", "no", 'it "depends"']}, lambda t: t in ("yes", "no", 'it "depends"')),
    ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
    ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    ({"json": PERSON, "disable_any_whitespace": True},  # no free whitespace: exactly json.dumps' form
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None and json.dumps(json.loads(t), ensure_ascii=False) == t),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "tag", "begin": "<person>", "end": "</person>",
                                                              "content": {"type": "json_schema", "json_schema": PERSON,
                                                                          "max_whitespace_cnt": 1}}}},
     lambda t: t.startswith("<person>") and t.endswith("</person>")
     and jsonschema.validate(json.loads(t.removeprefix("<person>").removesuffix("</person>")), PERSON) is None),
], ids=["choice", "regex", "grammar", "compact_json", "structural_tag"])
def test_each_kind_of_constraint(llm, spec, check):
    params = SamplingParams(n=2, max_tokens=128, temperature=0.8, seed=7,
                            structured_outputs=StructuredOutputsParams(**spec))
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample
            assert check(sample.text), sample.text
    assert_all_free(llm)


def test_a_structural_tag_in_vllms_older_form_is_the_triggered_tags_it_means(llm):
    """`structures` and `triggers` (vLLM's first form), as JSON text: free text, and a tag once its
    trigger is written. Greedy, both forms give the same output."""
    legacy = {"structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}], "triggers": ["<person>"]}
    tags = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<person>"], "tags": [
        {"type": "tag", "begin": "<person>", "content": {"type": "json_schema", "json_schema": PERSON},
         "end": "</person>"}]}}
    prompts = ["Describe a person between <person> tags:"]
    older = llm.generate(prompts, constrained(max_tokens=24, structural_tag=json.dumps(legacy)), use_tqdm=False)
    newer = llm.generate(prompts, constrained(max_tokens=24, structural_tag=tags), use_tqdm=False)
    assert older[0].outputs[0].text == newer[0].outputs[0].text
    assert_all_free(llm)


def test_json_object_is_any_object(llm):
    """An object of any shape has no length bound: the samples that end, end as a JSON object."""
    params = SamplingParams(n=2, max_tokens=96, temperature=0.8, seed=3,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    samples = [s for o in llm.generate(PROMPTS, params, use_tqdm=False) for s in o.outputs]
    assert all(s.text.startswith("{") for s in samples)
    ended = [s for s in samples if s.finish_reason == "stop"]
    assert ended
    assert all(isinstance(json.loads(s.text), dict) for s in ended)


@pytest.mark.parametrize("spec,message", [
    ({"json": {"type": "bogus"}}, "Unsupported type"),
    ({"regex": "(ab"}, "parenthesis"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    ({"structural_tag": {"type": "structural_tag"}}, "format"),
    ({"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}'}, "begin, schema and end"),
])
def test_a_spec_that_cannot_compile_is_a_value_error_naming_it(llm, spec, message):
    with pytest.raises(ParameterError, match=message) as info:
        llm.generate(PROMPTS[:1], constrained(**spec), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert "cannot be compiled" in str(info.value) and "/project/" not in str(info.value)
    assert_all_free(llm)
    assert llm.generate(PROMPTS[:1], constrained(max_tokens=4, json=PERSON), use_tqdm=False)  # still serving


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one"),
    ({"json": PERSON, "regex": "a"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
    ({"structural_tag": "{not json"}, "structural_tag is not valid JSON"),
    ({"structural_tag": ["<a>"]}, "structural_tag must be a structural tag"),
    ({"json": PERSON, "structural_tag": "{}"}, "exactly one"),
])
def test_bad_structured_outputs_params(kwargs, message):
    with pytest.raises(ParameterError, match=message):
        StructuredOutputsParams(**kwargs)


def test_the_engine_imports_xgrammar_only_when_a_grammar_needs_it():
    """xgrammar takes about a second to import: importing the engine and the server does not import
    it (a fresh process, so that no other test's import counts); checking a grammar does."""
    code = ("import sys; import pagedserve.entrypoints.llm, pagedserve.entrypoints.openai.api_server; "
            "assert 'xgrammar' not in sys.modules, 'imported at start'; "
            "from pagedserve.engine.structured_output import check_grammar; "
            "from pagedserve.sampling_params import StructuredOutputsParams; "
            "check_grammar(StructuredOutputsParams(regex='a+')); assert 'xgrammar' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
