"""The C build (ops/native.py): one cached library per source, text, flags and CPU."""

from __future__ import annotations

import shutil

import pytest

from pagedserve.ops import native


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_another_cpu_gets_its_own_build(cache, monkeypatch):
    compiler = native.find_compiler()
    first = native.compile_source("replay", compiler)  # the smallest source: the key is what is tested
    assert native.compile_source("replay", compiler) == first  # reused, not rebuilt
    monkeypatch.setattr(native, "cpu_features", lambda: "flags : avx2 (another machine)")
    assert native.compile_source("replay", compiler) != first and len(list(cache.glob("*.so"))) == 2


def test_editing_a_header_rebuilds_every_source_that_may_include_it(cache, tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(native.CSRC, csrc)
    monkeypatch.setattr(native, "CSRC", csrc)
    compiler = native.find_compiler()
    # fused_ops includes the header; replay does not, but a build's key holds every header's text.
    before = {name: native.compile_source(name, compiler) for name in ("replay", "fused_ops")}
    (csrc / "fast_exp.h").write_text((csrc / "fast_exp.h").read_text() + "\n/* edited */\n")
    after = {name: native.compile_source(name, compiler) for name in ("replay", "fused_ops")}
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


def test_a_recording_notes_only_the_calls_of_its_own_thread():
    import ctypes
    import threading

    libc = ctypes.CDLL(None)
    started, other_called = threading.Event(), threading.Event()
    other_calls: list = []

    def other_engine() -> None:  # another engine's thread, stepping while this one records
        started.wait()
        native.call(libc.labs, -7)
        with native.recording() as mine:  # and it may record at the same time, into its own list
            native.call(libc.abs, -8)
        other_calls.extend(mine)
        other_called.set()

    thread = threading.Thread(target=other_engine)
    thread.start()
    with native.recording() as calls:
        native.call(libc.abs, -1)
        started.set()
        assert other_called.wait(10)
        native.call(libc.abs, -2)
    thread.join()
    assert [(fn.__name__, args) for fn, args in calls] == [("abs", (-1,)), ("abs", (-2,))]
    assert [(fn.__name__, args) for fn, args in other_calls] == [("abs", (-8,))]


def test_building_ahead_compiles_every_source_once_for_the_loads(cache, compiler_runs, monkeypatch):
    # Unoptimised: what is tested is who compiles what, and -O3 takes a minute on two cores.
    monkeypatch.setattr(native, "SOURCES", {name: ["-O0" if f == "-O3" else f for f in flags]
                                            for name, flags in native.SOURCES.items()})
    native.build_ahead.cache_clear()
    try:
        thread = native.build_ahead()
        assert thread is not None and native.build_ahead() is thread  # once per process
        # Loads right away: each waits for the thread's build of its source, or takes it first.
        libs = [native.load_library(name) for name in ("linear", "paged_attention")]
        thread.join()
    finally:
        native.build_ahead.cache_clear()
    assert all(lib is not None for lib in libs)
    assert sorted(compiler_runs) == sorted(native.SOURCES)  # each source compiled once, by whoever came first
    assert len(list(cache.glob("*.so"))) == len(native.SOURCES)


def test_nothing_is_built_ahead_with_the_kernels_off(cache, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNEL", "0")
    native.build_ahead.cache_clear()
    try:
        assert native.build_ahead() is None
    finally:
        native.build_ahead.cache_clear()
    assert not cache.exists() or not list(cache.glob("*.so"))


def test_a_build_variant_comes_from_the_arguments_or_the_environment(monkeypatch):
    for var in (native.CHECKS_ENV, native.SANITIZE_ENV, native.MARCH_ENV):
        monkeypatch.delenv(var, raising=False)
    assert native.build_flags("linear") == native.SOURCES["linear"]
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    monkeypatch.setenv(native.CHECKS_ENV, "1")
    flags = native.build_flags("fused_ops")
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags and "-DPAGEDSERVE_CHECKS" in flags
    assert "-ffp-contract=off" in flags  # the library's own flags kept
    explicit = native.build_flags("fused_ops", checks=False, sanitize=True, march="x86-64")
    assert "-march=x86-64" in explicit and "-DPAGEDSERVE_CHECKS" not in explicit
    assert all(f in explicit for f in native.SANITIZE_FLAGS)
