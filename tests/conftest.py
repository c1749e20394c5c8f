"""Shared fixtures.

- `tiny_checkpoint(arch)`: a tiny random transformers model of each supported architecture, saved
  as safetensors, plus the transformers model itself as the reference (eager attention, float32).
- `embedded_hf_model`, `embedded_tokenizer`, `embedded_model`: the embedded SmolLM2 GGUF loaded by
  transformers and by us. Session-scoped: each load takes seconds.
- `windowed_checkpoint`: a tiny Qwen3 of two sliding-window layers and one full one (three KV cache
  groups), saved as safetensors, with its transformers model.
- `arch`: parametrizes a test over the tiny architectures.
- `paged_harness` (the PagedHarness class): drives our model the way the engine does, over a
  pool whose blocks are handed out in random order.
- `embedded_adapter`, `tiny_adapter`: LoRA adapters made with PEFT (tests/lora/lora_fixtures.py).
- `browser`, `page`, `screenshot_dir`: headless Chromium for the dashboard (tests/dashboard/browser.py).
"""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run under Triton's interpreter on CPU tensors (read when a kernel is defined, so
# before anything imports pagedserve.attention.triton_paged).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config, SmolLM3Config)

from pagedserve.attention import get_backend
from pagedserve.attention.kv_cache import allocate_kv_cache

pytest_plugins = ["tests.lora.lora_fixtures", "tests.dashboard.browser"]  # fixtures any directory's tests may use

_DIMS = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
)
# Narrower than _DIMS: at hidden size 64 (embeddings scaled by 8) a tiny Gemma's greedy output loops
# on a few tokens for some seeds, and at norm scales that avoid it float32 rounding alone moves
# transformers' logits by 2e-4; at 32 its output is varied for every seed tried and rounds to ~3e-5.
GEMMA3_TEXT = dict(
    _DIMS, hidden_size=32, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    final_logit_softcapping=8.0,
)
# Each variant exercises what sets its architecture apart.
TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_DIMS),
    "llama3": lambda: LlamaConfig(  # Llama-3 RoPE scaling (active: short original context), biases, tied
        **_DIMS, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mistral": lambda: MistralConfig(**_DIMS, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**_DIMS, tie_word_embeddings=True),  # q/k/v bias
    "qwen3": lambda: Qwen3Config(  # q/k norm, head_dim != hidden / heads, one sliding layer
        **_DIMS, head_dim=32, use_sliding_window=True, sliding_window=8, max_window_layers=1,
    ),
    # Fused qkv / gate_up tensors, 12 of 16 dims rotated, a window on every layer, LongRoPE: short
    # factors below position 64 (the arch tests' sequences stay below it, where generate agrees),
    # long ones from there (tests/models/test_rope.py).
    "phi3": lambda: Phi3Config(
        **_DIMS, pad_token_id=None, partial_rotary_factor=0.75, sliding_window=12, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.05, 1.2, 1.6, 2.5, 3.0],
                         "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0]},
    ),
    # Layer 1 is a NoPE layer (no_rope_layers [1, 0]), which also takes the window; tied embeddings.
    "smollm3": lambda: SmolLM3Config(
        **_DIMS, pad_token_id=None, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=8,
    ),
    # (1 + w) norms, sandwich norms, gelu-tanh, scaled embedding, query_pre_attn_scalar != head_dim,
    # sliding and full layers with their own RoPE (linear scaling on the full ones), final soft-capping.
    "gemma3": lambda: Gemma3TextConfig(**GEMMA3_TEXT),
}
ARCHS = list(TINY_CONFIGS)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """transformers zero-initialises biases and sets norms to one; random values make every
    parameter matter to the comparison."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2  # large enough for varied greedy output
            p.copy_(1.0 + noise if "norm" in name else noise)


def make_tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    config = TINY_CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """arch -> (checkpoint directory, transformers reference model), built once per session."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(arch: str) -> tuple[Path, torch.nn.Module]:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model = make_tiny_model(arch, seed=ARCHS.index(arch))
            model.save_pretrained(path, safe_serialization=True)
            cache[arch] = (path, model)
        return cache[arch]

    return get


# Two sliding layers (window 8) around a full one: KV cache groups of one layer each, 2 sliding and 1 full.
WINDOWED_QWEN3 = dict(_DIMS, num_hidden_layers=3, head_dim=16, sliding_window=8, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="session")
def windowed_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(checkpoint directory, transformers model) of WINDOWED_QWEN3 with random weights."""
    path = tmp_path_factory.mktemp("tiny-windowed")
    model = AutoModelForCausalLM.from_config(Qwen3Config(**WINDOWED_QWEN3), attn_implementation="eager",
                                             dtype=torch.float32)
    randomize_(model, seed=11)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path, model


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


@pytest.fixture
def compiler_runs(monkeypatch) -> list[str]:
    """The C libraries ops/native.py builds from here on, by name, one entry per link."""
    from pagedserve.ops import native

    runs, real_run = [], native.subprocess.run

    def counting_run(cmd, *args, **kwargs):
        if "-shared" in cmd:  # the link of a library: <name>-<key>.so
            runs.append(Path(cmd[cmd.index("-o") + 1]).name.rsplit("-", 1)[0])
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting_run)
    return runs


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from pagedserve.models.loader import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def embedded_hf_model(embedded_path):
    """transformers' own load of the embedded GGUF: the reference for exactness tests."""
    path = Path(embedded_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from pagedserve.models.loader import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def embedded_model():
    """(our DecoderForCausalLM, ModelConfig) for the embedded SmolLM2, via load_model()."""
    from pagedserve.models.loader import load_model

    return load_model()


class PagedHarness:
    """A minimal stand-in for the engine's model runner: blocks come from a shuffled free list,
    so consecutive logical blocks land in scattered physical ones."""

    def __init__(self, model, config, block_size: int, num_blocks: int, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv_caches = [cache for heads, dim in config.kv_buffer_shapes(uniform=True)
                          for cache in allocate_kv_cache(1, num_blocks, block_size, heads, dim, torch.float32, "cpu")]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[object, list[int]] = {}
        self.computed: dict[object, int] = {}

    def share_prefix(self, src, dst, num_tokens: int) -> None:
        """Start request dst on src's first num_tokens (whole blocks), as a prefix-cache hit does."""
        assert num_tokens % self.block_size == 0
        self.tables[dst] = self.tables[src][: num_tokens // self.block_size]
        self.computed[dst] = num_tokens

    @torch.no_grad()
    def step(self, batch: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """Run each (request, new token ids) of the batch in one forward; return each request's
        logits [num_new, vocab]."""
        for req, tokens in batch:
            table = self.tables.setdefault(req, [])
            total = self.computed.setdefault(req, 0) + len(tokens)
            while len(table) * self.block_size < total:
                table.append(self.free.pop())
        md = get_backend("torch").build_metadata(
            [self.tables[r] for r, _ in batch], [self.computed[r] for r, _ in batch],
            [len(t) for _, t in batch], self.block_size, "cpu",
        )
        input_ids = torch.tensor([t for _, tokens in batch for t in tokens])
        logits = self.model.compute_logits(self.model(input_ids, md.positions, self.kv_caches, md))
        for req, tokens in batch:
            self.computed[req] += len(tokens)
        return list(logits.split([len(t) for _, t in batch]))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, chunk: int) -> list[list[int]]:
        """Greedy-decode all prompts together: one more request admitted per step, prompts run in
        chunks of `chunk` tokens, so steps mix prefill chunks and decodes; the batch order flips
        every step."""
        pending = [list(p) for p in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        admitted, step = 0, 0
        while any(len(o) < max_new_tokens for o in outputs):
            admitted = min(admitted + 1, len(prompts))
            batch = [(i, pending[i][:chunk]) for i in range(admitted) if len(outputs[i]) < max_new_tokens]
            if step % 2:
                batch.reverse()
            for (i, tokens), logits in zip(batch, self.step(batch)):
                pending[i] = pending[i][len(tokens):]
                if not pending[i]:  # prompt done (or a decode step): sample the next token
                    pending[i] = [int(logits[-1].argmax())]
                    outputs[i].append(pending[i][0])
            step += 1
        return outputs


@pytest.fixture
def paged_harness():
    """The PagedHarness class (test modules do not import conftest)."""
    return PagedHarness


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    """Parametrizes a test over every tiny architecture."""
    return request.param
