"""Choosing the attention backend (attention/__init__.py): once, by name; each backend builds its own
metadata, which names it; every attention layer runs the backend its step's metadata names, so
engines that share one model may run different backends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.attention import get_backend
from pagedserve.attention.kv_cache import allocate_kv_cache
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.sdpa import SdpaBackend, SdpaMetadata
from pagedserve.attention.triton_paged import TritonBackend, TritonMetadata
from pagedserve.models.loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def test_backends_by_name():
    assert isinstance(get_backend("torch"), SdpaBackend) and get_backend("torch").name == "torch"
    assert isinstance(get_backend("triton"), TritonBackend) and get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash")


@pytest.mark.parametrize("name, metadata_class", [("torch", SdpaMetadata), ("triton", TritonMetadata)])
def test_each_backend_builds_its_own_metadata(name, metadata_class):
    backend = get_backend(name)
    md = backend.build_metadata([[3, 7, 9], [5], [2]], [5, 0, 0], [1, 3, 1], block_size=4)
    assert type(md) is metadata_class and md.backend is backend
    assert md.decode_token_indices.tolist() == [0, 4] and md.prefill_req_indices == [1]
    # The common part carries what the runner and every backend read, and no backend's extras.
    common = AttentionMetadata.build([[3, 7, 9], [5], [2]], [5, 0, 0], [1, 3, 1], block_size=4)
    assert torch.equal(common.slot_mapping, md.slot_mapping) and torch.equal(common.positions, md.positions)
    assert common.backend is None and not hasattr(common, "decode_block_tables")


def test_triton_is_imported_only_when_chosen():
    code = ("import sys; from pagedserve.attention import get_backend; get_backend('torch'); "
            "print('triton' in sys.modules, 'pagedserve.attention.triton_paged' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


class CountingBackend(SdpaBackend):
    """The torch backend, counting the layers that run it."""

    def __init__(self):
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


def test_layers_run_the_backend_their_metadata_names(tiny_checkpoint):
    model, config = load_model(str(tiny_checkpoint("llama")[0]))
    first, second = CountingBackend(), CountingBackend()
    for backend in (first, second, first):  # two "engines" on one model, in turns
        caches = allocate_kv_cache(config.num_layers, 4, 4, config.num_kv_heads, config.head_dim, torch.float32)
        md = backend.build_metadata([[0, 1]], [0], [5], block_size=4)
        with torch.inference_mode():
            model(torch.arange(5), md.positions, caches, md)
    assert (first.calls, second.calls) == (2 * config.num_layers, config.num_layers)
