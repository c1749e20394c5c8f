"""What a GGUF file costs to read, paid once: its config, tokenizer and dequantized weights on disk
(and, for a GGUF or a float checkpoint's folder, its weights packed for the quantized kernels).

Reading a GGUF through transformers parses the file's metadata three times (config, tokenizer,
weights) and dequantizes every tensor: about 13 s for the embedded 98 MB SmolLM2 on a slow sitting
of this project's 2-core machine, even with loader.py's faster reading (30 s without), at every
start. The first start writes what it computed, and later starts read it back: the config as
`config.json` (and pagedserve's ModelConfig made from it, so that a warm start needs no
transformers config class: loader._gguf_model_config), the tokenizer as `save_pretrained` writes
it, the weights as safetensors in the dtype they were dequantized to.

An entry is keyed by the SHA-256 of the GGUF's bytes (0.06 s for the embedded file), the dtype,
this cache's format version and the versions of the libraries that did the conversion, so a
changed file or an upgraded converter is never served from a stale entry. Each part is written
to a temporary folder and renamed into place, so a half-written entry is never read. The cache
lives in pagedserve's cache folder (`pagedserve/cache.py`), under gguf/; PAGEDSERVE_GGUF_CACHE=0
turns it off. A cache that cannot be written (read-only, full) only
costs the speed-up, never the load.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedserve.cache import cache_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when what an entry holds, or how it is made, changes


def cache_root() -> Path | None:
    """The GGUF cache's folder, or None when it is off."""
    if os.environ.get("PAGEDSERVE_GGUF_CACHE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    return cache_dir() / "gguf"


@functools.lru_cache(maxsize=8)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The file's SHA-256 (memoised per size and mtime: config, tokenizer and weights ask in turn)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digest(path: str) -> str:
    stat = os.stat(path)
    return _file_digest(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


def entry_key(gguf_path: str) -> str:
    """What an entry's content depends on: the GGUF's bytes (or a model directory's config and
    weight files'), the format, the converters' versions."""
    from importlib.metadata import version

    if os.path.isdir(gguf_path):
        files = sorted(p for p in Path(gguf_path).iterdir()
                       if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))
        digest = hashlib.sha256("".join(f"{p.name}:{_digest(str(p))}/" for p in files).encode()).hexdigest()
    else:
        digest = _digest(gguf_path)
    versions = f"v{FORMAT_VERSION}-transformers{version('transformers')}-gguf{version('gguf')}"
    return hashlib.sha256(f"{digest}/{versions}".encode()).hexdigest()[:32]


def has_entry(gguf_path: str) -> bool:
    """Whether some part of the file's entry is cached: then these exact bytes were read and
    converted before (a damaged file never gets one)."""
    root = cache_root()
    entry = None if root is None else root / entry_key(gguf_path)
    # Complete parts only: a folder being written is hidden (".part-...").
    return entry is not None and entry.is_dir() and any(not p.name.startswith(".") for p in entry.iterdir())


def cached(gguf_path: str, part: str, load: Callable[[Path], Any], make: Callable[[], Any],
           save: Callable[[Any, Path], None]) -> Any:
    """`part` of the GGUF's entry (e.g. "tokenizer", "model-float32"): `load(folder)` when it is
    cached; otherwise `make()`, saved with `save(value, folder)` for next time."""
    root = cache_root()
    if root is None:
        return make()
    folder = root / entry_key(gguf_path) / part
    if folder.is_dir():
        try:
            return load(folder)
        except Exception as e:  # damaged by hand or by a disk fault: rebuild it
            logger.warning("ignoring the damaged cache entry %s (%r); rebuilding it", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    value = make()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=folder.parent))
        try:
            save(value, tmp)
            os.rename(tmp, folder)  # atomic: readers see all of the part or none of it
        except OSError:
            if not folder.is_dir():  # not another process's complete copy: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # a disk that is full or read-only, or a part that does not save
        logger.warning("could not write the cache entry %s (%r); the next start converts %s again",
                       folder, e, gguf_path)
    return value
