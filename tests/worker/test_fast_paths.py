"""Skipped fast paths say so (worker/fast_paths.py): an engine reports each fast path as taken (None)
or skipped with its reason, through the core and `LLM.fast_paths()` / `get_metrics()`, the reasons
agree with what the runner does, and each is logged once per process."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_config
from pagedserve.ops import cpu_attention, cpu_linear, fused_cpu
from pagedserve.worker import cpu_graphs, fast_paths
from pagedserve.worker.fast_paths import CPU_ATTENTION, CPU_FUSED_OPS, CPU_LINEAR, DECODE_REPLAY

LOADERS = [cpu_attention.load, cpu_linear.load, cpu_linear._dtype_supported, fused_cpu.load, cpu_graphs.load]


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """A process that has logged no skipped path yet; the log lines it writes from here on."""
    monkeypatch.setattr(fast_paths, "_logged", set())
    caplog.set_level(logging.INFO, logger=fast_paths.__name__)
    return caplog


def make_llm(path, tokenizer, **settings) -> LLM:
    config = EngineConfig(model=str(path), num_kv_blocks=64, block_size=8, max_num_seqs=4, **settings)
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def replays_here() -> bool:
    """Whether this CPU has every C kernel a float32 replay needs (csrc/linear.c: AVX2 or AVX-512)."""
    return cpu_linear.supports(torch.zeros(1, 64), torch.zeros(64, 64))


def skipped_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == fast_paths.__name__ and "is skipped" in r.getMessage()]


def skipped_lines(caplog) -> list[str]:
    return [r.getMessage() for r in skipped_records(caplog)]


# qwen3: q/k norms on views of the fused qkv output; gemma3: (1 + w) and sandwich norms, GELU, the
# embedding scale and two RoPE tables.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_default_cpu_engine_takes_every_fast_path(arch, tiny_checkpoint, embedded_tokenizer, fresh_log):
    if not replays_here():
        pytest.skip("this CPU has no C float32 matmul: its decode steps are not replayed")
    llm = make_llm(tiny_checkpoint(arch)[0], embedded_tokenizer)
    assert llm.fast_paths() == {DECODE_REPLAY: None, CPU_ATTENTION: None, CPU_LINEAR: None, CPU_FUSED_OPS: None}
    assert llm.llm_engine.runner.decode_graphs is not None  # what it reports is what it does
    assert llm.get_metrics()["fast_paths_skipped"] == 0
    assert skipped_lines(fresh_log) == []


def test_an_fp8_cache_engine_reports_the_replay_skipped_and_why(tiny_checkpoint, embedded_tokenizer, fresh_log):
    path = tiny_checkpoint("llama")[0]
    llm = make_llm(path, embedded_tokenizer, kv_cache_dtype="fp8")
    paths = llm.fast_paths()
    assert "fp8 KV cache" in paths[DECODE_REPLAY]
    assert llm.llm_engine.runner.decode_graphs is None
    assert paths[CPU_ATTENTION] is None  # the C attention kernels read an fp8 cache
    assert llm.get_metrics()["fast_paths_skipped"] == sum(r is not None for r in paths.values()) >= 1
    assert skipped_lines(fresh_log) == [f"fast path {DECODE_REPLAY} is skipped: {paths[DECODE_REPLAY]}"]
    assert skipped_records(fresh_log)[-1].levelno == logging.WARNING  # slower than it could be, unasked
    make_llm(path, embedded_tokenizer, kv_cache_dtype="fp8")  # a second engine, the same reason: not again
    assert len(skipped_lines(fresh_log)) == 1


def test_an_eager_engine_skips_the_replay(tiny_checkpoint, embedded_tokenizer, fresh_log):
    eager = make_llm(tiny_checkpoint("llama")[0], embedded_tokenizer, enforce_eager=True)
    assert eager.fast_paths()[DECODE_REPLAY] == "enforce_eager=True"
    assert eager.llm_engine.runner.decode_graphs is None
    assert skipped_records(fresh_log)[-1].levelno == logging.INFO  # asked for
    assert len(skipped_lines(fresh_log)) == 1


@pytest.fixture
def reloaded():
    """The kernel loaders evaluated afresh under the test's environment, and again after it."""
    for load in LOADERS:
        load.cache_clear()
    yield
    for load in LOADERS:
        load.cache_clear()


def test_kernels_switched_off_are_reported_as_such(tiny_checkpoint, embedded_tokenizer, monkeypatch, reloaded,
                                                   fresh_log):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    llm = make_llm(tiny_checkpoint("llama")[0], embedded_tokenizer)
    paths = llm.fast_paths()
    assert set(paths) == {DECODE_REPLAY, CPU_ATTENTION, CPU_LINEAR, CPU_FUSED_OPS}
    assert all("PAGEDSERVE_CPU_KERNEL=0" in reason for reason in paths.values())
    assert llm.get_metrics()["fast_paths_skipped"] == 4
    assert len(skipped_lines(fresh_log)) == 4


def test_a_cpu_without_the_matmul_instructions_skips_the_linear_kernel_and_the_replay(tiny_checkpoint,
                                                                                       monkeypatch):
    monkeypatch.setattr(cpu_linear, "supports_dtype", lambda dtype: False)  # as on a CPU without AVX2
    config = EngineConfig(model=str(tiny_checkpoint("llama")[0]), dtype="bfloat16")
    model_config = load_config(config.model)
    kernels = fast_paths.cpu_kernel_paths(model_config, config)
    assert "lacks the instructions" in kernels[CPU_LINEAR] and "torch.bfloat16" in kernels[CPU_LINEAR]
    assert CPU_LINEAR in fast_paths.replay_skipped(model_config, config, kernels)


def test_tensor_parallelism_and_cuda_reasons():
    config = EngineConfig(tensor_parallel_size=2)
    model_config = load_config(None)
    assert "tensor parallelism" in fast_paths.replay_skipped(model_config, config, {})
    cuda = EngineConfig(device="cuda", attention_backend="torch")
    assert "Triton" in fast_paths.replay_skipped(model_config, cuda, {})
