"""Tensor-parallel fixtures: tiny checkpoints whose shapes exercise the splits, and process checks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.conftest import randomize_

# 4 heads, 1 KV head (replicated at TP=2), a vocabulary of the embedded tokenizer's size plus 1
# (odd: the last rank's vocabulary slice has a padding row), Llama biases and tied embeddings.
ODD_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, vocab_size=49153, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def odd_checkpoint(tmp_path_factory, embedded_tokenizer) -> tuple[Path, torch.nn.Module]:
    """(directory with weights and the embedded tokenizer, the transformers model): a checkpoint
    the CLI can load by path and prompt with text."""
    path = tmp_path_factory.mktemp("tiny-odd")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**ODD_LLAMA), attn_implementation="eager",
                                             dtype=torch.float32)
    randomize_(model, seed=7)
    model.eval().save_pretrained(path, safe_serialization=True)
    embedded_tokenizer.save_pretrained(path)
    return path, model


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int | None = None) -> list[int]:
    """Live child processes of `pid` (default: this one), multiprocessing's resource tracker aside."""
    pid = pid or os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            found.append(int(entry))
    return found
