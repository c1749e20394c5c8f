"""The C sources in pagedserve/csrc: compiled on first use, cached, loaded with ctypes.

Each library is compiled with the system C compiler ($CC, else cc) from its translation units (the
sources in UNITS, compiled side by side, or csrc/<name>.c alone) to a shared library in
pagedserve's cache folder (`pagedserve/cache.py`), keyed by the text of every file in csrc (the
sources and the headers they include), its flags, the compiler and the CPU's features, so that an
edit or another machine never loads a stale build. Libraries link OpenMP: the process already has
torch's libgomp loaded, so they share its thread pool. An engine on a CPU starts `build_ahead` first,
so that a cold start compiles while it loads the model.

Every call into a kernel goes through `call`, so that a `recording` can note the calls of a whole
forward pass for replay in C (worker/cpu_graphs.py, csrc/replay.c); a recording sees only the
calls of the thread that started it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pagedserve.cache import cache_dir

CSRC = Path(__file__).with_name("csrc")
# gnu11 for the vector extensions; fp-contract lets a * b + c become one fused multiply-add;
# no-trapping-math lets loops with float selects vectorize without AVX-512's masks (fast_exp's
# range checks kept silu and softmax scalar on AVX2), and changes no result.
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared",
         "-std=gnu11"]
# Each library with its flags. fused_ops: no fused multiply-add, as torch rounds each product before
# the sum (ops/fused_cpu.py).
SOURCES = {
    "paged_attention": FLAGS,
    "linear": FLAGS,
    "quant_linear": FLAGS,
    "replay": FLAGS,
    "lora": FLAGS,
    "fused_ops": [f for f in FLAGS if not f.startswith("-ffp-contract")] + ["-ffp-contract=off"],
}
# The libraries built from more than one source. At -O3 the attention kernels take most of a cold
# start's compile: as two sources, they compile at once on two cores.
UNITS = {"paged_attention": ["paged_decode", "paged_prefill"]}


class BuildError(RuntimeError):
    """No compiler, or it failed: callers fall back to torch."""


def cpu_features() -> str:
    """What -march=native compiles for: a build for one CPU must not be loaded on another that
    shares the cache directory (a home on a network drive)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor() or platform.machine()


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


# The build's variant, for tests and debugging (each flag set builds and caches apart):
CHECKS_ENV = "PAGEDSERVE_NATIVE_CHECKS"  # "1": bounds checks in the kernels (-DPAGEDSERVE_CHECKS)
SANITIZE_ENV = "PAGEDSERVE_NATIVE_SANITIZE"  # "1": AddressSanitizer (`sanitizer_env` to load it)
MARCH_ENV = "PAGEDSERVE_NATIVE_MARCH"  # a -march target in place of native, e.g. x86-64-v3 (AVX2 + FMA)
SANITIZE_FLAGS = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]


def build_flags(name: str, *, checks: bool | None = None, sanitize: bool | None = None,
                march: str | None = None) -> list[str]:
    """Library `name`'s compiler flags: SOURCES[name]'s, for `march` in place of the CPU it runs on,
    with the kernels' bounds checks (a block id outside the pool is an error, not a read out of
    bounds) and with AddressSanitizer, as asked; each left as None is read from the environment
    (CHECKS_ENV, SANITIZE_ENV, MARCH_ENV), so that a process's every load gets the same variant."""
    if checks is None:
        checks = os.environ.get(CHECKS_ENV, "0") == "1"
    if sanitize is None:
        sanitize = os.environ.get(SANITIZE_ENV, "0") == "1"
    march = march or os.environ.get(MARCH_ENV) or None
    out = [f"-march={march}" if f == "-march=native" and march else f for f in SOURCES[name]]
    if checks:
        out.append("-DPAGEDSERVE_CHECKS")
    if sanitize:
        out += SANITIZE_FLAGS
    return out


def sanitizer_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a Python process that loads AddressSanitizer builds.
    A Python that is not itself built with ASan must preload its runtime, and libstdc++ with it:
    Python does not link libstdc++, so ASan would find no C++ `throw` to wrap and abort at the first
    exception torch's libraries throw (and catch). CPython's memory at exit, which it never frees,
    is not a leak of the kernels."""
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found")
    preload = []
    for library in ("libasan.so", "libstdc++.so"):
        path = subprocess.run([compiler, f"-print-file-name={library}"], capture_output=True, text=True,
                              check=True).stdout.strip()
        if not os.path.isabs(path):  # the compiler echoes the bare name when it has no such library
            raise BuildError(f"{compiler} has no {library}, which AddressSanitizer builds need")
        preload.append(os.path.realpath(path))
    env = dict(os.environ if env is None else env)
    env.update({SANITIZE_ENV: "1", "LD_PRELOAD": " ".join(preload), "ASAN_OPTIONS": "detect_leaks=0"})
    return env


def target_defines(name: str, flags: list[str] | None = None) -> frozenset[str]:
    """The instruction-set macros the compiler defines for library `name`'s build (`build_flags`
    unless `flags` are given): what the kernels' #if's see, __AVX2__, __FMA__, __AVX512F__,
    __AVX512BF16__..., which for -march=native are this CPU's and for -march=x86-64-v3 are AVX2's."""
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found")
    return _defines(compiler, tuple(f for f in (build_flags(name) if flags is None else flags) if f.startswith("-m")))


@functools.cache
def _defines(compiler: str, machine_flags: tuple[str, ...]) -> frozenset[str]:
    result = subprocess.run([compiler, *machine_flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                            text=True, check=True)
    return frozenset(line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define "))


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _build_lock(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def compile_source(name: str, compiler: str, flags: list[str] | None = None) -> Path:
    """Library `name` compiled (or the cached build for this text, flags, compiler and CPU), with
    `build_flags(name)` by default. One build of a library at a time in a process: a second caller waits
    for it (see `build_ahead`) and then finds it cached."""
    with _build_lock(name):
        return _compile(name, compiler, build_flags(name) if flags is None else flags)


def _compile(name: str, compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f"{p.name}\n{p.read_text()}" for p in sorted(CSRC.iterdir()) if p.suffix in (".c", ".h")]
    key = hashlib.sha256("\0".join([name, *texts, *flags, version, cpu_features()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        units = UNITS.get(name, [name])
        objects = [Path(tmp) / f"{unit}.o" for unit in units]
        compile_flags = [f for f in flags if f != "-shared"]
        with ThreadPoolExecutor(len(units)) as pool:  # the threads only wait on the compilers
            results = pool.map(lambda unit, obj: subprocess.run(
                [compiler, *compile_flags, "-c", str(CSRC / f"{unit}.c"), "-o", str(obj)],
                capture_output=True, text=True), units, objects)
            for unit, result in zip(units, results):
                if result.returncode != 0:
                    raise BuildError(f"{compiler} failed on {unit}.c:\n{result.stderr.strip()}")
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *flags, *map(str, objects), "-o", str(built), "-lm"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"{compiler} failed to link {name}:\n{result.stderr.strip()}")
        os.replace(built, target)
    return target


@functools.cache
def build_ahead() -> threading.Thread | None:
    """Compile every library on a daemon thread, once per process, so that a cold start compiles
    (10-20 s of compiler time here, most of it the attention kernels) while it reads the tokenizer
    and the weights instead of after; a load waits for its library's build, or finds it cached.
    The libraries, and their sources, compile side by side: the cores the load leaves idle go to the
    compilers. None where the kernels are off (PAGEDSERVE_CPU_KERNEL=0) or there is no compiler. A
    failed build is left for the load to report, with its fallback."""
    compiler = find_compiler()
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0" or compiler is None:
        return None

    def build(name: str) -> None:
        try:
            compile_source(name, compiler)
        except (BuildError, OSError, subprocess.CalledProcessError):
            pass

    def build_all() -> None:
        with ThreadPoolExecutor(len(SOURCES)) as pool:
            pool.map(build, SOURCES)

    thread = threading.Thread(target=build_all, name="pagedserve-build-ahead", daemon=True)
    thread.start()
    return thread


def optional_library(name: str, fallback: str, flags: list[str] | None = None) -> ctypes.CDLL | None:
    """csrc/<name>.c loaded, or None: switched off with PAGEDSERVE_CPU_KERNEL=0 (silently), or
    unbuildable (with a warning naming the source and `fallback`, what runs instead)."""
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0":
        return None
    try:
        return load_library(name, flags)
    except BuildError as exc:
        warnings.warn(f"{name}.c is unavailable ({exc}); {fallback}", stacklevel=3)
        return None


KERNELS_OFF = "the C kernels are switched off (PAGEDSERVE_CPU_KERNEL=0)"


def unavailable_reason(name: str) -> str | None:
    """Why csrc/<name>.c cannot be loaded here, in words; None when it loads (a cached build: no
    compile after the first)."""
    if os.environ.get("PAGEDSERVE_CPU_KERNEL", "1") == "0":
        return KERNELS_OFF
    try:
        load_library(name)
    except BuildError as exc:
        return f"{name}.c could not be built or loaded: {str(exc).splitlines()[0]}"
    return None


def load_library(name: str, flags: list[str] | None = None) -> ctypes.CDLL:
    """csrc/<name>.c as a loaded library; BuildError if it cannot be built or loaded."""
    compiler = find_compiler()
    if compiler is None:
        raise BuildError("no C compiler found")
    try:
        return ctypes.CDLL(str(compile_source(name, compiler, flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BuildError(str(exc)) from exc


# The active `recording` of each thread. Per thread: a recording notes one forward pass, and an
# engine on another thread of this process (a second engine, a server's core) must not write its
# calls into it; the torch dispatch mode that watches the forward beside it sees one thread too.
_local = threading.local()


def call(fn: ctypes._CFuncPtr, *args):
    """fn(*args), noted while a `recording` is active on this thread."""
    result = fn(*args)
    recorded = getattr(_local, "recorded", None)
    if recorded is not None:
        recorded.append((fn, args))
    return result


@contextmanager
def recording() -> Iterator[list[tuple[ctypes._CFuncPtr, tuple]]]:
    """Note every `call` this thread makes inside, in order, as (function, arguments)."""
    if getattr(_local, "recorded", None) is not None:
        raise RuntimeError("a recording is already active on this thread")
    _local.recorded = calls = []
    try:
        yield calls
    finally:
        _local.recorded = None
