"""A child process that must not outlive its parent: the engine core's process, a tensor-parallel worker."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection


def exit_with_parent(parent_alive: Connection) -> None:
    """Exit this process (at once, from a watcher thread) when the pipe's other end, which only
    the parent holds, closes: the parent ended, even by SIGKILL."""
    def watch() -> None:
        try:
            parent_alive.recv()  # nothing is ever sent: returns only when the other end closes
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
