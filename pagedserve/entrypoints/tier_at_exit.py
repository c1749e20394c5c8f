"""The offline API's KV tier at the end of the process.

With the default policy (`evicted`) the pool's cached blocks reach the tier only as the pool evicts
them, or when the engine writes them all (`EngineCore.save_kv_tier`, bounded in time). An `LLM`
that made its own engine with a tier does that when it shuts down (`shutdown()`, `with LLM(...)`),
when it is garbage-collected (a script's `main()` returned), and at interpreter exit, before the
tier closes (this module's exit hook is registered after the tier's, so it runs first). An `LLM`
over an engine it was given (`LLM.from_engine`) leaves that to the engine's owner.

Signals, offline:
- SIGINT: Python's own handler raises KeyboardInterrupt. As it unwinds, the step it interrupted is
  undone (`EngineCore.step`: its blocks leave the prefix cache, whose K/V may never have been
  computed) and `LLM.generate` aborts its requests; then the exit writes.
- SIGTERM kills a Python process without running anything at exit. While such an LLM exists, if
  SIGTERM's handler is the default one and the LLM is made on the main thread, a handler makes
  SIGTERM raise SystemExit(143) instead: the same unwinding and writing, then the exit status a
  shell shows for a process SIGTERM ended (128 + 15; a parent's wait sees status 143, not death
  by the signal). A second SIGTERM while the blocks are written kills at once. The default handler
  is put back once no such LLM is left (on the main thread).
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import weakref

logger = logging.getLogger(__name__)

_savers: list[weakref.finalize] = []  # one per LLM that writes its pool at the end
_registered = False
_handler_installed = False


def save_at_end(llm, core) -> weakref.finalize:
    """Have `core`'s pool written to its KV tier when `llm` is collected or the process exits (the
    finalizer holds `core`, not `llm`); `cancel` it on shutdown."""
    global _registered
    saver = weakref.finalize(llm, _save, core)
    saver.atexit = False  # run by _save_all, in order with the tier's own exit hook
    _savers.append(saver)
    if not _registered:
        atexit.register(_save_all)
        _registered = True
    _install_sigterm_handler()
    return saver


def cancel(saver: weakref.finalize) -> None:
    """The LLM shut down (its engine wrote the pool itself): nothing to do at the end."""
    saver.detach()
    _forget_finished()


def _save(core) -> None:
    try:
        core.save_kv_tier()
    except Exception:
        logger.exception("writing the pool's cached blocks to the KV tier failed")
    _forget_finished()


def _save_all() -> None:
    _restore_sigterm_handler()  # from here a SIGTERM ends the process at once
    for saver in list(_savers):
        saver()  # runs it if it is still alive, once


def _forget_finished() -> None:
    _savers[:] = [s for s in _savers if s.alive]
    if not _savers:
        _restore_sigterm_handler()


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_sigterm_handler() -> None:
    global _handler_installed
    if not _handler_installed and _on_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _handler_installed = True


def _restore_sigterm_handler() -> None:
    global _handler_installed
    if not _handler_installed or not _on_main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # unless someone has set another since
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _handler_installed = False
