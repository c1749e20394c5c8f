"""The LoRA bench's machinery on a tiny model at tiny sizes: both parts run, the rows hold the
figures the table shows, the LoRA engine's base requests give the base engine's tokens and the
adapters' requests the same tokens mixed as alone, the adapters change the output, their files are
removed afterwards, and the command line parses. (No timing is asserted.)"""

import json
import os
import tempfile

import pytest

from pagedserve.bench.lora import BASE, LORA_BASE, markdown_table, plot, run_lora_bench, write_random_adapter
from pagedserve.entrypoints.cli import build_parser
from pagedserve.lora.weights import read_adapter
from pagedserve.models.loader import load_config


@pytest.fixture(scope="module")
def report(tiny_checkpoint, embedded_tokenizer):
    path, _ = tiny_checkpoint("llama")
    before = set(os.listdir(tempfile.gettempdir()))
    result = run_lora_bench(num_adapters=3, rank=4, num_requests=6, prompt_len=8, output_len=6, reps=1, load_reps=2,
                            model=str(path), tokenizer=embedded_tokenizer, log=lambda *_: None)
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("pagedserve-lora-bench-")}
    return result, left


def test_both_parts_run_and_leave_no_adapter_behind(report):
    result, left = report
    assert result["parts"] == ["throughput", "load"] and result["all_identical"] is True
    assert left == set()
    json.dumps(result)  # the --json report is plain data


def test_throughput_rows(report):
    t = report[0]["throughput"]
    rows = {r["system"]: r for r in t["rows"]}
    assert list(rows) == [BASE, LORA_BASE, "3 adapters", "3 adapters, one at a time"]
    assert rows[BASE]["tps_ratio"] == 1.0 and rows[LORA_BASE]["same_as_base"] == 6
    assert rows["3 adapters"]["same_as_base"] < 6  # the adapters do something
    assert t["adapters_batch_invariant"] is True
    assert all(r["output_tps"] > 0 and r["seconds_median"] > 0 for r in rows.values())


def test_load_part_and_table(report, tmp_path):
    result = report[0]
    assert result["load"]["disk_to_host_s"] > 0 and result["load"]["host_to_slot_s"] > 0
    assert result["load"]["adapter_bytes"] > 0
    table = markdown_table(result)
    assert "| 3 adapters, one at a time |" in table and "host memory -> free slot" in table
    plot(result, str(tmp_path / "lora.png"))
    assert (tmp_path / "lora.png").stat().st_size > 0


def test_the_written_adapter_is_a_peft_adapter_the_engine_accepts(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint("llama")
    config = load_config(str(path))
    info = read_adapter(write_random_adapter(str(tmp_path / "a"), config, rank=4, seed=0), config, max_rank=4)
    assert info.rank == 4 and len(info.projections) == 7 and len(info.layers) == config.num_layers


def test_command_line():
    args = build_parser().parse_args(["bench", "lora", "--num-adapters", "4", "--rank", "8", "--reps", "2"])
    assert (args.num_adapters, args.rank, args.reps, args.requests) == (4, 8, 2, 32)
