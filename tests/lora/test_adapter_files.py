"""An adapter directory read within bounds and without surprises: a config or a safetensors header
above its bound is refused by its size, unread; special files (named pipes, devices, files of
/proc) and paths the system refuses are ValueErrors that name the file and the reason, never an
OSError or a read that blocks; nothing lists the directory; and values that are not finite are
refused when an adapter is verified, not first when a request needs it."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.lora import files
from pagedserve.lora.files import MAX_CONFIG_BYTES, MAX_HEADER_BYTES
from pagedserve.lora.patterns import pattern_problem, suffix_matcher, suffix_matches
from pagedserve.lora.weights import (CONFIG_FILE, WEIGHTS_FILE, adapter_identity, header_bounds, load_adapter,
                                     read_adapter, verify_adapter)
from pagedserve.models.config import ModelConfig
from pagedserve.models.loader import load_config
from pagedserve.models.sharding import TPShard

MAX_RANK = 16
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> ModelConfig:
    return load_config(str(tiny_checkpoint("llama")[0]))  # 2 layers


@pytest.fixture
def adapter(tiny_adapter, tmp_path) -> Path:
    """A copy of a good adapter, to damage."""
    return Path(shutil.copytree(tiny_adapter("r4"), tmp_path / "adapter"))


def refused(path, config: ModelConfig, pattern: str) -> str:
    """read_adapter, verify_adapter and load_adapter all raise ValueError matching `pattern`, in
    a thread that must finish (a read that blocks fails the test); the message."""
    messages = []
    for check in (lambda: read_adapter(path, config, MAX_RANK),
                  lambda: verify_adapter(path, config, MAX_RANK, torch.float32),
                  lambda: load_adapter(path, config, MAX_RANK, torch.float32, TPShard.of(config))):
        error = finishes(check)
        assert isinstance(error, ValueError), repr(error)
        assert re.search(pattern, str(error)), str(error)
        messages.append(str(error))
    return messages[0]


def finishes(fn, seconds: float = 20) -> BaseException | None:
    """What fn() raised (None if nothing), run on a thread that must end within `seconds`."""
    outcome: list[BaseException | None] = []

    def run():
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still running after {seconds} s: a read blocked"
    return outcome[0]


def write_weights(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


# -- the bounds -------------------------------------------------------------------------------------------------

def test_a_config_above_its_bound_is_refused_by_its_size_unread(llama, adapter, monkeypatch):
    config = adapter / CONFIG_FILE
    os.truncate(config, 2 << 30)  # 2 GiB, sparse: made at once
    read = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    message = refused(adapter, llama, rf"LoRA adapter {adapter}: adapter_config\.json is 2,147,483,648 bytes, above "
                                      r"the bound of 1,048,576 bytes \(1 MiB, the bound on an adapter's config")
    assert str(adapter) in message and read == []


def test_a_config_that_reports_no_size_is_read_only_to_its_bound(llama, adapter, monkeypatch):
    # as a file of /proc does: its size is 0 whatever it holds
    config = adapter / CONFIG_FILE
    config.write_text(config.read_text() + " " * (2 * MAX_CONFIG_BYTES))
    real_fstat = os.fstat
    monkeypatch.setattr(files, "_stat", lambda fd, file, where: os.stat_result((*real_fstat(fd)[:6], 0, 0, 0, 0)))
    read = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    refused(adapter, llama, r"adapter_config\.json holds more than 1,048,576 bytes, the bound")
    assert sum(read) <= 3 * (MAX_CONFIG_BYTES + 1)  # three calls, each stopped one byte past the bound


def test_a_config_nested_too_deeply_is_refused(llama, adapter):
    (adapter / CONFIG_FILE).write_text("[" * 200_000)
    refused(adapter, llama, r"adapter_config\.json is not valid JSON here: it nests too deeply")


def test_a_header_above_its_bound_is_refused_unread(llama, adapter, monkeypatch):
    max_bytes, max_tensors, _ = header_bounds(llama)
    weights = adapter / WEIGHTS_FILE
    weights.write_bytes(struct.pack("<Q", 52_000_000))
    os.truncate(weights, 8 + 52_000_000)  # the file is as long as it claims (sparse)
    read = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: read.append(offset) or real_preadv(fd, buffers,
                                                                                                   offset))
    refused(adapter, llama, rf"adapter_model\.safetensors's header is 52,000,000 bytes, above the bound of "
                            rf"{max_bytes:,} bytes \(a LoRA adapter of all 7 projections of this model's 2 layers "
                            rf"holds 28 tensors; the bounds allow {max_tensors:,} tensors and {max_bytes:,} bytes")
    assert read == [0, 0, 0]  # the 8 bytes of the length, by each of the three


def test_a_header_of_more_tensors_than_the_model_can_have_is_refused(llama, adapter):
    _, max_tensors, _ = header_bounds(llama)
    count = max_tensors + 1
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(count)}
    write_weights(adapter / WEIGHTS_FILE, header, bytes(4 * count))
    refused(adapter, llama, rf"adapter_model\.safetensors holds {count:,} tensors, above the bound of "
                            rf"{max_tensors:,} \(a LoRA adapter of all 7 projections")


def test_the_bounds_leave_real_adapters_far_below_them(embedded_adapter):
    config = load_config()  # the embedded SmolLM2: 30 layers
    max_bytes, max_tensors, _ = header_bounds(config)
    path = embedded_adapter("r16")  # PEFT's own, of all 7 projections
    with open(path / WEIGHTS_FILE, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
    assert 4 * length < max_bytes and 4 * len(load_file(path / WEIGHTS_FILE)) <= max_tensors
    assert (path / CONFIG_FILE).stat().st_size * 100 < MAX_CONFIG_BYTES
    big = dataclasses.replace(config, num_layers=126)  # a 405B's layers
    assert header_bounds(big)[0] < MAX_HEADER_BYTES


@pytest.mark.parametrize("header, data, problem", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1],
                                                                         "data_offsets": [12, 16]}},
     bytes(16), r"tensor 'b''s bytes start at 12, not at 8 where the tensor before ends"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
     r"tensor 'a' has 8 bytes, but its shape \[3\] of F32 takes 12"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(9),
     r"its tensors take 8 bytes, but 9 follow its header \(cut short, or other bytes added\)"),
    ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), r"tensor 'a': its entry must be an object of dtype, shape"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8),
     r"tensor 'a': its shape is not a list of integers"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), r"tensor 'a': its data_offsets are not"),
], ids=["gap", "size", "trailing", "fields", "shape", "offsets"])
def test_a_header_that_breaks_the_format_is_named(llama, adapter, header, data, problem):
    write_weights(adapter / WEIGHTS_FILE, header, data)
    refused(adapter, llama, rf"adapter_model\.safetensors is not a valid safetensors file: {problem}")


def test_a_header_that_is_not_json_is_named(llama, adapter):
    weights = adapter / WEIGHTS_FILE
    weights.write_bytes(struct.pack("<Q", 4) + b"{x: ")
    refused(adapter, llama, r"adapter_model\.safetensors is not a valid safetensors file: its header is not valid JSON")
    weights.write_bytes(b"\1\0\0")
    refused(adapter, llama, r"is not a valid safetensors file: it is 3 bytes long, too short")


# -- special files and paths ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_a_named_pipe_is_refused_without_blocking(llama, adapter, name):
    (adapter / name).unlink()
    os.mkfifo(adapter / name)  # no writer: an open or a read of it would wait for one forever
    refused(adapter, llama, rf"{re.escape(name)} is a named pipe \(FIFO\), not a regular file")


def test_a_device_or_a_directory_is_refused(llama, adapter):
    (adapter / WEIGHTS_FILE).unlink()
    (adapter / WEIGHTS_FILE).symlink_to("/dev/zero")  # endless
    refused(adapter, llama, r"adapter_model\.safetensors is a character device, not a regular file")
    (adapter / WEIGHTS_FILE).unlink()
    (adapter / WEIGHTS_FILE).mkdir()
    refused(adapter, llama, r"adapter_model\.safetensors is a directory, not a regular file")


def test_files_of_proc_are_named(llama, adapter):
    (adapter / WEIGHTS_FILE).unlink()
    (adapter / WEIGHTS_FILE).symlink_to("/proc/self/environ")  # cannot be mapped (ENODEV); its size reads 0
    refused(adapter, llama, r"adapter_model\.safetensors is not a valid safetensors file: it is 0 bytes long")
    (adapter / CONFIG_FILE).unlink()
    (adapter / CONFIG_FILE).symlink_to("/proc/self/mem")  # its first read fails (EIO)
    refused(adapter, llama, r"cannot read adapter_config\.json: Input/output error \(EIO\)")
    (adapter / CONFIG_FILE).unlink()
    (adapter / CONFIG_FILE).symlink_to("/proc/self/environ")
    refused(adapter, llama, r"adapter_config\.json is not valid JSON")


def test_paths_the_system_refuses_are_named(llama, adapter, tmp_path):
    long = str(tmp_path / ("a" * 5000))
    message = refused(long, llama, r"cannot be opened: File name too long \(ENAMETOOLONG\)")
    assert message.startswith(f"LoRA adapter {long[:200]}...{long[-60:]} ({len(long)} characters): ")
    through_a_file = adapter / CONFIG_FILE / "adapter"
    message = refused(through_a_file, llama, r"does not exist \(a part of the path is not a directory\)")
    assert str(through_a_file) in message
    refused(f"{adapter}\0", llama, r"the path holds a NUL character")
    refused(f"{adapter}\ud800", llama, r"the path is not valid text")
    refused("~no-such-user-anywhere/adapter", llama, r"does not exist")
    with pytest.raises(ValueError, match="File name too long"):
        adapter_identity(long)


def test_every_os_error_names_the_file_and_the_reason(llama, adapter, monkeypatch):
    # (as root, which the tests may run as, a file's permissions refuse nothing: the errors are raised here)
    real_open, real_preadv, real_read = os.open, os.preadv, os.read

    def failing_open(path, flags, *args):
        if str(path).endswith(WEIGHTS_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", failing_open)
    refused(adapter, llama, r"cannot open adapter_model\.safetensors: Permission denied \(EACCES\)")
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "preadv", lambda *args: (_ for _ in ()).throw(OSError(errno.ENODEV, "No such device")))
    refused(adapter, llama, r"cannot read adapter_model\.safetensors: No such device \(ENODEV\)")
    monkeypatch.setattr(os, "preadv", real_preadv)
    monkeypatch.setattr(os, "read", lambda *args: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    refused(adapter, llama, r"cannot read adapter_config\.json: Input/output error \(EIO\)")
    monkeypatch.setattr(os, "read", real_read)
    assert verify_adapter(adapter, llama, MAX_RANK, torch.float32).rank == 4


def test_nothing_lists_the_directory(llama, adapter, monkeypatch):
    first = adapter_identity(adapter)
    for i in range(200):
        (adapter / f"extra-{i}").write_text("")

    def listing(*args, **kwargs):
        raise AssertionError("the adapter's directory was listed")

    for owner, name in ((os, "scandir"), (os, "listdir"), (Path, "iterdir"), (Path, "glob"), (Path, "rglob")):
        monkeypatch.setattr(owner, name, listing)
    assert adapter_identity(adapter) == first  # other files are not part of the adapter
    assert read_adapter(adapter, llama, MAX_RANK).rank == 4
    assert verify_adapter(adapter, llama, MAX_RANK, torch.float32).rank == 4
    load_adapter(adapter, llama, MAX_RANK, torch.float32, TPShard.of(llama))
    (adapter / WEIGHTS_FILE).unlink()
    assert adapter_identity(adapter) != first


# -- values ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_values_that_are_not_finite_are_refused_when_verified(llama, adapter, value):
    tensors = load_file(adapter / WEIGHTS_FILE)
    tensors[Q_B][3, 1] = value
    save_file(tensors, adapter / WEIGHTS_FILE, metadata={"format": "pt"})
    assert read_adapter(adapter, llama, MAX_RANK).rank == 4  # the header alone: no value is read
    with pytest.raises(ValueError, match=rf"LoRA adapter {adapter}: tensor '{Q_B}' holds values that are not finite"):
        verify_adapter(adapter, llama, MAX_RANK, torch.float32)


def test_an_overflow_in_any_ranks_shard_is_refused_by_every_rank(llama, adapter):
    tensors = load_file(adapter / WEIGHTS_FILE)
    tensors[Q_B][60] = 60000.0  # row 60 of q_proj's 64 outputs: rank 1's of 2
    save_file(tensors, adapter / WEIGHTS_FILE, metadata={"format": "pt"})
    verify_adapter(adapter, llama, MAX_RANK, torch.float32)
    for check in (lambda: verify_adapter(adapter, llama, MAX_RANK, torch.float16),
                  lambda: load_adapter(adapter, llama, MAX_RANK, torch.float16, TPShard.of(llama, 0, 2))):
        with pytest.raises(ValueError, match=rf"tensor '{Q_B}' .*once scaled, it overflows float16"):
            check()


def test_the_header_and_the_tensors_are_read_from_one_file(llama, adapter, tmp_path, monkeypatch):
    """A file replaced between the two reads: the tensors are the first file's, whose header was checked."""
    before = load_adapter(adapter, llama, MAX_RANK, torch.float32, TPShard.of(llama))
    poisoned = tmp_path / "poisoned.safetensors"
    tensors = load_file(adapter / WEIGHTS_FILE)
    tensors[Q_B].fill_(float("nan"))
    save_file(tensors, poisoned, metadata={"format": "pt"})
    real = files.read_safetensors_header

    def swap_after_the_header(*args):
        header = real(*args)
        os.replace(poisoned, adapter / WEIGHTS_FILE)
        return header

    monkeypatch.setattr(files, "read_safetensors_header", swap_after_the_header)
    after = load_adapter(adapter, llama, MAX_RANK, torch.float32, TPShard.of(llama))
    for key, parts in before.modules.items():
        for (a, b), (a2, b2) in zip(parts, after.modules[key]):
            assert torch.equal(a, a2) and torch.equal(b, b2)
    monkeypatch.setattr(files, "read_safetensors_header", real)
    with pytest.raises(ValueError, match="not finite"):  # and the next read is of the file now there
        load_adapter(adapter, llama, MAX_RANK, torch.float32, TPShard.of(llama))


# -- the config's regular expressions -------------------------------------------------------------------------------

def with_config(adapter: Path, **settings) -> Path:
    config = adapter / CONFIG_FILE
    config.write_text(json.dumps({**json.loads(config.read_text()), **settings}))
    return adapter


@pytest.mark.parametrize("pattern, problem", [
    ("(.*)*(.*)*(.*)*z", r"too costly to match safely \(it repeats a part that repeats\)"),
    ("(.*.*)*x", r"it repeats a part that repeats"),
    (r"(\w+\.?)*$x", r"it repeats a part that repeats"),
    ("(q_proj|k_proj)+", r"it repeats an alternation"),
    (".*.*.*.*q_proj", r"it has 4 repeats"),
    (r"(q)_\1", r"it has a backreference"),
    ("(?i)q_proj", r"is not a valid regular expression: global flags not at the start"),  # as in PEFT's wrapper
    ("q" * 1001, r"is 1,001 characters long, above the bound of 1,000"),
], ids=["nested-stars", "star-of-stars", "word-dots", "alternation", "four-repeats", "backreference", "flags", "long"])
def test_a_pattern_too_costly_to_match_is_refused_at_once(llama, adapter, pattern, problem):
    # each of the first three takes `re` hours (or for ever) on one module name
    refused(with_config(adapter, rank_pattern={pattern: 2}), llama, rf"rank_pattern key .*{problem}")
    refused(with_config(adapter, rank_pattern={}, alpha_pattern={pattern: 2}), llama, rf"alpha_pattern key .*{problem}")
    if pattern != "(?i)q_proj":  # (valid as target_modules: PEFT matches it alone)
        refused(with_config(adapter, alpha_pattern={}, target_modules=pattern), llama, rf"target_modules .*{problem}")


def test_too_many_pattern_keys_are_refused(llama, adapter):
    keys = {f"layers.{i}.self_attn.q_proj": 4 for i in range(4 * 7 * 2 + 257)}
    refused(with_config(adapter, rank_pattern=keys), llama, r"rank_pattern has 313 keys, above the bound of 312 for "
                                                            r"this model \(7 projections in each of its 2 layers")


def test_patterns_match_a_module_as_peft_matches_them():
    names = [f"model.layers.{i}.{parent}.{p}" for i in (0, 1, 12) for parent, ps in
             (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
             for p in ps]
    patterns = ["q_proj", "proj", "_proj", r"layers\.1\.self_attn\.q_proj", r"mlp\.(gate|up)_proj",
                r"model\.layers\.0\..*", r".*\.(q|v)_proj", r"layers\.\d+\.mlp\..*", "^model.layers.0.mlp.down_proj",
                r"(?<=self_attn\.)q_proj",
                r"(?i:Q_PROJ)", "layers.1.self_attn.q_proj|down_proj", r"2\.self_attn\.q_proj", r"\d\.mlp\.up_proj",
                "self_attn", r"(?P<n>o)_proj", r"layers\.(0|12)\.self_attn\.k_proj", "model.layers.1", ".*"]
    for pattern in patterns:
        assert pattern_problem(pattern, suffix=True) is None, pattern
        matcher = suffix_matcher(pattern)
        for name in names:
            assert suffix_matches(matcher, name) == bool(re.match(rf"(.*\.)?({pattern})$", name)), (pattern, name)


@pytest.mark.parametrize("key", ["target_modules", "modules_to_save", "rank_pattern", "alpha_pattern", "r",
                                 "lora_alpha", "bias", "init_lora_weights", "peft_type", "use_dora",
                                 "layer_replication", "trainable_token_indices", "use_rslora", "fan_in_fan_out"])
def test_a_config_value_of_any_type_is_a_value_error_or_accepted(llama, adapter, key):
    for value in (5, -1.5, "x", "x" * 5000, [1, [2]], ["q_proj", 3], {"a": [1]}, {"q_proj": "x"}, None, True, []):
        error = finishes(lambda: read_adapter(with_config(adapter, **{key: value}), llama, MAX_RANK))
        assert error is None or isinstance(error, ValueError), (key, value, repr(error))
        assert error is None or len(str(error)) < 2000, (key, value)
