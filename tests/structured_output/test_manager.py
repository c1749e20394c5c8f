"""Structured output on the real embedded model: every constrained output parses against its
schema, even sampled from the 135M model; greedy constrained decoding equals transformers' with
xgrammar's own logits processor; free rows in a mixed batch are untouched; the grammar state
survives preemption and is per sample for n > 1; a spec that cannot compile is a ValueError
naming structured_outputs; specs beyond grammar_check's limits and keywords xgrammar would not
enforce are refused before xgrammar sees them; grammars compile off the step loop (others keep
stepping, a late one fails its request, an abort drops the wait); nothing leaks."""

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


@pytest.mark.slow
def test_greedy_json_schema_matches_transformers_with_xgrammar(llm, reference):
    outputs = llm.generate(PROMPTS, constrained(json=PERSON), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    for o in outputs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
        assert o.outputs[0].finish_reason == "stop"
    assert_all_free(llm)


@pytest.mark.slow
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


@pytest.mark.slow
def test_free_rows_are_untouched_by_constrained_rows_in_their_batch(llm):
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(PROMPTS, free, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [constrained(json=PERSON)] * len(PROMPTS),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == [o.outputs[0].token_ids for o in alone]
    for o in mixed[len(PROMPTS):]:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


@pytest.mark.slow
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


@pytest.mark.slow
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
            "from pagedserve.structured_output.manager import check_grammar; "
            "from pagedserve.sampling_params import StructuredOutputsParams; "
            "check_grammar(StructuredOutputsParams(regex='a+')); assert 'xgrammar' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- limits, refusals, compiling off the step loop -------------------------------------------

def nested(depth: int, leaf: dict | None = None) -> dict:
    schema = leaf or {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("spec,message", [
    # 30,000 nested groups in a pattern killed the process inside xgrammar (SIGSEGV).
    ({"json": {"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000}}, "nests groups"),
    ({"regex": "(" * 3000 + "a" + ")" * 3000}, "nests groups"),
    ({"regex": "[" * 200 + "a" + "]" * 200}, None),  # a class holds no group: "[[[a]" is one class
    ({"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "nests parentheses"),
    ({"json": nested(300)}, "nests deeper than"),
    ({"json": json.dumps(nested(300))}, "nests deeper than"),
    ({"json": "[" * 100000 + "]" * 100000}, "nests deeper than"),
    ({"json": {"enum": ["x" * 1000] * 300}}, "characters long"),
])
def test_specs_beyond_the_limits_are_refused_before_xgrammar(spec, message):
    from pagedserve.structured_output.manager import check_grammar

    if message is None:
        check_grammar(StructuredOutputsParams(**spec))
        return
    with pytest.raises(ParameterError, match=message) as info:
        check_grammar(StructuredOutputsParams(**spec))
    assert info.value.param == "structured_outputs"


def test_real_schemas_are_far_within_the_limits():
    from pydantic import BaseModel

    from pagedserve.structured_output.manager import check_grammar

    class Leaf(BaseModel):
        tags: list[str]
        score: float | None = None

    class Node(BaseModel):
        name: str
        children: list[Node] = []
        leaf: Leaf | None = None

    check_grammar(StructuredOutputsParams(json=Node.model_json_schema()))  # $defs, $ref, anyOf
    check_grammar(StructuredOutputsParams(json=nested(40)))
    check_grammar(StructuredOutputsParams(regex=r"(\d{3})-((\d{2})|([a-z]+))+"))


@pytest.mark.parametrize("schema,what", [
    ({"not": {}}, '"not"'),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, '"not" at #/properties/a'),
    ({"$ref": "https://example.com/schema.json"}, '"$ref"'),
    ({"$defs": {"x": {"$anchor": "A", "type": "integer"}}, "$ref": "#A"}, '"$ref"'),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, '"uniqueItems"'),
    ({"type": "array", "contains": {"const": 5}}, '"contains"'),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, '"if"'),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, '"dependentRequired"'),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, '"allOf" of more than one'),
    ({"type": "string", "format": "password"}, '"format": "password"'),
])
def test_keywords_xgrammar_would_not_enforce_are_refused(schema, what):
    from pagedserve.structured_output.manager import check_grammar

    with pytest.raises(ParameterError, match="cannot enforce") as info:
        check_grammar(StructuredOutputsParams(json=schema))
    assert what in str(info.value)


@pytest.mark.parametrize("schema,message", [({"type": "object", "not": {}}, "cannot enforce"),
                                            (nested(300), "nests deeper than")])
def test_a_structural_tags_schemas_are_held_to_the_same_limits(schema, message):
    from pagedserve.structured_output.manager import check_grammar

    older = {"structures": [{"begin": "<a>", "schema": schema, "end": "</a>"}], "triggers": ["<a>"]}
    with pytest.raises(ParameterError, match=message):
        check_grammar(StructuredOutputsParams(structural_tag=older))
    older["structures"][0]["schema"] = {"type": "object"}
    check_grammar(StructuredOutputsParams(structural_tag=older))


def test_keyword_names_as_property_names_and_values_are_not_keywords():
    from pagedserve.structured_output.manager import check_grammar

    check_grammar(StructuredOutputsParams(json={
        "type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"not": 1}]}},
        "allOf": [{"required": ["not"]}], "$defs": {"d": {"type": "string", "format": "email"}}}))


def run_until_finished(engine: LLMEngine, request_ids: set[str], limit: float = 120.0) -> dict:
    import time

    finished, start = {}, time.monotonic()
    while not request_ids <= set(finished):
        assert time.monotonic() - start < limit, "requests did not finish"
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.fixture
def gated_build(llm, monkeypatch):
    """The manager's build, held until the test sets the event (a compile that takes long)."""
    import threading

    manager = llm.llm_engine.core.structured_output
    gate, started = threading.Event(), threading.Event()
    build = manager.build

    def slow_build(spec):
        started.set()
        gate.wait(30)
        return build(spec)

    monkeypatch.setattr(manager, "build", slow_build)
    monkeypatch.setattr(manager, "compile_timeout", 300.0)  # the gate decides, not the clock of a busy machine
    yield manager, gate, started
    gate.set()


@pytest.mark.slow
def test_a_compiling_grammar_holds_up_no_other_request(llm, gated_build):
    manager, gate, started = gated_build
    engine = llm.llm_engine
    engine.add_request("constrained", PROMPTS[0], constrained(max_tokens=8, json=PERSON))
    engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0.0))
    assert started.wait(30)
    done = run_until_finished(engine, {"free"})
    assert len(done["free"].outputs[0].token_ids) == 8
    assert engine.has_unfinished_requests() and engine.core.core_stats().num_waiting == 1
    gate.set()
    done = run_until_finished(engine, {"constrained"})
    assert done["constrained"].error is None and done["constrained"].outputs[0].token_ids
    assert_all_free(llm)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU priority is Linux's")
def test_grammars_compile_at_the_lowest_cpu_priority_and_the_step_loop_keeps_its_own(llm, monkeypatch):
    """A compile takes only what the steps leave of the cores: its thread runs at nice 19, under
    SCHED_IDLE."""
    import os
    import threading

    manager = llm.llm_engine.core.structured_output
    priorities = []
    build = manager.build

    def recording_build(spec):
        thread = threading.get_native_id()
        priorities.append((os.getpriority(os.PRIO_PROCESS, thread), os.sched_getscheduler(thread)))
        return build(spec)

    monkeypatch.setattr(manager, "build", recording_build)
    step_loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    engine = llm.llm_engine
    engine.add_request("low", PROMPTS[0], constrained(max_tokens=4, regex="[a-z]{2,4}"))
    done = run_until_finished(engine, {"low"})["low"]
    assert done.error is None and done.outputs[0].text
    assert priorities == [(19, os.SCHED_IDLE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == step_loop  # unchanged
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
    assert_all_free(llm)


@pytest.mark.slow
def test_a_cpu_step_pauses_while_a_grammar_compiles_and_only_then(llm, gated_build, monkeypatch):
    """While a request waits for its grammar, each step is followed by a pause of COMPILE_PAUSE x
    its time (the compile runs in it, not beside the step's threads); none once it has compiled."""
    import time

    import pagedserve.core.engine_core as engine_core

    manager, gate, started = gated_build
    pauses = []
    wait = engine_core.wait_for_futures

    def recording_wait(futures, timeout, return_when):
        pauses.append(timeout)
        return wait(futures, timeout, return_when)

    monkeypatch.setattr(engine_core, "wait_for_futures", recording_wait)
    engine = llm.llm_engine
    recent = engine.core._recent_steps  # earlier tests' steps would set the median
    monkeypatch.setattr(engine.core, "_recent_steps", type(recent)(maxlen=recent.maxlen))
    engine.add_request("constrained", PROMPTS[0], constrained(max_tokens=4, json=PERSON))
    engine.add_request("free", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0))
    assert started.wait(30)
    busies = []
    for _ in range(3):
        busy, start = engine.stats.busy_seconds, time.perf_counter()
        engine.step()
        busy, wall = engine.stats.busy_seconds - busy, time.perf_counter() - start
        busies.append(busy)
        typical = sorted(busies)[len(busies) // 2]
        assert pauses and pauses[-1] >= engine_core.COMPILE_PAUSE * min(busy, typical) > 0
        assert wall >= busy + pauses[-1] * 0.99  # the gate holds the compile: the pause runs to its end
    job = engine.core._grammar_jobs["constrained"]
    gate.set()
    job.future.result(30)
    pauses.clear()
    done = run_until_finished(engine, {"constrained", "free"})
    assert done["constrained"].error is None and len(done["free"].outputs[0].token_ids) == 12
    assert pauses == []  # nothing compiles: the steps run back to back
    assert_all_free(llm)


def test_a_step_the_machine_slowed_is_followed_by_the_recent_steps_pause_not_its_own(llm, monkeypatch):
    """The pause is COMPILE_PAUSE x the step's time, but at most the recent steps' median: a step that
    took 50x its usual time (a core taken by another job) is not made twice as long again."""
    from concurrent.futures import Future

    import pagedserve.core.engine_core as engine_core
    from pagedserve.structured_output.manager import GrammarJob

    core = llm.llm_engine.core
    pauses = []
    monkeypatch.setattr(engine_core, "wait_for_futures", lambda futures, timeout, return_when: pauses.append(timeout))
    monkeypatch.setitem(core._grammar_jobs, "compiling", GrammarJob(StructuredOutputsParams(regex="a"), 10.0, 0.0,
                                                                    Future()))
    monkeypatch.setattr(core, "_recent_steps", type(core._recent_steps)(maxlen=core._recent_steps.maxlen))
    for _ in range(8):
        core._pause_for_compiles(0.010)
    core._pause_for_compiles(0.500)
    core._pause_for_compiles(0.004)
    assert pauses == [engine_core.COMPILE_PAUSE * s for s in [0.010] * 8 + [0.010, 0.004]]


def test_a_grammar_past_its_time_limit_fails_its_request_naming_the_field(llm, gated_build, monkeypatch):
    manager, gate, started = gated_build
    monkeypatch.setattr(manager, "compile_timeout", 0.3)
    engine = llm.llm_engine
    engine.add_request("late", PROMPTS[0], constrained(max_tokens=8, regex="[a-z]+"))
    assert started.wait(30)
    done = run_until_finished(engine, {"late"})["late"]
    assert done.error_param == "structured_outputs" and "did not compile within 0.3 s" in done.error
    assert done.outputs[0].finish_reason == "error"
    assert_all_free(llm)


def test_aborting_a_request_that_waits_for_its_grammar_frees_it(llm, gated_build):
    manager, gate, started = gated_build
    engine = llm.llm_engine
    engine.add_request("running", PROMPTS[0], constrained(max_tokens=4, choice=["yes", "no"]))
    engine.add_request("queued", PROMPTS[0], constrained(max_tokens=4, choice=["a", "b"]))
    engine.add_request("queued-too", PROMPTS[0], constrained(max_tokens=4, choice=["c", "d"]))
    assert started.wait(30)
    queued_jobs = [engine.core._grammar_jobs[r] for r in ("queued", "queued-too")]
    for request_id in ("running", "queued", "queued-too"):
        engine.abort_request(request_id)
    assert not engine.core._grammar_jobs and not engine.has_unfinished_requests()
    assert any(job.future.cancelled() for job in queued_jobs)  # the pool has 2 threads: one never started
    assert engine.step() == []
    assert_all_free(llm)


@pytest.mark.parametrize("spec", [{"grammar": 'root ::= root "a"'}, {"regex": r"[^\s\S]"}])
def test_a_grammar_that_allows_no_output_fails_its_request(llm, spec):
    engine = llm.llm_engine
    engine.add_request("empty", PROMPTS[0], constrained(max_tokens=4, **spec))
    done = run_until_finished(engine, {"empty"})["empty"]
    assert done.error_param == "structured_outputs" and "allows no output" in done.error
    assert_all_free(llm)


def test_a_repeated_schema_compiles_once(llm):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(150)}}
    manager = llm.llm_engine.core.structured_output
    manager.build(StructuredOutputsParams(json=schema))
    compiler = manager._get_compiler()
    cached = compiler.get_cache_size_bytes()
    manager.build(StructuredOutputsParams(json=schema))
    assert compiler.get_cache_size_bytes() == cached  # the same spec: found, nothing compiled
    manager.build(StructuredOutputsParams(json=schema | {"required": ["p0"]}))
    assert compiler.get_cache_size_bytes() > cached  # another spec compiles and is kept


def test_a_grammar_is_timed_by_its_compiles_cpu_time_not_by_the_wall_clock():
    """A compile that waits for the CPU (a busy machine's steps come first) is not late until the
    request has waited MAX_WAIT_FACTOR times the limit; one that has used the limit's CPU time is."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pagedserve.structured_output.manager import MAX_WAIT_FACTOR, GrammarJob

    spec = StructuredOutputsParams(regex="a+")
    starved, costly = GrammarJob(spec, 0.2, time.monotonic()), GrammarJob(spec, 0.2, time.monotonic())
    release, waiting = threading.Event(), threading.Event()

    def wait(job):
        job.start_clock()
        waiting.set()
        release.wait(30)

    def burn(job):
        job.start_clock()
        while job.cpu_seconds() < 0.3:
            pass
        release.wait(30)

    with ThreadPoolExecutor(2) as pool:
        starved.future, costly.future = pool.submit(wait, starved), pool.submit(burn, costly)
        assert waiting.wait(30)
        deadline = time.monotonic() + 60
        while (costly.cpu_seconds() or 0.0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)
        cap = MAX_WAIT_FACTOR * 0.2
        assert not starved.overdue(starved.submitted + cap - 0.01)  # its thread took (almost) no CPU
        # (a margin over `cap`: `submitted + cap - submitted` may round to just under it)
        assert starved.overdue(starved.submitted + cap + 0.01)
        assert "the server is busy" in str(starved.timeout_error(starved.submitted + cap + 0.01))
        assert costly.overdue(costly.submitted)  # at once, by its CPU time
        message = str(costly.timeout_error(costly.submitted))
        assert "did not compile within 0.2 s of CPU time; simplify it" in message
        release.set()
    assert not costly.overdue(costly.submitted + cap)  # done: never late
