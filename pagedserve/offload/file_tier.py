"""The KV tier behind the block pool: blocks as files in one directory, keyed by the prefix cache's
chained block hashes, bounded in bytes, the least recently used going first.

A block is one unit: its K and V for every layer, laid out block-major (`transfer.py`), so storing
or loading it is one file. Files are written by a background thread; until its file is written a
block is served from the memory it was copied into. Each file is a header (magic, format version,
the namespace, the block hash, the payload's length and CRC-32) and the payload. A read checks all
of them; a block that fails is dropped from the tier with a log line and never served.

The directory holds one subdirectory per namespace: a digest of the model's identity, the dtype and
the KV layout (`namespace_digest`), so a different model or format never reads an entry, and a new
process on the same model finds what an earlier one wrote.

Faults cost the speed-up only: a directory that cannot be made turns the tier off, a write that
fails (a full disk, say) loses that block, and each is logged.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

MAGIC = b"PSKV"
FORMAT_VERSION = 1
# magic, format version, namespace digest, block hash, payload bytes, payload CRC-32
HEADER = struct.Struct("<4sH16s32sQI")
SUFFIX = ".kvblock"
# Blocks copied out of the pool but not yet written may hold at most this much memory; past it a
# store is dropped (the disk is slower than the engine produces blocks).
MAX_PENDING_BYTES = 512 << 20

_open_tiers: weakref.WeakSet[FileTier] = weakref.WeakSet()


def namespace_digest(identity: dict) -> bytes:
    """16 bytes naming what a block's bytes mean: the model, its dtype, the KV layout."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:16]


def model_files_identity(path: str) -> list:
    """The model's files as (name, size, mtime): a rewritten checkpoint is another model."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


class FileTier:
    """Blocks of `block_bytes` bytes as files under `directory`, at most `capacity_bytes` of them."""

    def __init__(self, directory: str, capacity_bytes: int, identity: dict, block_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"kv_offload_bytes ({capacity_bytes}) holds no block of {self.file_bytes} bytes")
        self.namespace = namespace_digest(identity)
        self.path = Path(directory) / self.namespace.hex()
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # every block the tier holds, LRU first
        self._pending: dict[bytes, Tensor] = {}  # of those, the blocks whose files are not written yet
        self._queue: queue.Queue = queue.Queue()
        self._errors_logged: set[int] = set()
        # Figures, in blocks.
        self.num_stored = 0  # written (or being written)
        self.num_loaded = 0  # read back
        self.num_dropped = 0  # not stored: too many writes pending
        self.num_corrupt = 0  # read back, failed the checks, dropped
        self.num_write_errors = 0
        self._closed = False
        self.enabled = self._open()
        # The writer holds the tier weakly, so a dropped engine's tier is collected (and its thread
        # told to stop) even if nobody closed it.
        self._writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self._queue),
                                        name="kv-tier-writer", daemon=True)
        self._writer.start()
        weakref.finalize(self, self._queue.put, None)
        _open_tiers.add(self)

    # ---- what the KV manager asks ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def read(self, block_hashes: Sequence[bytes]) -> list[Tensor]:
        """The payloads of the leading blocks of `block_hashes` the tier holds intact, in order: the
        first that is missing or fails its checks ends the list (a failed one is dropped and logged)."""
        payloads = []
        for block_hash in block_hashes:
            with self._lock:
                if block_hash not in self._index:
                    break
                self._index.move_to_end(block_hash)
                payload = self._pending.get(block_hash)
            if payload is None:
                payload = self._read_file(block_hash)
                if payload is None:
                    break
            payloads.append(payload)
        self.num_loaded += len(payloads)
        return payloads

    # ---- what the model runner gives -------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], payloads: Tensor) -> None:
        """Store block i's `payloads[i]` (uint8, [n, block_bytes], the tier's to keep) under
        `block_hashes[i]`; blocks the tier holds already are skipped."""
        if not self.enabled or self._closed:
            return
        for block_hash, payload in zip(block_hashes, payloads):
            with self._lock:
                if block_hash in self._index:
                    continue
                if (len(self._pending) + 1) * self.block_bytes > self.max_pending_bytes:
                    self.num_dropped += 1
                    continue
                self._index[block_hash] = None
                self._pending[block_hash] = payload
                evicted = self._evict_over_capacity()
            self.num_stored += 1
            self._queue.put(("write", block_hash, payload))
            for old in evicted:
                self._queue.put(("unlink", old, None))

    def flush(self) -> None:
        """Wait until every block put so far is written (or has failed)."""
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        """Write what is pending and stop the writer (idempotent; the tier takes no block after it)."""
        self._closed = True
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        _open_tiers.discard(self)

    # ---- internals ---------------------------------------------------------------------------

    def _file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + SUFFIX)

    def _open(self) -> bool:
        """Make the directory and index what an earlier process left there, oldest first (newest
        kept when it holds more than fits). False, logged, when the directory is unusable."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.path))
            found = []
            for entry in os.scandir(self.path):
                if entry.name.endswith(".tmp"):  # a write an earlier process did not finish
                    os.unlink(entry.path)
                elif entry.name.endswith(SUFFIX):
                    size = entry.stat().st_size
                    if size == self.file_bytes:
                        found.append((entry.stat().st_mtime_ns, entry.name))
                    else:
                        logger.warning("KV tier: %s is damaged (%d bytes, not %d); deleted", entry.name, size,
                                       self.file_bytes)
                        self.num_corrupt += 1
                        os.unlink(entry.path)
        except OSError as e:
            logger.warning("KV tier: cannot use %s (%s); running without the tier", self.path, e)
            return False
        found.sort()
        for _, name in found[max(0, len(found) - self.capacity_blocks):]:
            try:
                self._index[bytes.fromhex(name[: -len(SUFFIX)])] = None
            except ValueError:
                continue  # not a name this tier writes
        for _, name in found[: max(0, len(found) - self.capacity_blocks)]:
            self._unlink(self.path / name)
        if found:
            logger.info("KV tier: %d blocks found in %s", len(self._index), self.path)
        return True

    def _evict_over_capacity(self) -> list[bytes]:
        evicted = []
        while len(self._index) > self.capacity_blocks:
            old, _ = self._index.popitem(last=False)
            self._pending.pop(old, None)
            evicted.append(old)
        return evicted

    def _drop(self, block_hash: bytes) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
            self._pending.pop(block_hash, None)

    def _read_file(self, block_hash: bytes) -> Tensor | None:
        """The block's payload from its file, or None (dropped, logged) if the file is missing,
        short, or fails the header or checksum checks."""
        path = self._file(block_hash)
        buffer = bytearray(self.file_bytes)
        try:
            with open(path, "rb") as f:
                size = f.readinto(buffer)
                trailing = f.read(1)
        except OSError as e:
            return self._corrupt(block_hash, f"cannot read it ({e})")
        if size != self.file_bytes or trailing:
            return self._corrupt(block_hash, f"it has {size}{'+' if trailing else ''} bytes, not {self.file_bytes}")
        magic, version, namespace, stored_hash, length, crc = HEADER.unpack_from(buffer)
        view = memoryview(buffer)[HEADER.size:]
        if (magic, version, namespace, stored_hash, length) != (MAGIC, FORMAT_VERSION, self.namespace, block_hash,
                                                                 self.block_bytes):
            return self._corrupt(block_hash, "its header does not name this block")
        if zlib.crc32(view) != crc:
            return self._corrupt(block_hash, "its checksum does not match")
        return torch.frombuffer(buffer, dtype=torch.uint8, offset=HEADER.size)

    def _corrupt(self, block_hash: bytes, why: str) -> None:
        logger.warning("KV tier: block %s is damaged (%s); dropped, it will be computed", block_hash.hex()[:16], why)
        self.num_corrupt += 1
        self._drop(block_hash)
        self._queue.put(("unlink", block_hash, None))
        return None

    def _do(self, op: str, block_hash: bytes, payload: Tensor | None) -> None:
        if op == "write":
            self._write(block_hash, payload)
            return
        with self._lock:
            held = block_hash in self._index
        if not held:  # unless it was put again since: then its new file stays
            self._unlink(self._file(block_hash))

    def _write(self, block_hash: bytes, payload: Tensor) -> None:
        with self._lock:
            if self._pending.get(block_hash) is not payload:
                return  # evicted (or dropped) before its turn
        path = self._file(block_hash)
        tmp = path.with_name(path.name + ".tmp")
        data = payload.numpy().data
        try:
            with open(tmp, "wb") as f:
                f.write(HEADER.pack(MAGIC, FORMAT_VERSION, self.namespace, block_hash, self.block_bytes,
                                    zlib.crc32(data)))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            self.num_write_errors += 1
            if e.errno not in self._errors_logged:
                self._errors_logged.add(e.errno)
                logger.warning("KV tier: cannot write to %s (%s); blocks that fail to write are computed again "
                               "when needed", self.path, e)
            self._unlink(tmp)
            self._drop(block_hash)
            return
        with self._lock:
            if self._pending.get(block_hash) is payload:
                del self._pending[block_hash]
            held = block_hash in self._index
        if not held:  # evicted while it was being written
            self._unlink(path)

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _write_loop(tier_ref: weakref.ref, jobs: queue.Queue) -> None:
    """The writer thread: the tier's writes and deletions, in the order they were asked for. It runs
    at the lowest CPU priority (Linux: per thread), so that it takes the cores the steps leave idle
    rather than slowing them; if it falls behind, stores past MAX_PENDING_BYTES are dropped."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
    while True:
        item = jobs.get()
        try:
            tier = tier_ref()
            if item is None or tier is None:
                return
            tier._do(*item)
            del tier
        finally:
            jobs.task_done()


@atexit.register
def _close_open_tiers() -> None:
    """Blocks still pending at exit are written: a restart finds them."""
    for tier in list(_open_tiers):
        tier.close()
