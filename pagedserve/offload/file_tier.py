"""The KV tier behind the block pool: blocks as files in one directory, keyed by the prefix cache's
chained block hashes, bounded in bytes, the least recently used going first.

A block is one unit: its K and V for every layer, laid out block-major (`transfer.py`), so storing
or loading it is one file. Each file is a header (magic, format version, the namespace, the block
hash, the payload's length and CRC-32) and the payload. A read checks all of them; a block that
fails is dropped from the tier with a log line and never served.

No file is touched on the caller's thread: the engine's step loop only ever reads memory.
- Writes go to a background thread (`kv-tier-writer`); until its file is written a block is served
  from the memory it was copied into (at most `max_pending_bytes` of them; past it a store is
  dropped).
- Reads go to one reader thread (`kv-tier-reader`): `prefetch` asks it to read the files of the
  blocks an admission would load, into memory (at most `max_read_ahead_bytes`), and returns a
  future; `read` serves payloads from memory only. The caller waits for the future outside its
  step, at most `read_timeout` seconds; what is not in memory by then is computed. A reader stuck
  on a file longer than `read_timeout` (a hung filesystem) is not joined by another: while it is
  stuck, `prefetch` starts nothing (said once in the log) and every block is computed.
- Files are opened with O_NONBLOCK | O_NOFOLLOW and checked, once open, to be a regular file of a
  block file's size: a FIFO, a symbolic link, a directory or a device in a block's place never
  blocks a thread and is dropped as damaged. The directory scan at start refuses such entries
  without opening them; writes create their temporary file exclusively (never opening what is there).

The directory holds one subdirectory per namespace: a digest of the model's identity, the dtype and
the KV layout (`namespace_digest`), so a different model or format never reads an entry, and a new
process on the same model finds what an earlier one wrote.

Faults cost the speed-up only: a directory that cannot be made turns the tier off, a write that
fails (a full disk, say) loses that block, and each is logged. Closing a tier writes what is pending,
for at most CLOSE_SECONDS (so does the interpreter's exit, for every tier still open).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
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
# Blocks read from their files, waiting for the admission that asked for them, hold at most this;
# a read that would need more stops there (its remaining blocks are computed).
MAX_READ_AHEAD_BYTES = 512 << 20
# How long a request waits for its blocks' files to be read before they are computed instead, and
# how long one file read may take before the reader counts as stuck (EngineConfig's
# kv_offload_read_timeout sets it for an engine).
READ_TIMEOUT = 5.0
# How long closing a tier (at shutdown; at interpreter exit, for every open tier together) waits for
# its pending writes before the rest are given up.
CLOSE_SECONDS = 10.0
# Opening a block file never blocks (a FIFO), never follows a link, and is not inherited.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

_open_tiers: weakref.WeakSet[FileTier] = weakref.WeakSet()


def namespace_digest(identity: dict) -> bytes:
    """16 bytes naming what a block's bytes mean: the model, its dtype, the KV layout."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:16]


def model_files_identity(path: str) -> list:
    """The model's files as (name, size, mtime): a rewritten checkpoint is another model."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def file_kind(mode: int) -> str:
    """What a stat mode names, in words (for a log line)."""
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "not a regular file"


class FileTier:
    """Blocks of `block_bytes` bytes as files under `directory`, at most `capacity_bytes` of them."""

    def __init__(self, directory: str, capacity_bytes: int, identity: dict, block_bytes: int,
                 max_pending_bytes: int = MAX_PENDING_BYTES, read_timeout: float = READ_TIMEOUT,
                 max_read_ahead_bytes: int = MAX_READ_AHEAD_BYTES) -> None:
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        if self.capacity_blocks < 1:
            raise ValueError(f"kv_offload_bytes ({capacity_bytes}) holds no block of {self.file_bytes} bytes")
        self.namespace = namespace_digest(identity)
        self.path = Path(directory) / self.namespace.hex()
        self.max_pending_bytes = max_pending_bytes
        self.read_timeout = read_timeout
        self.max_read_ahead_bytes = max_read_ahead_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # every block the tier holds, LRU first
        self._pending: dict[bytes, Tensor] = {}  # of those, the blocks whose files are not written yet
        self._loaded: OrderedDict[bytes, Tensor] = OrderedDict()  # of those, blocks read ahead, oldest first
        self._queue: queue.Queue = queue.Queue()  # the writer's jobs
        self._reads: queue.Queue = queue.Queue()  # the reader's jobs
        self._read_started: float | None = None  # when the reader opened its current file (None: idle)
        self._stall_logged = False
        self._errors_logged: set[int] = set()
        # Figures, in blocks.
        self.num_stored = 0  # written (or being written)
        self.num_loaded = 0  # read back
        self.num_dropped = 0  # not stored: too many writes pending
        self.num_corrupt = 0  # found damaged (at the scan at start, or read back) and dropped
        self.num_write_errors = 0
        self._closed = False
        self.enabled = self._open()
        # The threads hold the tier weakly, so a dropped engine's tier is collected (and its threads
        # told to stop) even if nobody closed it.
        self._writer = threading.Thread(target=_write_loop, args=(weakref.ref(self), self._queue),
                                        name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=_read_loop, args=(weakref.ref(self), self._reads),
                                        name="kv-tier-reader", daemon=True)
        self._reader.start()
        weakref.finalize(self, self._queue.put, None)
        weakref.finalize(self, self._reads.put, None)
        _open_tiers.add(self)

    # ---- what the KV manager asks ----------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def read(self, block_hashes: Sequence[bytes]) -> list[Tensor]:
        """The payloads of the leading blocks of `block_hashes` that the tier holds in memory (not
        written yet, or read ahead by `prefetch`), in order; the first it holds only as a file, or
        not at all, ends the list. No file is touched: it is safe on the step loop."""
        payloads = []
        with self._lock:
            for block_hash in block_hashes:
                if block_hash not in self._index:
                    break
                payload = self._pending.get(block_hash)
                if payload is None:
                    payload = self._loaded.pop(block_hash, None)  # its admission takes it: the pool holds it now
                if payload is None:
                    break
                self._index.move_to_end(block_hash)
                payloads.append(payload)
        self.num_loaded += len(payloads)
        return payloads

    def prefetch(self, block_hashes: Sequence[bytes]) -> Future | None:
        """Have the reader thread bring the leading blocks of `block_hashes` that the tier holds
        into memory, for a `read` to find; a future that is done once they are there (its result:
        how many), or once the reader stopped (a missing or damaged block, the read-ahead bound).
        None when there is nothing to wait for: every such block is in memory already, or reads
        are off (the tier is disabled, closed, or its reader is stuck on a file)."""
        if not self.writable or self._reader_stuck():
            return None
        wanted = []
        with self._lock:
            for block_hash in block_hashes:
                if block_hash not in self._index:
                    break
                wanted.append(block_hash)
            on_disk = any(h not in self._pending and h not in self._loaded for h in wanted)
        if not on_disk:
            return None
        future: Future = Future()
        self._reads.put((wanted, time.monotonic() + self.read_timeout, future))
        return future

    # ---- what the model runner gives -------------------------------------------------------

    def put(self, block_hashes: Sequence[bytes], payloads: Tensor) -> None:
        """Store block i's `payloads[i]` (uint8, [n, block_bytes], the tier's to keep) under
        `block_hashes[i]`; blocks the tier holds already are skipped."""
        if not self.writable:
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

    @property
    def writable(self) -> bool:
        """Whether `put` takes blocks: the tier is enabled and not closed."""
        return self.enabled and not self._closed

    @property
    def num_pending(self) -> int:
        """Blocks put whose files are not written yet."""
        return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block put so far is written (or has failed), at most `timeout` seconds
        (None: as long as it takes). False if some are still pending."""
        jobs = self._queue
        if self._closed and not self._writer.is_alive():
            return not jobs.unfinished_tasks
        deadline = None if timeout is None else time.monotonic() + timeout
        with jobs.all_tasks_done:
            while jobs.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                jobs.all_tasks_done.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Write what is pending and stop the threads (idempotent; the tier takes no block after it).
        Waits at most `timeout` seconds for the writes (None: as long as they take); False if some
        were left unwritten."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._reads.put(None)
            _open_tiers.discard(self)
        self._writer.join(timeout)
        return not self._writer.is_alive()

    # ---- internals ---------------------------------------------------------------------------

    def _file(self, block_hash: bytes) -> Path:
        return self.path / (block_hash.hex() + SUFFIX)

    def _open(self) -> bool:
        """Make the directory and index what an earlier process left there, oldest first (newest
        kept when it holds more than fits). False, logged, when the directory is unusable. Entries
        are judged by lstat, never opened: anything but a regular file of a block file's size is
        dropped (deleted, unless it is a directory) with a log line."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not os.access(self.path, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.path))
            entries = list(os.scandir(self.path))
        except OSError as e:
            logger.warning("KV tier: cannot use %s (%s); running without the tier", self.path, e)
            return False
        found = []
        for entry in entries:
            if not entry.name.endswith((".tmp", SUFFIX)):
                continue
            try:
                st = entry.stat(follow_symlinks=False)  # lstat: nothing is opened
            except OSError:
                continue  # gone meanwhile
            mode, size = st.st_mode, st.st_size
            if entry.name.endswith(".tmp"):  # a write an earlier process did not finish
                if not stat.S_ISDIR(mode):
                    self._unlink(Path(entry.path))
            elif not stat.S_ISREG(mode):
                logger.warning("KV tier: %s is %s, not a block file; %s", entry.name, file_kind(mode),
                               "ignored" if stat.S_ISDIR(mode) else "deleted")
                self.num_corrupt += 1
                if not stat.S_ISDIR(mode):
                    self._unlink(Path(entry.path))
            elif size != self.file_bytes:
                logger.warning("KV tier: %s is damaged (%d bytes, not %d); deleted", entry.name, size,
                               self.file_bytes)
                self.num_corrupt += 1
                self._unlink(Path(entry.path))
            else:
                found.append((st.st_mtime_ns, entry.name))
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
            self._loaded.pop(old, None)
            evicted.append(old)
        return evicted

    def _drop(self, block_hash: bytes) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
            self._pending.pop(block_hash, None)
            self._loaded.pop(block_hash, None)

    def _reader_stuck(self) -> bool:
        """Whether the reader has been on one file longer than `read_timeout` (said once per stall)."""
        started = self._read_started
        if started is None or time.monotonic() - started <= self.read_timeout:
            return False
        if not self._stall_logged:
            self._stall_logged = True
            logger.warning("KV tier: a read in %s has not returned for %.0f s (a hung filesystem?); no block is "
                           "read from the tier until it does, they are computed", self.path,
                           time.monotonic() - started)
        return True

    def _fetch(self, block_hashes: list[bytes], deadline: float, future: Future) -> None:
        """The reader's job: bring `block_hashes`, in order, into the read-ahead memory, until one is
        missing or damaged, the job's deadline passes (its request went on without it), or the
        read-ahead bound is reached by this job's own blocks (older ones give way)."""
        done = 0
        for block_hash in block_hashes:
            if time.monotonic() > deadline:
                break
            with self._lock:
                if block_hash not in self._index:
                    break
                payload = self._pending.get(block_hash)
                if payload is None and block_hash in self._loaded:
                    self._loaded.move_to_end(block_hash)
                    done += 1
                    continue
            if payload is None:
                payload = self._read_file(block_hash)
                if payload is None:
                    break
            with self._lock:
                if block_hash not in self._index or not self._make_room(block_hashes[:done]):
                    break
                self._loaded[block_hash] = payload
            done += 1
        if not future.done():
            future.set_result(done)

    def _make_room(self, own: Sequence[bytes]) -> bool:
        """Make room for one more block read ahead, evicting the oldest not in `own` (under the lock)."""
        keep = set(own)
        while (len(self._loaded) + 1) * self.block_bytes > self.max_read_ahead_bytes:
            victim = next((h for h in self._loaded if h not in keep), None)
            if victim is None:
                return False
            del self._loaded[victim]
        return True

    def _read_file(self, block_hash: bytes) -> Tensor | None:
        """The block's payload from its file, or None (dropped, logged) if the file is missing, not a
        regular file, of the wrong size, or fails the header or checksum checks. The reader thread
        only; the time it spends on the file is watched (`_reader_stuck`)."""
        self._read_started = time.monotonic()
        try:
            return self._read_checked(block_hash)
        finally:
            self._read_started = None
            if self._stall_logged:
                self._stall_logged = False
                logger.warning("KV tier: the read in %s has returned; blocks are read from the tier again", self.path)

    def _read_checked(self, block_hash: bytes) -> Tensor | None:
        try:
            fd = os.open(self._file(block_hash), _OPEN_FLAGS)
        except OSError as e:  # ELOOP: a symbolic link
            return self._corrupt(block_hash, f"cannot open it ({e.strerror})")
        buffer = bytearray(self.file_bytes)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return self._corrupt(block_hash, f"it is {file_kind(st.st_mode)}")
            if st.st_size != self.file_bytes:
                return self._corrupt(block_hash, f"it has {st.st_size} bytes, not {self.file_bytes}")
            view, size = memoryview(buffer), 0
            while size < self.file_bytes:
                n = os.readv(fd, [view[size:]])
                if n == 0:
                    break
                size += n
            trailing = os.read(fd, 1)
        except OSError as e:
            return self._corrupt(block_hash, f"cannot read it ({e})")
        finally:
            os.close(fd)
        if size != self.file_bytes or trailing:
            return self._corrupt(block_hash, f"it has {size}{'+' if trailing else ''} bytes, not {self.file_bytes}")
        magic, version, namespace, stored_hash, length, crc = HEADER.unpack_from(buffer)
        if (magic, version, namespace, stored_hash, length) != (MAGIC, FORMAT_VERSION, self.namespace, block_hash,
                                                                 self.block_bytes):
            return self._corrupt(block_hash, "its header does not name this block")
        if zlib.crc32(memoryview(buffer)[HEADER.size:]) != crc:
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
            self._unlink(tmp)  # a leftover: "x" below never opens what is there (a FIFO would block)
            with open(tmp, "xb") as f:
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
            if not isinstance(e, FileExistsError):
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


def _read_loop(tier_ref: weakref.ref, jobs: queue.Queue) -> None:
    """The reader thread: read-ahead jobs, one at a time, in the order they were asked for (at the
    normal priority: a request waits for them)."""
    while True:
        item = jobs.get()
        tier = tier_ref()
        if item is None or tier is None:
            return
        _, _, future = item
        try:
            tier._fetch(*item)
        except BaseException as e:  # never leave a waiter hanging on a future nobody sets
            if not future.done():
                future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            logger.exception("KV tier: a read failed")
        del tier


@atexit.register
def _close_open_tiers() -> None:
    """Blocks still pending at exit are written (at most CLOSE_SECONDS in all): a restart finds them."""
    deadline = time.monotonic() + CLOSE_SECONDS
    for tier in list(_open_tiers):
        pending = tier.num_pending
        if not tier.close(max(0.0, deadline - time.monotonic())):
            logger.warning("KV tier: %d blocks were not written to %s within %.0f s at exit; they are lost",
                           tier.num_pending, tier.path, CLOSE_SECONDS)
        elif pending:
            logger.info("KV tier: %d pending blocks written to %s at exit", pending, tier.path)
