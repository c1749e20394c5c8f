"""An adapter directory's files, read so that no file can stall or exhaust the process reading it.

A path is checked with one stat; a file is opened by its name (nothing here lists a directory)
without blocking, so a named pipe is refused rather than waited on, and must be a regular file. No
file is mapped into memory (a file of /proc or a device cannot be), and each read has a bound given
before it starts: a file above it is refused by its size, before a byte is read, or as soon as the
read passes it (a file of /proc reports a size of 0). Every OSError on the way is a ValueError that
names the file and the reason, as is a file that is not what it claims to be.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

# adapter_config.json: PEFT writes a few KiB, and a long rank_pattern of every module tens of KiB.
MAX_CONFIG_BYTES = 1 << 20
# A safetensors header is bounded by the caller (what the model can hold), and never above this.
MAX_HEADER_BYTES = 16 << 20
_READ_CHUNK = 1 << 20
# Bytes per element of every dtype the safetensors format names (sub-byte ones aside).
_DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class HeaderEntry(NamedTuple):
    """One tensor of a safetensors file, as its header describes it."""
    dtype: str
    shape: tuple[int, ...]
    start: int  # its bytes' offsets in the data that follows the header
    end: int


class SafetensorsHeader(NamedTuple):
    entries: dict[str, HeaderEntry]  # by tensor name, in the header's order
    data_start: int  # where the data begins in the file
    data_size: int


def shown(path: str | os.PathLike) -> str:
    """A path as a message names it: whole, unless it is too long to read in one."""
    text = str(path)
    return text if len(text) <= 300 else f"{text[:200]}...{text[-60:]} ({len(text)} characters)"


def reason(e: OSError) -> str:
    """An OSError's cause in words and by name: 'File name too long (ENAMETOOLONG)'."""
    name = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    return f"{e.strerror or e} ({name})" if name else str(e.strerror or e)


def check_directory(path: str, where: str, what: str) -> Path:
    """The directory `path` names, checked with one stat; ValueError (prefixed `where`) saying
    why it is not one. `what`: the kind of directory expected, for the message."""
    directory = Path(os.path.expanduser(path))  # (Path.expanduser raises for an unknown ~user)
    try:
        st = os.stat(directory)
    except UnicodeEncodeError:  # a lone surrogate: no file has that name
        raise ValueError(f"{where}: the path is not valid text (it holds a lone surrogate); pass {what}") from None
    except ValueError:  # os refuses a NUL before any system call
        raise ValueError(f"{where}: the path holds a NUL character; pass {what}") from None
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise ValueError(f"{where}: does not exist; pass {what}") from None
        if e.errno == errno.ENOTDIR:
            raise ValueError(f"{where}: does not exist (a part of the path is not a directory); pass {what}") from None
        raise ValueError(f"{where}: cannot be opened: {reason(e)}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{where}: is {_kind(st.st_mode)}, not {what}")
    return directory


@contextmanager
def open_regular(file: Path, where: str) -> Iterator[tuple[int, os.stat_result] | None]:
    """(a descriptor, its stat) of `file`, which must be a regular file; None if there is no such
    file. Opened without blocking (a named pipe with no writer would block open and read) and
    closed on leaving."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    except OSError as e:
        raise ValueError(f"{where}: cannot open {file.name}: {reason(e)}") from None
    try:
        st = _stat(fd, file, where)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: {file.name} is {_kind(st.st_mode)}, not a regular file")
        yield fd, st
    finally:
        os.close(fd)


def read_at_most(fd: int, limit: int, file: Path, where: str, bound: str) -> bytes:
    """The file's bytes from where `fd` stands, refused once they pass `limit` (`bound` says
    what that bound is, for the message); a file that says it is larger is refused unread."""
    size = _stat(fd, file, where).st_size
    if size > limit:
        raise ValueError(f"{where}: {file.name} is {size:,} bytes, above the bound of {limit:,} bytes ({bound})")
    chunks, total = [], 0
    while True:
        chunk = _read(fd, min(_READ_CHUNK, limit + 1 - total), file, where)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ValueError(f"{where}: {file.name} holds more than {limit:,} bytes, the bound ({bound})")


def read_exactly(fd: int, offset: int, length: int, file: Path, where: str) -> bytearray:
    """`length` bytes of the file from `offset` (a bytearray: tensors may be views of it)."""
    data = bytearray(length)
    view, done = memoryview(data), 0
    while done < length:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise ValueError(f"{where}: cannot read {file.name}: {reason(e)}") from None
        if n == 0:
            raise ValueError(f"{where}: {file.name} ended after {offset + done:,} bytes while being read, where its "
                             f"header promised {offset + length:,}: it was cut short or replaced meanwhile")
        done += n
    return data


def parse_json_object(data: bytes, what: str) -> dict[str, Any]:
    """The JSON object `data` holds; ValueError starting with `what` (the file it came from) for
    anything else. No byte of it is quoted: a path may lead to a file that holds secrets."""
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: not UTF-8 text (at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{what} is not valid JSON here: it nests too deeply") from None
    except ValueError as e:  # JSONDecodeError, or an integer of too many digits
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} holds a JSON {type(value).__name__}, not the object expected")
    return value


def read_safetensors_header(fd: int, size: int, file: Path, where: str, max_bytes: int, max_tensors: int,
                            bound: str) -> SafetensorsHeader:
    """A safetensors file's header, its length and its number of tensors bounded (`bound`: why
    these bounds, for the message), checked as the format defines it: each tensor's bytes exactly
    its shape's, the tensors' bytes one after the other from the start of the data to the file's
    end. Reads the header only."""
    invalid = f"{where}: {file.name} is not a valid safetensors file"
    if size < 8:
        raise ValueError(f"{invalid}: it is {size} bytes long, too short for the 8 bytes that give its header's length")
    (length,) = struct.unpack("<Q", bytes(read_exactly(fd, 0, 8, file, where)))
    if 8 + length > size:
        raise ValueError(f"{invalid}: its header is {length:,} bytes, but the file is {size:,} bytes long (cut short?)")
    if length > max_bytes:
        raise ValueError(f"{where}: {file.name}'s header is {length:,} bytes, above the bound of {max_bytes:,} "
                         f"bytes ({bound})")
    header = parse_json_object(bytes(read_exactly(fd, 8, length, file, where)), f"{invalid}: its header")
    header.pop("__metadata__", None)
    if len(header) > max_tensors:
        raise ValueError(f"{where}: {file.name} holds {len(header):,} tensors, above the bound of {max_tensors:,} "
                         f"({bound})")
    entries = {}
    for name, entry in header.items():
        problem = _entry_problem(entry)
        if problem is not None:
            raise ValueError(f"{invalid}: tensor {name!r}: {problem}")
        entries[name] = HeaderEntry(entry["dtype"], tuple(entry["shape"]), *entry["data_offsets"])
    data_size = size - 8 - length
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        if entry.start != position:
            raise ValueError(f"{invalid}: tensor {name!r}'s bytes start at {entry.start:,}, not at {position:,} "
                             f"where the tensor before ends")
        position = entry.end
        itemsize = _DTYPE_SIZES.get(entry.dtype)
        numel = 1
        for n in entry.shape:
            numel *= n
        if itemsize is not None and entry.end - entry.start != numel * itemsize:
            raise ValueError(f"{invalid}: tensor {name!r} has {entry.end - entry.start:,} bytes, but its shape "
                             f"{list(entry.shape)} of {entry.dtype} takes {numel * itemsize:,}")
    if position != data_size:
        raise ValueError(f"{invalid}: its tensors take {position:,} bytes, but {data_size:,} follow its header "
                         f"(cut short, or other bytes added)")
    return SafetensorsHeader(entries, 8 + length, data_size)


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        return "its entry must be an object of dtype, shape and data_offsets"
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(entry["dtype"], str):
        return "its dtype is not a string"
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        return "its shape is not a list of integers >= 0"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(n) for n in offsets)
            and offsets[0] <= offsets[1]):
        return "its data_offsets are not [start, end] with 0 <= start <= end"
    return None


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stat(fd: int, file: Path, where: str) -> os.stat_result:
    try:
        return os.fstat(fd)
    except OSError as e:
        raise ValueError(f"{where}: cannot read {file.name}: {reason(e)}") from None


def _read(fd: int, n: int, file: Path, where: str) -> bytes:
    try:
        return os.read(fd, n)
    except OSError as e:
        raise ValueError(f"{where}: cannot read {file.name}: {reason(e)}") from None


def _kind(mode: int) -> str:
    """What a file that is not a directory or a regular file is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a file")
