"""The KV tier in the engine, on the real embedded model: greedy outputs with the tier (blocks read
back, requests swapped, a restart, a damaged file, a full disk, an unusable directory) are token for
token those without it, under preemption and chunked prefill, with a tiny pool and a tiny tier that
force every path; nothing leaks."""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.kv import hash_block
from pagedserve.offload import file_tier
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
rng = random.Random(0)
SYSTEM = [rng.randrange(100, 20000) for _ in range(48)]  # a shared system prompt of 12 blocks
USERS = [[rng.randrange(100, 20000) for _ in range(rng.randrange(5, 30))] for _ in range(6)]


def make_llm(embedded_model, embedded_tokenizer, **overrides) -> LLM:
    settings = dict(num_kv_blocks=512, max_model_len=256, block_size=BLOCK_SIZE) | overrides
    return LLM.from_engine(LLMEngine(EngineConfig(**settings), model=embedded_model, tokenizer=embedded_tokenizer))


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def two_turns(llm: LLM) -> list[list[int]]:
    """Six sessions: a first turn each, then a second on the first's context plus a new message."""
    first = [SYSTEM + user for user in USERS]
    answers = token_ids(generate(llm, first))
    second = [p + a + user[:7] for p, a, user in zip(first, answers, reversed(USERS))]
    return answers + token_ids(generate(llm, second))


def assert_all_free(llm: LLM) -> None:
    stats = llm.llm_engine.kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.total_blocks
    assert not llm.llm_engine.scheduler.has_unfinished()


def tier_of(llm: LLM) -> file_tier.FileTier:
    return llm.llm_engine.core.kv.tier


def block_hashes(tokens: list[int]) -> list[bytes]:
    """The chained hashes of the full blocks of `tokens`, as the prefix cache makes them."""
    hashes: list[bytes] = []
    for i in range(len(tokens) // BLOCK_SIZE):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
    return hashes


@pytest.fixture
def tier_io_threads(monkeypatch) -> list[threading.Thread]:
    """The threads that open the tier's files (reads and writes), as they do."""
    threads: list[threading.Thread] = []
    for name in ("_read_checked", "_write"):
        real = getattr(file_tier.FileTier, name)
        monkeypatch.setattr(file_tier.FileTier, name, lambda self, *args, real=real: threads.append(
            threading.current_thread()) or real(self, *args))
    return threads


def system_prompt_on_disk(embedded_model, embedded_tokenizer, directory) -> None:
    """A first engine computes the system prompt and writes it to the tier as it shuts down."""
    first = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(directory))
    generate(first, [SYSTEM + USERS[0]])
    first.shutdown()


@pytest.fixture(scope="module")
def expected(embedded_model, embedded_tokenizer):
    return two_turns(make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=False))


# A pool of 40 blocks holds about two of the sessions; the tiers hold fewer blocks than are sent to them.
SMALL_POOL = dict(num_kv_blocks=40, max_model_len=140, max_num_seqs=4)
TIER_BLOCK_FILE = 30 * 2 * 3 * BLOCK_SIZE * 64 * 4 + file_tier.HEADER.size  # the embedded model, float32


@pytest.mark.parametrize("policy, min_hits, preemption, chunk, tier_blocks", [
    ("write_through", 0, "recompute", None, 60),
    ("write_through", 0, "swap", 16, 60),
    ("evicted", 0, "recompute", 16, 40),
    ("evicted", 99, "swap", None, 20),  # only swap writes to the tier
])
def test_outputs_with_the_tier_are_those_without_it(embedded_model, embedded_tokenizer, expected, tmp_path,
                                                   tier_io_threads, policy, min_hits, preemption, chunk, tier_blocks):
    overrides = dict(SMALL_POOL, kv_offload_dir=str(tmp_path), kv_offload_bytes=tier_blocks * TIER_BLOCK_FILE,
                     kv_offload_policy=policy, kv_offload_min_hits=min_hits, preemption_mode=preemption)
    if chunk:
        overrides["max_num_batched_tokens"] = chunk
    llm = make_llm(embedded_model, embedded_tokenizer, **overrides)
    assert two_turns(llm) == expected
    m = llm.get_metrics()
    tier = tier_of(llm)
    tier.flush()
    assert m["kv_offload_stored_blocks"] > 0 and m["kv_offload_loaded_blocks"] > 0
    assert m["kv_offload_hit_tokens"] == m["kv_offload_loaded_blocks"] * BLOCK_SIZE
    assert m["preemptions"] > 0
    assert tier.num_stored > len(tier) == tier.capacity_blocks  # full: it evicted blocks to take new ones
    assert tier_io_threads and threading.main_thread() not in tier_io_threads  # no file I/O on the step loop
    assert_all_free(llm)
    llm.shutdown()


def test_a_restarted_engine_finds_the_prefixes_the_last_one_wrote(embedded_model, embedded_tokenizer, expected,
                                                                  tmp_path):
    first = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
    generate(first, [SYSTEM + USERS[0]])
    first.shutdown()  # pending blocks are written
    again = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
    (output,) = generate(again, [SYSTEM + USERS[1]])
    assert output.num_cached_tokens >= len(SYSTEM)
    assert token_ids([output]) == expected[1:2]
    assert_all_free(again)
    again.shutdown()


def test_a_damaged_file_is_computed_instead_with_a_log_line(embedded_model, embedded_tokenizer, expected,
                                                            tmp_path, caplog):
    first = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
    generate(first, [SYSTEM + USERS[0]])
    first.shutdown()
    tier_files = sorted(tmp_path.glob("*/*" + file_tier.SUFFIX))
    assert tier_files
    for path in tier_files:  # every file damaged: a bit flipped, and the last one cut short too
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x40
        path.write_bytes(bytes(raw[:-1] if path == tier_files[-1] else raw))
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        again = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
        (output,) = generate(again, [SYSTEM + USERS[1]])
    # the tier's own lines only: this test's directory name has "damaged" in it too
    damaged = [r for r in caplog.records if r.name == file_tier.__name__ and "is damaged" in r.getMessage()]
    assert len(damaged) == 2 and tier_of(again).num_corrupt == 2  # at start; when read
    assert output.num_cached_tokens == 0 and token_ids([output]) == expected[1:2]
    assert_all_free(again)
    again.shutdown()


def test_a_full_disk_costs_only_the_speed_up(embedded_model, embedded_tokenizer, expected, tmp_path, caplog,
                                            monkeypatch):
    def full_disk(path, mode="r", *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(file_tier, "open", full_disk, raising=False)
    llm = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path), **SMALL_POOL)
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        assert two_turns(llm) == expected
        tier_of(llm).flush()
    assert "No space left" in caplog.text and tier_of(llm).num_write_errors > 0
    assert_all_free(llm)
    llm.shutdown()


def test_an_unusable_directory_costs_only_the_speed_up(embedded_model, embedded_tokenizer, expected, tmp_path,
                                                      caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        llm = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(blocker / "tier"), **SMALL_POOL)
    assert "running without the tier" in caplog.text
    assert two_turns(llm) == expected
    assert llm.get_metrics()["kv_offload_loaded_blocks"] == 0
    assert_all_free(llm)
    llm.shutdown()


def test_a_retried_step_does_not_copy_its_evicted_blocks_again(embedded_model, embedded_tokenizer, expected,
                                                               tmp_path):
    """A step fails once after its forward pass has started: its retry must not copy the blocks it
    evicted to the tier again (the first try may have written another request's K/V into them)."""
    llm = make_llm(embedded_model, embedded_tokenizer, num_kv_blocks=30, max_model_len=100, kv_offload_dir=str(tmp_path),
                   kv_offload_policy="evicted")
    runner = llm.llm_engine.core.executor.runner
    generate(llm, [SYSTEM + USERS[0]])  # its blocks stay cached in the pool
    stores_per_try, failed = [], []
    real_execute, real_run = runner.execute, runner.run

    def execute(plan, *args):
        stores_per_try.append(list(plan.kv_stores))
        return real_execute(plan, *args)

    def run_failing_once(inputs):
        out = real_run(inputs)  # the forward pass has written its K/V
        if stores_per_try[-1] and not failed:
            failed.append(len(stores_per_try))
            raise RuntimeError("injected fault after the forward pass")
        return out

    runner.execute, runner.run = execute, run_failing_once
    other = [t + 1 for t in SYSTEM[:40]] + USERS[2]  # no shared prefix: it evicts the cached blocks
    assert token_ids(generate(llm, [other])) == token_ids(generate(
        make_llm(embedded_model, embedded_tokenizer, enable_prefix_caching=False), [other]))
    (first_try,) = failed
    assert stores_per_try[first_try] == []  # the retry: the evicted blocks were copied by the first try only
    assert_all_free(llm)
    llm.shutdown()


def test_a_fifo_in_place_of_a_block_file_is_computed_at_once(embedded_model, embedded_tokenizer, expected, tmp_path,
                                                            caplog):
    """A named pipe where a block's file was, once the engine has indexed it: reading it must not
    wait for a writer (it would, for good): it is dropped as damaged and computed."""
    system_prompt_on_disk(embedded_model, embedded_tokenizer, tmp_path)
    llm = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
    fifo = tier_of(llm)._file(block_hashes(SYSTEM)[5])
    os.unlink(fifo)
    os.mkfifo(fifo)
    outputs = []
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        worker = threading.Thread(target=lambda: outputs.append(generate(llm, [SYSTEM + USERS[1]])), daemon=True)
        worker.start()
        worker.join(timeout=120)
        if worker.is_alive():  # blocked in open(): give it a writer, so that it ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(timeout=30)
            pytest.fail("reading the tier blocked on a FIFO")
    ((output,),) = outputs
    assert output.num_cached_tokens == 5 * BLOCK_SIZE and token_ids([output]) == expected[1:2]
    assert "a FIFO" in caplog.text and "has not returned" not in caplog.text
    assert_all_free(llm)
    llm.shutdown()


def test_a_stuck_tier_read_delays_no_step_and_its_request_is_computed_after_the_deadline(
        embedded_model, embedded_tokenizer, expected, tmp_path, caplog, monkeypatch):
    """A hung filesystem: every open of a block file waits (up to a minute). A request that runs
    meanwhile takes its tokens step after step; the request whose prefix is in the tier waits out of
    the schedule for kv_offload_read_timeout, then computes it; no other read starts while it is stuck."""
    system_prompt_on_disk(embedded_model, embedded_tokenizer, tmp_path)
    release = threading.Event()

    def stalled(real_open):
        def opener(path, *args, **kwargs):
            if str(path).endswith(file_tier.SUFFIX):
                release.wait(60)
            return real_open(path, *args, **kwargs)
        return opener

    monkeypatch.setattr(os, "open", stalled(os.open))
    monkeypatch.setattr(file_tier, "open", stalled(open), raising=False)
    timeout = 1.0
    llm = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path), kv_offload_read_timeout=timeout)
    engine = llm.llm_engine
    neighbour = [t + 1 for t in SYSTEM] + USERS[3]  # shares nothing with the tier
    engine.add_request("neighbour", neighbour, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("A", SYSTEM + USERS[1], PARAMS)
    added, finished, longest_step, tokens_while_a_waits = time.monotonic(), {}, 0.0, 0
    try:
        with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
            while engine.has_unfinished_requests():
                waiting = bool(engine.scheduler.reading)
                start = time.monotonic()
                outputs = engine.step()
                longest_step = max(longest_step, time.monotonic() - start)
                for out in outputs:
                    tokens_while_a_waits += waiting and out.request_id == "neighbour"
                    if out.finished:
                        finished[out.request_id] = (out, time.monotonic())
            # The reader is still stuck: the tier starts no other read (one thread), and says so once.
            assert tier_of(llm).prefetch(block_hashes(SYSTEM)) is None and tier_of(llm).prefetch(block_hashes(SYSTEM)) is None
    finally:
        release.set()
    assert longest_step < 20  # a step that waited for the file would take a minute
    assert tokens_while_a_waits > 0
    a, a_done = finished["A"]
    assert a_done - added >= timeout and a.num_cached_tokens == 0 and token_ids([a]) == expected[1:2]
    assert caplog.text.count("has not returned") == 1
    assert_all_free(llm)
    llm.shutdown()


def test_an_interrupted_steps_blocks_are_never_written_to_the_tier(embedded_model, embedded_tokenizer, tmp_path,
                                                                 monkeypatch):
    """Ctrl-C in a step's forward pass, or while it is planned: the blocks it admitted were never
    computed, so writing the pool to the tier (as the exit does) must leave them out."""
    llm = make_llm(embedded_model, embedded_tokenizer, kv_offload_dir=str(tmp_path))
    core = llm.llm_engine.core
    generate(llm, [SYSTEM + USERS[0]])
    in_forward, in_plan = [t + 1 for t in SYSTEM], [t + 2 for t in SYSTEM]

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(core.executor.runner, "run", interrupt)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, [in_forward])
    monkeypatch.undo()
    monkeypatch.setattr(core.kv, "take_transfers", interrupt)  # after the admissions, before the plan is done
    with pytest.raises(KeyboardInterrupt):
        generate(llm, [in_plan])
    monkeypatch.undo()
    written, left = core.save_kv_tier()
    tier = tier_of(llm)
    assert written > 0 and left == 0
    assert all(h in tier for h in block_hashes(SYSTEM + USERS[0]))
    assert not any(h in tier for h in block_hashes(in_forward) + block_hashes(in_plan))
    assert_all_free(llm)
    llm.shutdown()
