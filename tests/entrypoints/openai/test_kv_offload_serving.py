"""A real server with the KV tier, through the openai client: a restarted server serves a long system
prompt from the tier's files (usage says how many prompt tokens were cached, /metrics counts them),
with the reply the offline engine without the tier gives; FIFOs in place of the tier's files stall
nothing; the command line takes the tier's flags."""

from __future__ import annotations

import os
import time

import httpx
from server_harness import MODEL, read_metrics, serve_engine

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.cli import build_parser, engine_kwargs
from pagedserve.sampling_params import SamplingParams

SYSTEM = ("You are the assistant of a library that lends books, maps and recordings. " * 12).strip()


def chat(server, question: str):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)


def test_a_restarted_server_reads_the_system_prompt_from_the_tier(embedded_model, embedded_tokenizer, offline,
                                                                  tmp_path):
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=1024, kv_offload_dir=str(tmp_path)),
                         model=embedded_model, tokenizer=embedded_tokenizer)

    first = engine()
    with serve_engine(first) as server:
        assert chat(server, "When do you open?").usage.prompt_tokens_details.cached_tokens == 0
    first.shutdown()  # as a server's exit does: the pool's cached blocks are written to the tier
    with serve_engine(engine()) as server:  # a new engine: its pool is empty, the tier is not
        reply = chat(server, "Can I borrow a map?")
        cached = reply.usage.prompt_tokens_details.cached_tokens
        metrics = read_metrics(server.url)
    assert cached >= 128 and metrics["pagedserve:kv_offload_hits_total"] == cached
    expected = offline.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I borrow a map?"}],
                            SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert reply.choices[0].message.content == expected


def test_fifos_in_place_of_the_tiers_files_stall_nothing(embedded_model, embedded_tokenizer, offline, tmp_path):
    """Every block file replaced by a named pipe while the server runs (it indexed them at start): the
    reply is computed, at once, and /health answers."""
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(num_kv_blocks=256, max_model_len=1024, kv_offload_dir=str(tmp_path)),
                         model=embedded_model, tokenizer=embedded_tokenizer)

    first = engine()
    with serve_engine(first) as server:
        chat(server, "When do you open?")
    first.shutdown()
    fifos = sorted(tmp_path.glob("*/*.kvblock"))
    assert fifos
    with serve_engine(engine()) as server:
        for path in fifos:
            os.unlink(path)
            os.mkfifo(path)
        try:
            start = time.monotonic()
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Can I borrow a map?"}]
            reply = server.client(timeout=60).chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                                      temperature=0)
            elapsed = time.monotonic() - start
            health = httpx.get(f"{server.url}/health", timeout=10)
        finally:
            for path in fifos:  # a reader blocked in open() gets a writer, so that the server can stop
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
    expected = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens_details.cached_tokens == 0
    assert elapsed < 30 and health.status_code == 200


def test_the_command_line_takes_the_tier_settings(tmp_path):
    args = build_parser().parse_args(["serve", "--kv-offload-dir", str(tmp_path), "--kv-offload-bytes", "1000000",
                                      "--kv-offload-policy", "write_through", "--preemption-mode", "swap"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.kv_offload_dir, config.kv_offload_bytes, config.kv_offload_policy, config.preemption_mode) == \
        (str(tmp_path), 1_000_000, "write_through", "swap")
