"""The latency bench's machinery: one request at a time on the embedded model, a row per system with
its time to first token, decode speed and peak memory, and the weights a decode step reads. (No
timing is asserted, only that the figures are there and positive.)"""

import json
import os

import pytest
import torch

from pagedserve.bench.latency import (LatencyResult, agreement, decode_weight_bytes, gguf_weight_bytes, ratios,
                                      run_latency_bench)
from pagedserve.entrypoints.cli import main
from pagedserve.models.loader import load_model


@pytest.mark.slow
def test_the_table_has_a_row_per_system_and_skips_llamacpp_without_its_python(tmp_path, embedded_tokenizer, capsys):
    main(["bench", "latency", "--prompt-len", "8", "--output-len", "4", "--reps", "1", "--bandwidth-gib", "0.0625",
          "--systems", "pagedserve,llamacpp", "--out-dir", str(tmp_path), "--json", str(tmp_path / "latency.json")])
    table = (tmp_path / "bench_latency.md").read_text()
    header, _, ours, llamacpp = [line for line in table.splitlines() if line.startswith("|")]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "system", "TTFT ms", "decode tok/s", "peak RSS MB", "weights/token MB", "bound tok/s", "% of bound",
        "same tokens", "notes"]
    assert ours.startswith("| pagedserve (quantization=auto) |") and "other programs:" in ours
    assert llamacpp.startswith("| llamacpp (") and "--llamacpp-python" in llamacpp
    assert " / llamacpp" not in table  # no ratio to a system that did not run

    report = json.loads((tmp_path / "latency.json").read_text())
    (prompt,) = report["workload"]["requests"]
    assert len(prompt["prompt_token_ids"]) == 8 and prompt["output_len"] == 4
    assert not set(prompt["prompt_token_ids"]) & set(embedded_tokenizer.all_special_ids)
    assert report["read_bandwidth_bytes_per_s"] > 0 and report["read_bandwidth_by"] in ("torch.sum", "torch.mv")
    row, skipped = report["results"]
    assert row["ttft_ms_median"] > 0 and row["decode_tps_median"] > 0
    assert row["peak_rss_bytes"] > row["weight_bytes"] > 0
    assert len(row["token_ids"]) == 4 and len(row["ttft_s"]) == len(row["decode_tps"]) == 1
    assert "--llamacpp-python" in skipped["skipped"]
    assert "pagedserve (quantization=auto)" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["llama", "llama3"])  # untied, tied
def test_weight_bytes_per_decode_step(arch, tiny_checkpoint):
    path, hf_model = tiny_checkpoint(arch)
    model, config = load_model(str(path))
    # transformers lists a tied matrix once; a decode step reads the embedding only as the LM head.
    expected = sum(p.numel() * p.element_size() for name, p in hf_model.named_parameters()
                   if config.tie_word_embeddings or "embed_tokens" not in name)
    assert decode_weight_bytes(model) == expected
    assert decode_weight_bytes(load_model(str(path), torch.bfloat16)[0]) == expected // 2


@pytest.mark.slow
def test_gguf_weight_bytes_are_its_tensors(embedded_path):
    size = os.path.getsize(embedded_path)
    assert 0.9 * size < gguf_weight_bytes(embedded_path) < size  # the rest: metadata, the tokenizer's vocabulary


def test_ratios_pair_each_pagedserve_row_with_each_llamacpp_row():
    rows = [LatencyResult("pagedserve (quantization=auto)", [0.05], [30.0]),
            LatencyResult("llamacpp (1 thread)", [0.1], [10.0]), LatencyResult("llamacpp (2 threads)", [0.02], [20.0]),
            LatencyResult("vllm", skipped="not run")]
    assert ratios(rows) == [
        "pagedserve (quantization=auto) / llamacpp (1 thread): decode tokens/s 3.00x, TTFT 0.50x",
        "pagedserve (quantization=auto) / llamacpp (2 threads): decode tokens/s 1.50x, TTFT 2.50x"]


def test_agreement_counts_the_tokens_before_the_first_difference():
    ours = LatencyResult("pagedserve (quantization=none)", [0.1], [10.0], token_ids=[5, 6, 7, 8])
    assert agreement(ours, LatencyResult("llamacpp (2 threads)", [0.1], [10.0], token_ids=[5, 6, 9, 8])) == "2/4"
    assert agreement(ours, LatencyResult("vllm", [0.1], [10.0], token_ids=[5, 6, 7, 8])) == "4/4"
    assert agreement(ours, ours) == "-"


@pytest.mark.parametrize("kwargs, message", [({"systems": ["sglang"]}, "unknown system"),
                                              ({"systems": ["pagedserve"], "output_len": 1}, "at least 2")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_latency_bench(quantizations=["auto"], **kwargs)
