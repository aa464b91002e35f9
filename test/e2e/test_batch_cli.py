"""`deepinfer batch`: OpenAI batch files, a bad line recorded as that line's error, resume, same outputs as
generate."""
from __future__ import annotations

import json

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.batch_runner import run_batch
from deepinfer_rt.cli import main as cli_main

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096) as e:
        yield e


def _line(custom_id, url="/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": MODEL, "temperature": 0, "max_tokens": 4, **body}})


def _read(path, unique: bool = True) -> dict:
    """custom_id (or the id of an unreadable line) -> its last record (results come after refusals)."""
    records = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [r["custom_id"] or r["id"] for r in records]
    assert not unique or len(ids) == len(set(ids)), ids  # each request reported once
    return dict(zip(ids, records))


def test_mixed_file_bad_lines_are_their_own_errors(engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([
        _line("a", prompt="hello there"),
        "{not json",
        _line("b", prompt=["one two", "three"], n=2, temperature=0.8, seed=5),
        _line("c", url="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
        _line("d", prompt="x", temperature="hot"),
        _line("e", url="/v1/embeddings", input="x"),
        _line("f", prompt="x", model="other-model"),
        _line("a", prompt="duplicate id"),
        _line("g", prompt="x", top_k=-5),
        _line("h", prompt="x", logprobs=2),
    ]) + "\n")
    counts = run_batch(engine, src, dst, {MODEL}, progress=False)
    out = _read(dst, unique=False)
    assert counts["succeeded"] == 4 and counts["failed"] == 6 and counts["skipped"] == 0
    a = out["a"]["response"]
    assert a["status_code"] == 200 and a["body"]["object"] == "text_completion" and out["a"]["error"] is None
    assert 1 <= a["body"]["usage"]["completion_tokens"] <= 4 and a["body"]["choices"][0]["logprobs"] is None
    b = out["b"]["response"]["body"]
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]  # prompt_index * n + k, as the server numbers them
    c = out["c"]["response"]["body"]
    assert c["object"] == "chat.completion" and c["choices"][0]["message"]["role"] == "assistant"
    bad_json = out["batch_req_line2"]
    assert bad_json["response"] is None and "not valid JSON" in bad_json["error"]["message"]
    d = out["d"]["response"]
    assert d["status_code"] == 400 and d["body"]["error"]["param"] == "temperature"
    assert "url" in out["e"]["error"]["message"] and out["e"]["response"] is None
    assert out["f"]["response"]["body"]["error"]["code"] == "model_not_found"
    dup = [json.loads(x) for x in dst.read_text().splitlines() if json.loads(x)["custom_id"] == "a"]
    assert len(dup) == 2 and "appears twice" in dup[0]["error"]["message"]
    assert out["g"]["response"]["status_code"] == 400 and out["g"]["response"]["body"]["error"]["param"] == "top_k"
    h = out["h"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(h["token_logprobs"]) == 4 and all(len(t) == 2 for t in h["top_logprobs"])




def test_outputs_match_generate(engine, tmp_path):
    prompts = [f"count {i}: one two three" for i in range(6)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(_line(str(i), prompt=p, max_tokens=6, ignore_eos=True)
                             for i, p in enumerate(prompts)) + "\n")
    run_batch(engine, src, dst, {MODEL}, progress=False)
    out = _read(dst)
    ref = engine.generate(prompts, sampling_params=SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert [out[str(i)]["response"]["body"]["choices"][0]["text"] for i in range(6)] == [r.text for r in ref]


def test_resume_skips_what_is_done_and_repairs_a_cut_line(engine, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(_line(f"r{i}", prompt=f"resume {i}") for i in range(3)) + "\n{bad\n")
    first = run_batch(engine, src, dst, {MODEL}, progress=False)
    assert first["succeeded"] == 3 and first["failed"] == 1
    kept = dst.read_text().splitlines()
    r0 = next(x for x in kept if json.loads(x)["custom_id"] == "r0")
    # The run was cut short: only r0 was written, and a line was half written when it stopped.
    dst.write_text(r0 + "\n" + r0[: len(r0) // 2])
    with src.open("a") as f:
        f.write(_line("r3", prompt="added later") + "\n")
    second = run_batch(engine, src, dst, {MODEL}, progress=False)
    assert second["skipped"] == 1 and second["succeeded"] == 3 and second["failed"] == 1
    out = _read(dst)
    assert set(out) == {"r0", "r1", "r2", "r3", "batch_req_line4"}
    assert out["r0"] == json.loads(r0)
    third = run_batch(engine, src, dst, {MODEL}, progress=False)
    assert third == {**third, "skipped": 5, "succeeded": 0, "failed": 0}


def test_cli_batch(tiny_llama_path, tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "default", "prompt": "hi", "max_tokens": 2}})]
    src.write_text("\n".join(lines) + "\n")
    assert cli_main(["batch", str(src), str(dst), "--model", str(tiny_llama_path), "--device", "cpu",
                     "--kv-cache-tokens", "512", "--no-progress"]) == 0
    assert _read(dst)["x"]["response"]["status_code"] == 200
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["succeeded"] == 1
