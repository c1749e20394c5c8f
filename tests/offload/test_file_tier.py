"""The file tier: blocks round-trip through files, the size bound evicts the least recently used,
a new tier on the same directory and identity finds them, and damage is caught, never served."""

import errno
import hashlib
import logging
import os
import threading
import time

import pytest
import torch

from pagedserve.offload import file_tier
from pagedserve.offload.file_tier import HEADER, SUFFIX, FileTier

BLOCK_BYTES = 64
IDENTITY = {"model": "m", "dtype": "float32", "block_size": 16}


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payloads(*seeds: int) -> torch.Tensor:
    return torch.stack([torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(s)) for s in seeds])


def tier(path, capacity_blocks: int = 8, identity=IDENTITY, **kw) -> FileTier:
    return FileTier(str(path), capacity_blocks * (HEADER.size + BLOCK_BYTES), identity, BLOCK_BYTES, **kw)


def files(t: FileTier) -> list[str]:
    return sorted(p.name for p in t.path.iterdir())


def read_back(t: FileTier, hashes) -> list[torch.Tensor]:
    """What an admission gets after waiting for the read-ahead: prefetch, wait, read from memory."""
    future = t.prefetch(hashes)
    if future is not None:
        future.result(timeout=30)
    return t.read(hashes)


def test_blocks_round_trip_from_memory_then_from_files(tmp_path):
    t = tier(tmp_path)
    data = payloads(1, 2, 3)
    t.put([h(1), h(2), h(3)], data)
    assert [h(i) in t for i in (1, 2, 3, 4)] == [True, True, True, False]
    assert all(torch.equal(a, b) for a, b in zip(t.read([h(1), h(2), h(3)]), data))  # pending or written
    t.flush()
    assert files(t) == sorted(x.hex() + SUFFIX for x in (h(1), h(2), h(3)))
    t._pending.clear()  # force reads from the files
    got = read_back(t, [h(1), h(2), h(3), h(4)])
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, data))
    assert read_back(t, [h(4), h(1)]) == []  # a prefix: the first missing block ends it
    t.close()


def test_a_block_put_twice_is_stored_once(tmp_path):
    t = tier(tmp_path)
    t.put([h(1)], payloads(1))
    t.put([h(1)], payloads(9))
    t.flush()
    assert t.num_stored == 1
    assert torch.equal(read_back(t, [h(1)])[0], payloads(1)[0])
    t.close()


def test_the_size_bound_evicts_the_least_recently_used(tmp_path):
    t = tier(tmp_path, capacity_blocks=3)
    t.put([h(1), h(2), h(3)], payloads(1, 2, 3))
    read_back(t, [h(1)])  # 1 is now the most recently used
    t.put([h(4)], payloads(4))
    t.flush()
    assert [h(i) in t for i in (1, 2, 3, 4)] == [True, False, True, True]
    assert files(t) == sorted(x.hex() + SUFFIX for x in (h(1), h(3), h(4)))
    t.close()


def test_a_new_tier_on_the_same_directory_finds_the_blocks_newest_kept(tmp_path):
    t = tier(tmp_path, capacity_blocks=4)
    for i in range(4):
        t.put([h(i)], payloads(i))
        t.flush()
        os.utime(t._file(h(i)), ns=(i * 10**9, i * 10**9))  # an order the mtimes show
    t.close()
    again = tier(tmp_path, capacity_blocks=2)
    assert [h(i) in again for i in range(4)] == [False, False, True, True]
    assert torch.equal(read_back(again, [h(3)])[0], payloads(3)[0])
    assert len(files(again)) == 2  # the older files were deleted
    again.close()


def test_another_identity_never_sees_the_blocks(tmp_path):
    t = tier(tmp_path)
    t.put([h(1)], payloads(1))
    t.close()
    other = tier(tmp_path, identity={**IDENTITY, "dtype": "bfloat16"})
    assert h(1) not in other and read_back(other, [h(1)]) == []
    other.close()


def _written(tmp_path, n=2) -> FileTier:
    t = tier(tmp_path)
    t.put([h(i) for i in range(n)], payloads(*range(n)))
    t.close()
    return tier(tmp_path)


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "append", "another block's file",
                                    "another namespace", "truncate after the start"])
def test_a_damaged_file_is_dropped_with_a_log_line_never_served(tmp_path, caplog, damage):
    t = _written(tmp_path)
    path = t._file(h(0))
    raw = bytearray(path.read_bytes())
    if damage == "flip a payload byte":
        raw[-1] ^= 0xFF
    elif damage in ("truncate", "truncate after the start"):
        raw = raw[:-7]
    elif damage == "append":
        raw += b"x"
    elif damage == "another block's file":
        raw = bytearray(t._file(h(1)).read_bytes())
    else:
        raw[6:22] = bytes(16)
    if damage == "truncate":  # before the tier opens: caught by its size
        path.write_bytes(bytes(raw))
        with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
            t = tier(tmp_path)
    else:
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        assert read_back(t, [h(0), h(1)]) == []
    assert "damaged" in caplog.text
    assert h(0) not in t and h(1) in t and t.num_corrupt == 1
    t.flush()
    assert not path.exists()
    assert len(read_back(t, [h(1)])) == 1  # the intact block is still served
    t.close()


def test_an_unusable_directory_turns_the_tier_off_with_a_log_line(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        t = tier(blocker / "tier")
    assert not t.enabled and "running without the tier" in caplog.text
    t.put([h(1)], payloads(1))
    assert h(1) not in t and read_back(t, [h(1)]) == []
    t.close()


def test_a_failed_write_loses_only_that_block_with_one_log_line(tmp_path, caplog, monkeypatch):
    t = tier(tmp_path)
    real_open = open

    def full_disk(path, mode="r", *args, **kw):
        if "w" in mode or "x" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kw)

    monkeypatch.setattr(file_tier, "open", full_disk, raising=False)
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        t.put([h(1), h(2)], payloads(1, 2))
        t.flush()
    assert caplog.text.count("cannot write") == 1 and t.num_write_errors == 2
    assert h(1) not in t and h(2) not in t and files(t) == []
    monkeypatch.undo()
    t.put([h(3)], payloads(3))  # the disk has room again
    t.flush()
    assert h(3) in t and len(read_back(t, [h(3)])) == 1
    t.close()


def test_stores_past_the_pending_bound_are_dropped(tmp_path):
    t = tier(tmp_path, max_pending_bytes=2 * BLOCK_BYTES)
    gate = threading.Event()
    write = t._do
    t._do = lambda op, *rest: gate.wait() if op == "hold" else write(op, *rest)
    t._queue.put(("hold", None, None))  # the writer waits: every put stays pending
    t.put([h(1), h(2), h(3)], payloads(1, 2, 3))
    assert [h(i) in t for i in (1, 2, 3)] == [True, True, False] and t.num_dropped == 1
    gate.set()
    t.flush()
    assert len(files(t)) == 2
    t.close()


def test_too_small_a_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        FileTier(str(tmp_path), HEADER.size + BLOCK_BYTES - 1, IDENTITY, BLOCK_BYTES)


def test_a_closed_tier_takes_no_block_and_flush_returns(tmp_path):
    t = tier(tmp_path)
    t.put([h(1)], payloads(1))
    t.close()
    t.close()
    t.put([h(2)], payloads(2))  # after close: nothing is queued for a writer that is gone
    t.flush()
    assert h(1) in t and h(2) not in t


def test_read_serves_memory_only_and_prefetch_brings_the_files_in(tmp_path, monkeypatch):
    t = _written(tmp_path, n=3)  # a new tier over three written files: none in memory
    opened = []
    real_read = FileTier._read_checked
    monkeypatch.setattr(FileTier, "_read_checked", lambda self, bh: opened.append(threading.current_thread()) or
                        real_read(self, bh))
    assert t.read([h(0), h(1), h(2)]) == [] and opened == []  # no file is touched by read
    future = t.prefetch([h(0), h(1), h(2), h(9)])
    assert future.result(timeout=30) == 3
    assert {thread.name for thread in opened} == {"kv-tier-reader"}
    assert t.prefetch([h(0), h(1)]) is None  # in memory now: nothing to wait for
    got = t.read([h(0), h(1), h(2)])
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, payloads(0, 1, 2)))
    assert t.read([h(0)]) == []  # taken by that admission: the pool holds it now
    t.close()


def _replace(path, kind: str, good_file) -> None:
    """Put something that is not a block file in `path`'s place."""
    os.unlink(path)
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symbolic link to a block file":
        os.symlink(good_file, path)
    else:
        os.symlink("/dev/zero", path)


NOT_BLOCK_FILES = ["FIFO", "directory", "symbolic link to a block file", "symbolic link to /dev/zero"]


@pytest.mark.parametrize("kind", NOT_BLOCK_FILES)
def test_a_non_regular_file_in_a_blocks_place_is_dropped_at_once(tmp_path, caplog, kind):
    """Opened without blocking or following a link, and refused once open: never served, never a hang."""
    t = _written(tmp_path, n=2)
    good = tmp_path / "good.kvblock.copy"
    good.write_bytes(t._file(h(0)).read_bytes())
    _replace(t._file(h(0)), kind, good)
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        assert t.prefetch([h(0), h(1)]).result(timeout=10) == 0
    assert caplog.text.count("damaged") == 1 and h(0) not in t and t.num_corrupt == 1
    assert t.read([h(0), h(1)]) == []
    assert len(read_back(t, [h(1)])) == 1  # the intact block is still served
    t.close()


def test_the_scan_at_open_refuses_what_is_not_a_regular_file_without_opening_it(tmp_path, caplog):
    t = _written(tmp_path, n=5)
    good = tmp_path / "good.kvblock.copy"
    good.write_bytes(t._file(h(0)).read_bytes())
    for i, kind in enumerate(NOT_BLOCK_FILES, start=1):
        _replace(t._file(h(i)), kind, good)
    os.mkfifo(t._file(h(7)).with_suffix(".kvblock.tmp"))  # unfinished writes' names too
    os.mkdir(t._file(h(8)).with_suffix(".kvblock.tmp"))
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        again = tier(tmp_path)
    assert again.enabled and [h(i) in again for i in range(5)] == [True, False, False, False, False]
    assert caplog.text.count("not a block file") == 4 and again.num_corrupt == 4
    kept = set(files(again))
    assert t._file(h(2)).name in kept and t._file(h(8)).name + ".tmp" in kept  # directories are left alone
    assert not {t._file(h(i)).name for i in (1, 3, 4)} & kept and t._file(h(7)).name + ".tmp" not in kept
    assert len(read_back(again, [h(0)])) == 1
    again.close()


def test_a_fifo_at_a_writes_temporary_name_does_not_block_the_writer(tmp_path):
    t = tier(tmp_path)
    os.mkfifo(t._file(h(1)).with_suffix(".kvblock.tmp"))  # opening it to write would wait for a reader
    t.put([h(1)], payloads(1))
    assert t.flush(timeout=10)
    t._pending.clear()
    assert torch.equal(read_back(t, [h(1)])[0], payloads(1)[0])
    t.close()


def test_a_stuck_reader_stops_reads_until_it_returns_said_once(tmp_path, caplog, monkeypatch):
    """A hung filesystem: the one reader waits on its file; past read_timeout the tier starts no
    read (no thread piles up), says so once, and reads again once the file returns."""
    t = _written(tmp_path, n=3)
    t.read_timeout = 0.2
    release = threading.Event()
    real_read = FileTier._read_checked
    monkeypatch.setattr(FileTier, "_read_checked", lambda self, bh: release.wait(30) and real_read(self, bh))
    stuck = t.prefetch([h(0)])
    while t._read_started is None:  # the reader is on h(0)'s file
        time.sleep(0.01)
    queued = t.prefetch([h(1)])  # behind it, before it counts as stuck
    threads = threading.active_count()
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger=file_tier.__name__):
        assert t.prefetch([h(1)]) is None and t.prefetch([h(2)]) is None
        assert caplog.text.count("has not returned") == 1
        assert not stuck.done() and not queued.done() and threading.active_count() == threads
        release.set()
        assert stuck.result(timeout=30) == 1
        assert queued.result(timeout=30) == 0  # past its deadline when its turn came: not read
    assert "read from the tier again" in caplog.text
    assert t.prefetch([h(2)]).result(timeout=30) == 1 and len(t.read([h(2)])) == 1
    t.close()


def test_a_stuck_writer_bounds_flush_and_close(tmp_path):
    t = tier(tmp_path)
    gate = threading.Event()
    write = t._do
    t._do = lambda op, *rest: gate.wait() if op == "hold" else write(op, *rest)
    t._queue.put(("hold", None, None))
    t.put([h(1)], payloads(1))
    assert not t.flush(timeout=0.2) and not t.close(timeout=0.2) and t.num_pending == 1
    gate.set()
    assert t.close(timeout=30) and t.num_pending == 0


def test_read_ahead_is_bounded_older_reads_giving_way(tmp_path):
    t = _written(tmp_path, n=4)
    t.max_read_ahead_bytes = 2 * BLOCK_BYTES
    assert t.prefetch([h(0), h(1), h(2)]).result(timeout=30) == 2  # its own blocks fill the bound: it stops
    assert t.prefetch([h(3)]).result(timeout=30) == 1  # the oldest read-ahead block gives way
    assert [len(t.read([h(i)])) for i in (0, 1, 3)] == [0, 1, 1]
    t.close()
