"""Where pagedserve keeps what it computes once and reuses across starts: the compiled C decode
kernel and converted GGUF checkpoints. $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve,
else ~/.cache/pagedserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    configured = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"
