"""LoRA adapters in the OpenAI server, through the real `openai` client on loopback: a request's
`model` picks the base model or an adapter, whose greedy answers equal the offline engine's under
the same adapter; an unknown model is OpenAI's 404; /v1/models lists the adapters with their parent;
adapters load and unload at runtime (behind a flag) without disturbing the requests that stream
meanwhile; a bad adapter is a 400 saying why at runtime, and stops the server at start: files above
their bounds, special files, paths the system refuses and values that are not finite among them,
each refused at once while a neighbour streams on."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file
from server_harness import Server, serve

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import build_parser, server_kwargs
from pagedserve.entrypoints.llm import LLM
from pagedserve.entrypoints.openai.api_server import build_app
from pagedserve.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels, parse_lora_module
from pagedserve.lora import manager as lora_manager
from pagedserve.lora.files import shown
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.lora.lora_fixtures import make_peft_adapter

MODEL = "odd-base"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def adapters(odd_checkpoint, tmp_path_factory) -> dict[str, str]:
    """Adapters by name -> directory; "wide" has a rank above the servers' max_lora_rank."""
    _, hf_model = odd_checkpoint
    root = tmp_path_factory.mktemp("adapters")
    made = {"alpha": dict(rank=8, alpha=16, seed=1),
            "beta": dict(rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=2),
            "gamma": dict(rank=4, alpha=2, targets=("gate_proj", "up_proj", "down_proj"), use_rslora=True, seed=3),
            "wide": dict(rank=32, alpha=64, seed=4)}
    return {name: str(make_peft_adapter(hf_model, root / name, **options)) for name, options in made.items()}


@pytest.fixture(scope="module")
def offline_lora(odd_checkpoint) -> LLM:
    return LLM(str(odd_checkpoint[0]), num_kv_blocks=128, **LORA)


def offline_adapter(adapters: dict[str, str], name: str | None) -> LoRARequest | None:
    """The adapter `name` for the offline engine (ids of its own: the server's need not match)."""
    return None if name is None else LoRARequest(name, 100 + sorted(adapters).index(name), adapters[name])


def expected(offline: LLM, adapters, name: str | None, max_tokens=12, **params):
    """The offline engine's greedy completion of PROMPT under adapter `name` (None: the base model)."""
    return offline.generate(PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0, **params), use_tqdm=False,
                            lora_request=offline_adapter(adapters, name))[0].outputs[0]


def expected_chat(offline: LLM, adapters, name: str | None, max_tokens=12):
    return offline.chat(MESSAGES, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False,
                        lora_request=offline_adapter(adapters, name))[0].outputs[0]


@pytest.fixture(scope="module")
def lora_server(odd_checkpoint, adapters):
    """alpha and beta served from the start, runtime loading on; the core on a thread."""
    engine = LLMEngine(EngineConfig(model=str(odd_checkpoint[0]), num_kv_blocks=256, **LORA))
    async_engine = AsyncLLM.from_llm_engine(engine)
    async_engine.start()
    try:
        modules = [LoRAModulePath("alpha", adapters["alpha"]), LoRAModulePath("beta", adapters["beta"])]
        models = OpenAIServingModels(async_engine, MODEL, modules, base_model_path=str(odd_checkpoint[0]))
        with serve(build_app(async_engine, models, allow_runtime_lora_updating=True)) as url:
            yield Server(url, engine, async_engine)
    finally:
        async_engine.shutdown()


def post(server: Server, route: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)


def test_a_request_by_adapter_name_gets_the_adapters_output(lora_server, offline_lora, adapters):
    client = lora_server.client()
    answers = {}
    for name in (None, "alpha", "beta"):
        want = expected(offline_lora, adapters, name)
        got = client.completions.create(model=name or MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.text and got.model == (name or MODEL)
        answers[name] = got
    assert len({a.choices[0].text for a in answers.values()}) == 3  # each adapter changes the output
    assert len({a.system_fingerprint for a in answers.values()}) == 3

    stream = client.completions.create(model="beta", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answers["beta"].choices[0].text
    assert {c.model for c in chunks} == {"beta"}

    want = expected_chat(offline_lora, adapters, "alpha")
    chat = client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want.text and chat.model == "alpha"
    chunks = list(client.chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert {c.model for c in chunks} == {"alpha"}

    response = client.responses.create(model="alpha", input=MESSAGES[0]["content"], max_output_tokens=12,
                                       temperature=0)
    assert response.output_text == want.text and response.model == "alpha"
    base = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0)
    assert base.output_text == expected_chat(offline_lora, adapters, None).text


def test_requests_for_different_adapters_share_steps(lora_server, offline_lora, adapters):
    """The base model and two adapters at once (max_loras 2), twice each: every answer is its own model's."""
    names = [None, "alpha", "beta"] * 2

    async def run():
        client = lora_server.async_client()
        return await asyncio.gather(*(client.completions.create(model=name or MODEL, prompt=PROMPT, max_tokens=16,
                                                                temperature=0) for name in names))

    answers = asyncio.run(run())
    for name, got in zip(names, answers):
        assert got.choices[0].text == expected(offline_lora, adapters, name, max_tokens=16).text


def test_an_unknown_model_is_openais_404(lora_server):
    client = lora_server.client()
    error = {"message": "The model `nope` does not exist.", "type": "invalid_request_error", "param": "model",
             "code": "model_not_found"}
    calls = [lambda: client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
             lambda: client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2),
             lambda: client.responses.create(model="nope", input="Hi", max_output_tokens=2),
             lambda: client.models.retrieve("nope")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and e.value.body == error


def test_models_lists_the_adapters_with_their_parent(lora_server, adapters, odd_checkpoint):
    client = lora_server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL, "alpha", "beta"]
    assert cards[MODEL].root == str(odd_checkpoint[0]) and cards[MODEL].parent is None
    for name in ("alpha", "beta"):
        assert (cards[name].root, cards[name].parent, cards[name].object) == (adapters[name], MODEL, "model")
    alpha = client.models.retrieve("alpha")
    assert (alpha.id, alpha.root, alpha.parent) == ("alpha", adapters["alpha"], MODEL)
    assert client.models.retrieve(MODEL).parent is None


def test_load_use_and_unload_at_runtime_while_others_stream(lora_server, offline_lora, adapters):
    """gamma is loaded, streams a long answer, and is unloaded meanwhile; a base stream runs beside it.
    Both streams end normally with the offline engine's answers; afterwards gamma is a 404."""
    long = dict(max_tokens=200, ignore_eos=True)

    async def stream(client, model: str) -> tuple[str, str]:
        chunks = await client.completions.create(model=model, prompt=PROMPT, temperature=0, stream=True,
                                                 max_tokens=long["max_tokens"], extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in chunks:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        client = lora_server.async_client()
        async with httpx.AsyncClient(base_url=f"{lora_server.url}/v1", timeout=60) as http:
            loaded = await http.post("/load_lora_adapter", json={"lora_name": "gamma", "lora_path": adapters["gamma"]})
            assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'gamma' added successfully.")
            base = asyncio.ensure_future(stream(client, MODEL))
            gamma = asyncio.ensure_future(stream(client, "gamma"))
            deadline = time.monotonic() + 60
            while lora_server.metrics()["vllm:num_requests_running"] < 2:  # both are generating
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            unloaded = await http.post("/unload_lora_adapter", json={"lora_name": "gamma"})
            assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'gamma' removed successfully.")
            running_at_unload = lora_server.metrics()["vllm:num_requests_running"]
            return await base, await gamma, running_at_unload

    base, gamma, running_at_unload = asyncio.run(run())
    assert running_at_unload >= 1  # the unload happened while they streamed
    assert base == (expected(offline_lora, adapters, None, **long).text, "length")
    assert gamma == (expected(offline_lora, adapters, "gamma", **long).text, "length")
    with pytest.raises(openai.NotFoundError):
        lora_server.client().completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
    assert [m.id for m in lora_server.client().models.list().data] == [MODEL, "alpha", "beta"]


def test_load_inplace_replaces_an_adapter_under_its_name(lora_server, offline_lora, adapters):
    client = lora_server.client()
    assert post(lora_server, "load_lora_adapter", lora_name="delta", lora_path=adapters["gamma"]).status_code == 200
    got = client.completions.create(model="delta", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected(offline_lora, adapters, "gamma").text
    replaced = post(lora_server, "load_lora_adapter", lora_name="delta", lora_path=adapters["alpha"], load_inplace=True)
    assert replaced.status_code == 200
    got = client.completions.create(model="delta", prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == expected(offline_lora, adapters, "alpha").text
    assert client.models.retrieve("delta").root == adapters["alpha"]
    assert post(lora_server, "unload_lora_adapter", lora_name="delta").status_code == 200


def test_two_loads_of_one_name_at_once_serve_one_adapter(lora_server, adapters):
    async def run():
        async with httpx.AsyncClient(base_url=f"{lora_server.url}/v1", timeout=60) as http:
            return await asyncio.gather(*(http.post("/load_lora_adapter", json={"lora_name": "zeta", "lora_path": path})
                                          for path in (adapters["alpha"], adapters["beta"])))

    assert sorted(r.status_code for r in asyncio.run(run())) == [200, 400]
    assert [m.id for m in lora_server.client().models.list().data] == [MODEL, "alpha", "beta", "zeta"]
    assert post(lora_server, "unload_lora_adapter", lora_name="zeta").status_code == 200


def test_a_bad_load_is_a_400_saying_why(lora_server, adapters, tmp_path):
    def refused(status: int, param: str, **body) -> str:
        r = post(lora_server, body.pop("route", "load_lora_adapter"), **body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        return error["message"]

    missing = str(tmp_path / "missing")
    assert "directory" in refused(400, "lora_path", lora_name="x", lora_path=missing)
    wide = refused(400, "lora_path", lora_name="x", lora_path=adapters["wide"])
    assert "max_lora_rank" in wide and "32" in wide and "16" in wide
    assert refused(400, "lora_name", lora_name="alpha", lora_path=adapters["gamma"]) == \
        "The lora adapter 'alpha' has already been loaded."
    assert "base model" in refused(400, "lora_name", lora_name=MODEL, lora_path=adapters["gamma"])
    refused(400, "lora_name", lora_name="", lora_path=adapters["gamma"])
    refused(400, "lora_path", lora_name="x")
    assert refused(404, "lora_name", route="unload_lora_adapter", lora_name="x") == \
        "The lora adapter 'x' cannot be found."
    assert [m.id for m in lora_server.client().models.list().data] == [MODEL, "alpha", "beta"]  # nothing changed


WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def poison(value: float):
    """A damage: one of q_proj's lora_B values set to `value`."""
    def damage(path: Path) -> None:
        tensors = load_file(path / WEIGHTS)
        tensors[Q_B][0, 0] = value
        save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    return damage


def replace_file(name: str, make):
    """A damage: the adapter's file `name` made anew by make(its path)."""
    def damage(path: Path) -> None:
        (path / name).unlink()
        make(path / name)
    return damage


def edit_config(**settings):
    """A damage: the adapter's config with `settings` in it."""
    def damage(path: Path) -> None:
        config = path / CONFIG
        config.write_text(json.dumps({**json.loads(config.read_text()), **settings}))
    return damage


def long_header(file: Path) -> None:
    file.write_bytes(struct.pack("<Q", 52_000_000))  # a header of 52 MB
    os.truncate(file, 8 + 52_000_000)  # (sparse: as long as it claims, made at once)


def many_tensors(file: Path) -> None:
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(5000)}
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * 5000))


@pytest.fixture(scope="module")
def bad_adapters(adapters, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (a bad lora_path, a pattern its refusal matches): copies of alpha with one thing
    wrong, and paths the system refuses."""
    root = tmp_path_factory.mktemp("bad-adapters")
    damages = {
        "config-2GiB": (lambda path: os.truncate(path / CONFIG, 2 << 30),
                        r"adapter_config\.json is 2,147,483,648 bytes, above the bound of 1,048,576 bytes"),
        "header-52MB": (replace_file(WEIGHTS, long_header),
                        r"adapter_model\.safetensors's header is 52,000,000 bytes, above the bound of [\d,]+ bytes"),
        "5000-tensors": (replace_file(WEIGHTS, many_tensors), r"holds 5,000 tensors, above the bound of 368"),
        "weights-environ": (replace_file(WEIGHTS, lambda file: file.symlink_to("/proc/self/environ")),
                            r"adapter_model\.safetensors is not a valid safetensors file: it is 0 bytes long"),
        "config-mem": (replace_file(CONFIG, lambda file: file.symlink_to("/proc/self/mem")),
                       r"cannot read adapter_config\.json: Input/output error \(EIO\)"),
        "weights-fifo": (replace_file(WEIGHTS, os.mkfifo), r"adapter_model\.safetensors is a named pipe \(FIFO\)"),
        "config-fifo": (replace_file(CONFIG, os.mkfifo), r"adapter_config\.json is a named pipe \(FIFO\)"),
        "costly-pattern": (edit_config(rank_pattern={"(.*)*(.*)*(.*)*z": 4}),  # `re` would take for ever
                           r"rank_pattern key '\(\.\*\)\*\(\.\*\)\*\(\.\*\)\*z' is a regular expression too costly"),
        "flag-pattern": (edit_config(rank_pattern={"(?i)q_proj": 4}), r"global flags not at the start"),
        "target-number": (edit_config(target_modules=5), r"target_modules must be a list of module names or one"),
        "nan": (poison(float("nan")), rf"tensor '{Q_B}' holds values that are not finite \(NaN or infinity\)"),
        "inf": (poison(float("-inf")), rf"tensor '{Q_B}' holds values that are not finite \(NaN or infinity\)"),
    }
    made = {}
    for name, (damage, pattern) in damages.items():
        shutil.copytree(adapters["alpha"], root / name)
        damage(root / name)
        made[name] = (str(root / name), pattern)
    made["5000-characters"] = (str(root / ("a" * 5000)), r"cannot be opened: File name too long \(ENAMETOOLONG\)")
    made["through-a-file"] = (str(root / "nan" / CONFIG / "adapter"),
                              r"does not exist \(a part of the path is not a directory\)")
    return made


def assert_names_the_path_and_why(message: str, path: str, pattern: str) -> None:
    assert message.startswith(f"LoRA adapter {shown(path)}: ") and re.search(pattern, message), message
    assert len(message) < 1000  # a long path is shortened, not quoted whole


def test_bad_adapter_files_and_paths_are_400s_naming_them(lora_server, bad_adapters):
    for name, (path, pattern) in bad_adapters.items():
        r = post(lora_server, "load_lora_adapter", lora_name=name, lora_path=path)
        assert r.status_code == 400, (name, r.text)
        error = r.json()["error"]
        assert (error["param"], error["type"]) == ("lora_path", "invalid_request_error"), name
        assert_names_the_path_and_why(error["message"], path, pattern)
    assert [m.id for m in lora_server.client().models.list().data] == [MODEL, "alpha", "beta"]
    assert httpx.get(f"{lora_server.url}/health").json() == {"status": "ok"}


def test_an_adapter_replaced_after_its_load_is_refused_when_the_core_reads_it(lora_server, adapters, tmp_path):
    """The API process checks every value at the load, then drops them; the core reads the adapter
    for itself when a request first needs it, with the same checks, so a file replaced in between
    serves nothing."""
    path = shutil.copytree(adapters["alpha"], tmp_path / "swapped")
    assert post(lora_server, "load_lora_adapter", lora_name="swapped", lora_path=str(path)).status_code == 200
    poison(float("nan"))(path)
    r = post(lora_server, "completions", model="swapped", prompt=PROMPT, max_tokens=4)
    assert r.status_code == 400 and f"tensor '{Q_B}' holds values that are not finite" in r.json()["error"]["message"]
    assert post(lora_server, "unload_lora_adapter", lora_name="swapped").status_code == 200


def test_a_load_touches_the_adapters_files_only_off_the_event_loop(lora_server, adapters, tmp_path, monkeypatch):
    """Every stat, open and path resolution of the adapter, at its load and at a request under it,
    runs on a thread without an event loop (the route's executor, the core's thread)."""
    path = str(shutil.copytree(adapters["gamma"], tmp_path / "watched"))
    calls = []

    def watched(fn):
        def call(target, *args, **kwargs):
            if str(target).startswith(path):
                try:
                    asyncio.get_running_loop()
                    calls.append((fn.__name__, "on the event loop"))
                except RuntimeError:
                    calls.append((fn.__name__, "off it"))
            return fn(target, *args, **kwargs)
        return call

    for name in ("stat", "open"):
        monkeypatch.setattr(os, name, watched(getattr(os, name)))
    monkeypatch.setattr(os.path, "realpath", watched(os.path.realpath))
    assert post(lora_server, "load_lora_adapter", lora_name="watched", lora_path=path).status_code == 200
    assert post(lora_server, "completions", model="watched", prompt=PROMPT, max_tokens=2).status_code == 200
    assert post(lora_server, "unload_lora_adapter", lora_name="watched").status_code == 200
    assert {"stat", "open", "realpath"} <= {name for name, _ in calls}
    assert {where for _, where in calls} == {"off it"}


@pytest.fixture(scope="module")
def crowded_adapter(adapters, tmp_path_factory) -> str:
    """gamma, in a directory with 100,000 other files."""
    path = tmp_path_factory.mktemp("crowded") / "gamma"
    shutil.copytree(adapters["gamma"], path)
    for i in range(100_000):
        os.close(os.open(path / f"checkpoint-{i:06d}.json", os.O_CREAT | os.O_WRONLY, 0o644))
    return str(path)


@pytest.mark.timing
def test_bad_loads_stall_neither_a_neighbour_nor_health(lora_server, bad_adapters, crowded_adapter, offline_lora,
                                                         adapters):
    """While a base-model stream runs and /health is polled: every bad load above, then an adapter
    in a directory of 100,000 files (loaded, and a request served under it: nothing lists the
    directory). The stream's longest gap between chunks and the slowest /health stay under 1 s."""
    want = expected(offline_lora, adapters, "gamma").text

    async def neighbour(client, done: asyncio.Event, gaps: list[float]) -> None:
        while not done.is_set():
            last = time.monotonic()
            stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                now = time.monotonic()
                gaps.append(now - last)
                last = now

    async def poll_health(http, done: asyncio.Event, waits: list[float]) -> None:
        while not done.is_set():
            start = time.monotonic()
            assert (await http.get("/health")).status_code == 200
            waits.append(time.monotonic() - start)
            await asyncio.sleep(0.05)

    async def run():
        client, done, gaps, waits = lora_server.async_client(), asyncio.Event(), [], []
        async with httpx.AsyncClient(base_url=lora_server.url, timeout=120) as http:
            tasks = [asyncio.ensure_future(neighbour(client, done, gaps)),
                     asyncio.ensure_future(poll_health(http, done, waits))]
            while not gaps:
                await asyncio.sleep(0.01)
            statuses = {}
            for name, (path, _) in bad_adapters.items():
                r = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                statuses[name] = r.status_code
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "crowded", "lora_path": crowded_adapter})
            statuses["crowded"] = r.status_code
            answer = await client.completions.create(model="crowded", prompt=PROMPT, max_tokens=12, temperature=0)
            statuses["unload"] = (await http.post("/v1/unload_lora_adapter", json={"lora_name": "crowded"})).status_code
            done.set()
            await asyncio.gather(*tasks)
        return statuses, answer.choices[0].text, gaps, waits

    statuses, text, gaps, waits = asyncio.run(run())
    assert statuses == {**dict.fromkeys(bad_adapters, 400), "crowded": 200, "unload": 200}
    assert text == want
    assert max(gaps) < 1.0, f"the neighbour's longest gap: {max(gaps):.2f} s"
    assert max(waits) < 1.0, f"the slowest /health: {max(waits):.2f} s"


def test_offline_add_lora_refuses_them_too_and_reads_an_adapter_once(offline_lora, bad_adapters, adapters, tmp_path,
                                                                     monkeypatch):
    for i, (name, (path, pattern)) in enumerate(bad_adapters.items()):
        with pytest.raises(ValueError) as e:
            offline_lora.add_lora(LoRARequest(name, 500 + i, path))
        assert_names_the_path_and_why(str(e.value), path, pattern)
    with pytest.raises(ValueError, match="not finite"):  # before any prompt is queued
        offline_lora.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False,
                              lora_request=LoRARequest("nan", 600, bad_adapters["nan"][0]))

    want = expected(offline_lora, adapters, "gamma").text
    reads = []
    load = lora_manager.load_adapter
    monkeypatch.setattr(lora_manager, "load_adapter", lambda path, *args: reads.append(path) or load(path, *args))
    gamma = LoRARequest("gamma-copy", 700, str(shutil.copytree(adapters["gamma"], tmp_path / "gamma")))
    assert offline_lora.add_lora(gamma) and reads == [gamma.lora_path]
    got = offline_lora.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False,
                                lora_request=gamma)
    assert got[0].outputs[0].text == want and reads == [gamma.lora_path]  # the weights add_lora read
    offline_lora.remove_lora(700)


def test_without_the_flag_the_routes_do_not_exist(lora_server, adapters):
    models = OpenAIServingModels(lora_server.async_engine, MODEL, [LoRAModulePath("alpha", adapters["alpha"])])
    with serve(build_app(lora_server.async_engine, models)) as url:
        for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": adapters["gamma"]}),
                            ("unload_lora_adapter", {"lora_name": "alpha"})):
            r = httpx.post(f"{url}/v1/{route}", json=body)
            assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL, "alpha"]
        paths = httpx.get(f"{url}/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths and "/v1/load_lora_adapter" in \
            httpx.get(f"{lora_server.url}/openapi.json").json()["paths"]


def test_lora_modules_take_vllms_two_forms():
    assert parse_lora_module("a=/p/a") == LoRAModulePath("a", "/p/a")
    assert parse_lora_module('{"name": "b", "path": "/p/b", "base_model_name": "m"}') == \
        LoRAModulePath("b", "/p/b", "m")
    for bad in ("a", "=/p", "a=", "{", '{"name": "b"}', '{"name": "b", "path": "/p", "rank": 8}', "[1]"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/p/a",
                                      '{"name": "b", "path": "/p/b"}', "--lora-modules", "c=/p/c", "--max-loras", "4",
                                      "--max-lora-rank", "8", "--allow-runtime-lora-updating"])
    options = server_kwargs(args)
    assert [m.name for m in options["lora_modules"]] == ["a", "b", "c"] and options["allow_runtime_lora_updating"]
    assert (args.max_loras, args.max_lora_rank) == (4, 8)
    for flags in (["--lora-modules", "a=/p/a"], ["--allow-runtime-lora-updating"]):
        with pytest.raises(ValueError, match=f"{flags[0]} needs --enable-lora"):
            server_kwargs(build_parser().parse_args(["serve", *flags]))


def test_a_bad_adapter_at_start_is_refused_saying_which(lora_server, adapters, bad_adapters, tmp_path):
    engine = lora_server.async_engine

    def refused(*modules: LoRAModulePath) -> str:
        with pytest.raises(ValueError) as e:
            OpenAIServingModels(engine, MODEL, modules)
        return str(e.value)

    assert refused(LoRAModulePath("a", str(tmp_path / "missing"))).startswith("--lora-modules a: ")
    assert "max_lora_rank" in refused(LoRAModulePath("w", adapters["wide"]))
    for name in ("nan", "config-2GiB", "weights-fifo"):
        path, pattern = bad_adapters[name]
        message = refused(LoRAModulePath(name, path))
        assert message.startswith(f"--lora-modules {name}: LoRA adapter {path}: ") and re.search(pattern, message)
    twice = refused(LoRAModulePath("a", adapters["alpha"]), LoRAModulePath("a", adapters["beta"]))
    assert twice == "--lora-modules a: The lora adapter 'a' has already been loaded."
    assert "base model" in refused(LoRAModulePath(MODEL, adapters["alpha"]))
    assert "not the served model" in refused(LoRAModulePath("a", adapters["alpha"], "other"))
    assert OpenAIServingModels(engine, MODEL, [LoRAModulePath("a", adapters["alpha"], MODEL)]).adapters == \
        [LoRARequest("a", 1, adapters["alpha"])]


@pytest.mark.slow
def test_serve_stops_at_a_bad_adapter_with_an_error_naming_it(odd_checkpoint, adapters, tmp_path):
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(odd_checkpoint[0]),
           "--port", "0", "--enable-lora", "--lora-modules", f"alpha={adapters['alpha']}",
           f"bad={tmp_path / 'missing'}"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error: --lora-modules bad: " in done.stderr
    assert "Uvicorn running" not in done.stderr
    done = subprocess.run([*cmd[:8], "--lora-modules", "a=/p"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error: --lora-modules needs --enable-lora" in done.stderr


@pytest.mark.slow
def test_serve_with_lora_modules_end_to_end(odd_checkpoint, offline_lora, adapters):
    """`pagedserve serve` as documented, the engine core in its own process: adapters cross to it."""
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(odd_checkpoint[0]),
           "--port", "0", "--num-kv-blocks", "128", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
           "--lora-modules", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:  # until uvicorn says where it listens
            lines.append(line)
            if match := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                break
        else:
            raise AssertionError("the server did not start:\n" + "".join(lines))
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        client = openai.OpenAI(base_url=f"{match.group(1)}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [str(odd_checkpoint[0]), "alpha", "beta"]
        for name in ("alpha", "beta", None):
            got = client.completions.create(model=name or str(odd_checkpoint[0]), prompt=PROMPT, max_tokens=12,
                                            temperature=0)
            assert got.choices[0].text == expected(offline_lora, adapters, name).text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_ray_ingress_carries_the_adapter_to_a_replica_and_keys_its_prefixes_apart(odd_checkpoint, adapters):
    pytest.importorskip("ray")
    from pagedserve.entrypoints.openai.prefix_router import PrefixAwareRouter
    from pagedserve.entrypoints.openai.ray_app import ReplicaPool

    sent = []

    class Handle:  # the replicas' DeploymentHandle, as ReplicaPool uses it
        def options(self, stream):
            return self

        @property
        def generate(self):
            return self

        def remote(self, request):
            sent.append(request)

            async def outputs():
                yield SimpleNamespace(finished=False)

            return outputs()

    config = EngineConfig(model=str(odd_checkpoint[0]), **LORA)
    pool = ReplicaPool(Handle(), None, {"max_model_len": 256, "vocab_size": 49153, "max_num_seqs": 8}, config)
    alpha = LoRARequest("alpha", 1, adapters["alpha"])

    async def run(adapter):
        return [o async for o in pool.generate(list(range(40)), SamplingParams(), "r", lora_request=adapter)]

    assert len(asyncio.run(run(alpha))) == 1 and sent[-1].lora_request == alpha
    asyncio.run(run(None))
    assert sent[-1].lora_request is None
    pool.check_lora(alpha)
    with pytest.raises(ValueError, match="max_lora_rank"):
        pool.check_lora(LoRARequest("wide", 2, adapters["wide"]))

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)  # only its hashing, no Ray Serve around it
    router.block_size, router.max_blocks = 16, 8

    def hashes(request):
        return router._hashes(SimpleNamespace(args=(request,)))

    base, under_alpha = hashes(sent[-1]), hashes(sent[0])
    assert len(base) == len(under_alpha) == 2 and not set(base) & set(under_alpha)
    beta = copy.copy(sent[0])
    beta.lora_request = LoRARequest("beta", 2, adapters["beta"])
    assert not set(hashes(beta)) & set(under_alpha)
