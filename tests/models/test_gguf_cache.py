"""The GGUF cache: a second load reads what the first converted and gives the same model,
tokenizer and config; a changed file or converter never hits a stale entry; a damaged entry is
rebuilt; an unwritable cache costs only the speed-up."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from pagedserve.models import gguf_cache, loader

TEXTS = ["The capital of France is Paris.", "  leading spaces\tand tabs\n\nnew lines",
         "Ünïcödé — 日本語 😀", "<|im_start|>user\nHi<|im_end|>"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDSERVE_GGUF_CACHE", raising=False)
    return tmp_path / "gguf"


def test_a_second_load_reads_the_cache_and_gives_the_same_model(cache, monkeypatch):
    cold_net, cold_config = loader.load_model()
    cold_tokenizer = loader.load_tokenizer()
    (entry,) = cache.iterdir()
    parts = sorted(p.name for p in entry.iterdir())
    assert parts[0] == "config" and parts[1].startswith("model-config-") and parts[2:] == ["model-float32", "tokenizer"]

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(loader, "_gguf_tensors", no_conversion)
    monkeypatch.setattr(loader, "_hf_config", no_conversion)  # the ModelConfig is read back too
    warm_net, warm_config = loader.load_model()
    warm_tokenizer = loader.load_tokenizer()

    assert warm_config == cold_config == loader.load_config()
    monkeypatch.undo()
    path = loader.resolve_model_path(None)
    assert warm_config == loader._model_config(path, loader._hf_config(path))  # as transformers' config gives it
    cold, warm = dict(cold_net.named_parameters()), dict(warm_net.named_parameters())
    assert cold.keys() == warm.keys()
    assert all(torch.equal(cold[name], warm[name]) for name in cold)
    for text in TEXTS:
        assert warm_tokenizer.encode(text) == cold_tokenizer.encode(text)
        assert warm_tokenizer.decode(cold_tokenizer.encode(text)) == cold_tokenizer.decode(cold_tokenizer.encode(text))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (warm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == cold_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (warm_tokenizer.eos_token_id, warm_tokenizer.bos_token_id, len(warm_tokenizer)) == (
        cold_tokenizer.eos_token_id, cold_tokenizer.bos_token_id, len(cold_tokenizer))


def test_a_changed_file_or_converter_gets_another_entry(tmp_path, monkeypatch):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(100))
    b.write_bytes(b"GGUF" + bytes(99) + b"\x01")  # same size
    os.utime(b, ns=(os.stat(a).st_atime_ns, os.stat(a).st_mtime_ns))  # and the same time
    assert gguf_cache.entry_key(str(a)) != gguf_cache.entry_key(str(b))
    key = gguf_cache.entry_key(str(a))
    a.write_bytes(b"GGUF" + bytes(99) + b"\x02")  # rewritten in place
    assert gguf_cache.entry_key(str(a)) != key
    key = gguf_cache.entry_key(str(a))
    monkeypatch.setattr(gguf_cache, "FORMAT_VERSION", gguf_cache.FORMAT_VERSION + 1)
    assert gguf_cache.entry_key(str(a)) != key


class Part:
    """A cheap stand-in for a converted part: counts conversions."""

    def __init__(self):
        self.made = 0

    def make(self):
        self.made += 1
        return "converted"

    @staticmethod
    def save(value, folder):
        (folder / "value.txt").write_text(value)

    @staticmethod
    def load(folder):
        text = (folder / "value.txt").read_text()
        if text != "converted":
            raise ValueError("damaged")
        return text


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(64))
    return str(path)


def test_converted_once_then_read(cache, gguf):
    part = Part()
    assert gguf_cache.cached(gguf, "p", part.load, part.make, part.save) == "converted"
    assert gguf_cache.cached(gguf, "p", part.load, part.make, part.save) == "converted"
    assert part.made == 1
    assert not [p for p in cache.rglob(".*")]  # no temporary folder left behind


def test_a_damaged_entry_is_rebuilt(cache, gguf, caplog):
    part = Part()
    gguf_cache.cached(gguf, "p", part.load, part.make, part.save)
    (stored,) = cache.rglob("value.txt")
    stored.write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="pagedserve.models.gguf_cache"):
        assert gguf_cache.cached(gguf, "p", part.load, part.make, part.save) == "converted"
    assert part.made == 2 and "damaged cache entry" in caplog.text
    assert stored.read_text() == "converted"


def test_an_unwritable_cache_costs_only_the_speed_up(tmp_path, monkeypatch, gguf, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(blocker))  # a file: nothing can be made under it
    part = Part()
    with caplog.at_level(logging.WARNING, logger="pagedserve.models.gguf_cache"):
        assert gguf_cache.cached(gguf, "p", part.load, part.make, part.save) == "converted"
    assert "could not write the cache entry" in caplog.text


def test_the_cache_can_be_turned_off(cache, gguf, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", "0")
    part = Part()
    gguf_cache.cached(gguf, "p", part.load, part.make, part.save)
    gguf_cache.cached(gguf, "p", part.load, part.make, part.save)
    assert part.made == 2 and not cache.exists()


def test_a_damaged_file_never_gets_an_entry(cache, embedded_path, tmp_path):
    """The damage check runs until the file has an entry, and every load runs it first."""
    damaged = tmp_path / "damaged.gguf"
    data = open(embedded_path, "rb").read()
    damaged.write_bytes(data[: len(data) // 2])
    for load in (loader.load_tokenizer, loader.load_config, loader.load_model):
        with pytest.raises(ValueError, match="not a valid GGUF file"):
            load(str(damaged))
    assert not gguf_cache.has_entry(str(damaged))


@pytest.mark.slow
def test_a_warm_start_reads_config_and_tokenizer_without_transformers_auto_classes(cache):
    """transformers' config classes and AutoTokenizer's lookup import about 1.5 s of its modules; a
    warm start reads the cached ModelConfig and the tokenizer's own class instead. Fresh processes,
    so that no other test's import counts: the first fills the cache."""
    heavy = ["transformers.utils.type_validators", "transformers.models.auto.tokenization_auto"]
    code = ("import sys; from pagedserve.models import loader; loader.load_config(); loader.load_tokenizer(); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    runs = [subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [run.stdout.splitlines()[-1] for run in runs] == [str(heavy), "[]"]
