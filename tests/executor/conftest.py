"""Process checks for the tensor-parallel tests (the odd-shaped checkpoint is in tests/conftest.py)."""

from __future__ import annotations

import os


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
