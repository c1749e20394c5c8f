"""The C build (pagedserve/native.py): one cached library per source, text, flags and CPU."""

from __future__ import annotations

import shutil

import pytest

from pagedserve import native


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_another_cpu_gets_its_own_build(cache, monkeypatch):
    compiler = native.find_compiler()
    first = native.compile_source("paged_attention", compiler)
    assert native.compile_source("paged_attention", compiler) == first  # reused, not rebuilt
    monkeypatch.setattr(native, "cpu_features", lambda: "flags : avx2 (another machine)")
    assert native.compile_source("paged_attention", compiler) != first and len(list(cache.glob("*.so"))) == 2


def test_editing_a_header_rebuilds_every_source_that_may_include_it(cache, tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(native.CSRC, csrc)
    monkeypatch.setattr(native, "CSRC", csrc)
    compiler = native.find_compiler()
    before = {name: native.compile_source(name, compiler) for name in ("paged_attention", "fused_ops")}
    (csrc / "fast_exp.h").write_text((csrc / "fast_exp.h").read_text() + "\n/* edited */\n")
    after = {name: native.compile_source(name, compiler) for name in ("paged_attention", "fused_ops")}
    assert all(after[name] != before[name] and after[name].exists() for name in before)


def test_flags_are_part_of_the_key(cache):
    compiler = native.find_compiler()
    assert native.compile_source("fused_ops", compiler) != native.compile_source(
        "fused_ops", compiler, [*native.FLAGS, "-fno-tree-vectorize"])


def test_a_failing_compiler_is_a_build_error(cache, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(native.BuildError):
        native.load_library("fused_ops")


def test_a_recording_notes_every_call_in_order():
    import ctypes

    libc = ctypes.CDLL(None)
    assert native.call(libc.abs, -3) == 3  # outside a recording: just the call
    with native.recording() as calls:
        native.call(libc.abs, -4)
        native.call(libc.labs, 5)
        with pytest.raises(RuntimeError):
            with native.recording():
                pass
    native.call(libc.abs, -6)
    assert [(fn.__name__, args) for fn, args in calls] == [("abs", (-4,)), ("labs", (5,))]
