"""The command line's engine flags reach EngineConfig, every field of it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.cli import build_parser, engine_kwargs, save_report
from pagedserve.entrypoints.llm import LLM


def test_every_engine_field_has_a_flag():
    args = build_parser().parse_args(["serve"])
    assert set(engine_kwargs(args)) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_engine_flags_take_their_defaults_choices_and_help_from_the_config():
    parser = build_parser()
    assert EngineConfig(**engine_kwargs(parser.parse_args(["serve"]))) == EngineConfig()
    actions = {a.dest: a for a in parser._subparsers._group_actions[0].choices["serve"]._actions}
    for f in dataclasses.fields(EngineConfig):
        assert actions[f.name].default == f.default
        assert f.metadata["help"] in actions[f.name].help
        assert actions[f.name].choices == f.metadata["choices"]
    assert actions["kv_cache_dtype"].choices == ("auto", "fp8", "fp8_e4m3", "float32", "bfloat16", "float16")
    args = parser.parse_args(["serve", "--no-enable-prefix-caching", "--max-model-len", "512"])
    assert (args.enable_prefix_caching, args.max_model_len) == (False, 512)


def test_building_the_flags_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from pagedserve.entrypoints.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_engine_flags_build_the_config():
    args = build_parser().parse_args([
        "generate", "hi", "--kv-cache-dtype", "fp8", "--calculate-kv-scales", "--gpu-memory-utilization", "0.5",
        "--enforce-eager", "--attention-backend", "torch", "--device", "cpu"])
    config = EngineConfig(**engine_kwargs(args))
    assert (config.kv_cache_dtype, config.calculate_kv_scales, config.gpu_memory_utilization, config.enforce_eager) \
        == ("fp8", True, 0.5, True)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(**(engine_kwargs(args) | {"gpu_memory_utilization": 1.5}))


def test_llm_rejects_an_unknown_engine_argument_before_loading():
    with pytest.raises(TypeError, match=r"unknown engine arguments \['kv_cache_type'\]"):
        LLM(kv_cache_type="fp8")


@pytest.mark.parametrize("settings, message", [
    (dict(kv_cache_dtype="bfloat16"), "differs from the model's dtype"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales needs kv_cache_dtype='fp8'"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
])
def test_kv_cache_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **settings)


def test_a_bench_report_goes_where_its_flags_say(tmp_path, capsys):
    drawn = []
    save_report(str(tmp_path / "out"), "bench_x", "| a |", lambda png: drawn.append(png) or open(png, "wb").close(),
                str(tmp_path / "x.json"), {"rate": 2.0})
    assert (tmp_path / "out" / "bench_x.md").read_text() == "| a |\n"
    assert drawn == [str(tmp_path / "out" / "bench_x.png")]
    assert json.loads((tmp_path / "x.json").read_text()) == {"rate": 2.0}
    save_report(None, "bench_y", "| b |", drawn.append, None, None)  # neither flag: nothing written or drawn
    assert len(drawn) == 1 and not (tmp_path / "bench_y.md").exists()


def test_serve_flags_reach_run_server():
    import inspect

    from pagedserve.entrypoints.cli import server_kwargs
    from pagedserve.entrypoints.openai.api_server import run_server

    params = inspect.signature(run_server).parameters
    defaults = server_kwargs(build_parser().parse_args(["serve"]))
    assert set(defaults) <= set(params)
    assert defaults == {name: params[name].default for name in defaults}  # the flags' defaults are run_server's
    args = build_parser().parse_args([
        "serve", "--timeout-keep-alive", "2", "--header-timeout", "3", "--body-timeout", "4", "--shutdown-timeout",
        "6", "--max-body-bytes", "1000", "--override-generation-config", '{"max_new_tokens": 64}',
        "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json", "--max-request-tokens", "5000",
        "--engine-max-restarts", "0", "--engine-stall-timeout", "7.5", "--dashboard-max-viewers", "9"])
    assert server_kwargs(args) == defaults | {
        "timeout_keep_alive": 2.0, "header_timeout": 3.0, "body_timeout": 4.0, "shutdown_timeout": 6.0,
        "max_body_bytes": 1000, "default_max_tokens": 64, "enable_auto_tool_choice": True,
        "tool_call_parser": "llama3_json", "max_request_tokens": 5000, "engine_max_restarts": 0,
        "engine_stall_timeout": 7.5, "dashboard_max_viewers": 9}
    with pytest.raises(ValueError, match="--engine-max-restarts"):
        server_kwargs(build_parser().parse_args(["serve", "--engine-max-restarts", "-1"]))


def test_auto_tool_choice_without_a_parser_is_refused_before_the_engine_loads(capsys):
    from pagedserve.entrypoints.cli import server_kwargs

    with pytest.raises(ValueError, match="--tool-call-parser"):
        server_kwargs(build_parser().parse_args(["serve", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err


@pytest.mark.parametrize("override", ['{"max_new_tokens": 0}', '{"temperature": 0.5}', "[1]", "{not json",
                                      '{"max_new_tokens": true}'])
def test_a_generation_config_override_it_cannot_honour_is_refused(override):
    from pagedserve.entrypoints.cli import server_kwargs

    args = build_parser().parse_args(["serve", "--override-generation-config", override])
    with pytest.raises(ValueError, match="max_new_tokens|JSON"):
        server_kwargs(args)


def test_generate_prints_every_answer_and_reports_a_prompt_the_engine_failed_on(monkeypatch, capsys):
    from pagedserve.entrypoints import cli
    from pagedserve.outputs import CompletionOutput, RequestOutput

    def output(prompt, text, error=None):
        sample = CompletionOutput(0, text, [1], None, None, "error" if error else "stop")
        return RequestOutput("0", prompt, [1], [sample], finished=True, error=error)

    class FakeLLM:  # stands in for the engine: what matters here is what the command prints
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompts, params, use_tqdm):
            return [output(prompts[0], " Paris."), output(prompts[1], "", error="RuntimeError('boom')")]

    monkeypatch.setattr("pagedserve.entrypoints.llm.LLM", FakeLLM)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "The capital of France is", "Tell me"])
    assert exit_.value.code == 1
    out, err = capsys.readouterr()
    assert out == " Paris.\n"
    assert "error: prompt 'Tell me': RuntimeError('boom')" in err


@pytest.mark.parametrize("flag", ["--timeout-keep-alive", "--header-timeout", "--body-timeout", "--shutdown-timeout",
                                  "--max-body-bytes"])
def test_serve_refuses_a_limit_that_would_cut_every_connection(flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_tool_call_parser_auto_is_a_choice():
    from pagedserve.entrypoints.cli import server_kwargs

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "auto"])
    assert server_kwargs(args)["tool_call_parser"] == "auto"  # resolved from the chat template at startup


def draft_config(path) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": 3})


@pytest.fixture
def bad_model_paths(tmp_path):
    """Draft-model paths the loader cannot read, each with what the error says."""
    (tmp_path / "no_config").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 8)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 8)
    return [(tmp_path / "missing", "does not exist"), (tmp_path / "no_config", "has no config.json"),
            (tmp_path / "weights.bin", "not a .gguf"), (tmp_path / "broken.gguf", "not a valid GGUF file")]


def test_a_wrong_draft_model_path_is_one_error_line_before_the_engine_starts(tmp_path):
    """`pagedserve serve` with a draft model that is not there says so in one `error:` line and exits 1,
    as for the other bad --speculative-config values: no engine core starts, no traceback."""
    import subprocess
    import sys

    missing = tmp_path / "missing"
    server = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", "9",
                             "--speculative-config", draft_config(missing)], capture_output=True, text=True,
                            timeout=300)
    assert server.returncode == 1
    assert server.stderr.splitlines() == [
        f"error: speculative_config: the draft model {str(missing)!r} does not exist; pass a Hugging Face model "
        "directory (config.json + *.safetensors) or a .gguf file"], server.stderr


@pytest.mark.slow
def test_a_wrong_model_path_is_one_error_line(bad_model_paths):
    """`pagedserve serve --model` with a path that is not there, or a file that is no GGUF: one `error:`
    line naming the path and what to pass, exit status 1, no traceback."""
    import subprocess
    import sys

    for path, reason in [bad_model_paths[0], bad_model_paths[3]]:
        server = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", "9",
                                 "--model", str(path)], capture_output=True, text=True, timeout=300)
        assert server.returncode == 1, server.stderr
        (line,) = server.stderr.splitlines()
        assert line.startswith("error: ") and str(path) in line and reason in line, line


def test_the_offline_api_refuses_a_wrong_draft_model_path_before_loading_weights(bad_model_paths, monkeypatch):
    from pagedserve.engine import llm_engine

    def no_core(*args, **kwargs):
        raise AssertionError("the engine core was built: the path was not checked first")

    monkeypatch.setattr(llm_engine, "EngineCore", no_core)
    for path, reason in bad_model_paths:
        with pytest.raises(ValueError, match=reason) as error:
            LLM(speculative_config=json.loads(draft_config(path)))
        assert str(path) in str(error.value) and "speculative_config: the draft model" in str(error.value)
