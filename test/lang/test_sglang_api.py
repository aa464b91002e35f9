"""SGLang's frontend API, name by name, on the tiny random Llama (SmolLM2's tokenizer and chat template): structure
and outputs, not model quality. Fork idioms and join modes, var_scope, bind, separate_reasoning, gen's options,
select's methods (both call protocols), roles, state reads, streaming, run_batch, backends, module paths with
`sglang` aliased to deepinfer_lang, and the errors of features that cannot run here."""
from __future__ import annotations

import asyncio
import importlib
import json
import re
import sys

import pytest

import deepinfer_lang as sgl
from deepinfer_lang.reasoning import split_reasoning
from deepinfer_rt import GenerateOutput

# sglang/__init__.py's __all__ (0.5.x) less its runtime names (Engine, ServerArgs): the frontend's public names.
SGLANG_FRONTEND_NAMES = [
    "Anthropic", "Crusoe", "LiteLLM", "OpenAI", "Runtime", "RuntimeEndpoint", "VertexAI", "__version__",
    "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_server_info", "global_config", "greedy_token_selection", "image", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end", "video",
]


def test_every_frontend_name_of_sglang_exists():
    missing = [name for name in SGLANG_FRONTEND_NAMES if not hasattr(sgl, name)]
    assert missing == []
    assert set(SGLANG_FRONTEND_NAMES) <= set(sgl.__all__)


@pytest.fixture
def sglang_alias(monkeypatch):
    """`import sglang` gives deepinfer_lang (and sglang.lang.* our modules) for the test's duration."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sglang", sgl)
    yield
    for name in [m for m in sys.modules if m.startswith("sglang.")]:
        del sys.modules[name]


def test_sglang_module_paths_import_our_objects(sglang_alias):
    import sglang
    from sglang.lang.backend.runtime_endpoint import Runtime, RuntimeEndpoint
    from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
    from sglang.lang.choices import ChoicesSamplingMethod, greedy_token_selection
    from sglang.lang.global_config import global_config
    from sglang.lang.interpreter import ProgramState, ProgramStateGroup
    from sglang.lang.ir import (REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglConstantText, SglExpr,
                                SglExprList, SglFunction, SglGen, SglRoleBegin, SglSamplingParams, SglSelect)

    assert sglang is sgl and Runtime is sgl.Runtime and RuntimeEndpoint is sgl.RuntimeEndpoint
    assert ProgramState is sgl.ProgramState and ProgramStateGroup is sgl.ProgramStateGroup
    assert ChoicesSamplingMethod is sgl.ChoicesSamplingMethod and greedy_token_selection is sgl.greedy_token_selection
    assert global_config is sgl.global_config
    assert sgl.gen("n", dtype=int).args.regex == REGEX_INT and sgl.gen("b", dtype=bool).args.regex == REGEX_BOOL
    assert re.fullmatch(REGEX_FLOAT, "-1.5") and re.fullmatch(REGEX_STR, '"hi there"')
    node = SglGen("x", 7, stop="\n", temperature=0.0)
    assert isinstance(node, SglExpr) and (node.name, node.args.max_new_tokens, node.args.stop) == ("x", 7, "\n")
    assert SglExprList([SglConstantText("a"), SglRoleBegin("user")]).expr_list[0].value == "a"
    assert isinstance(sgl.select("c", ["a", "b"]), SglSelect) and isinstance(sgl.function(lambda s: None), SglFunction)
    assert SglSamplingParams(max_new_tokens=3).to_srt_kwargs()["max_new_tokens"] == 3
    assert get_chat_template("chatml").role_prefix_and_suffix["user"][0] == "<|im_start|>user\n"
    assert get_chat_template_by_model_path("meta-llama/Llama-3-8B-Instruct").name == "llama-3-instruct"
    for path in ["sglang.lang.api", "sglang.lang.tracer", "sglang.lang.backend.base_backend", "sglang.utils",
                 "sglang.lang.backend.openai", "sglang.lang.backend.anthropic", "sglang.lang.backend.vertexai",
                 "sglang.lang.backend.litellm"]:
        importlib.import_module(path)


def test_a_program_written_for_sglang_runs_through_the_alias(sglang_alias, tiny_backend):
    import sglang as sgl_

    @sgl_.function
    def prog(s, topic):
        s += sgl_.system("You write lists.")
        s += sgl_.user(f"List two {topic}.")
        s += sgl_.assistant(sgl_.gen("items", max_tokens=4, ignore_eos=True))

    sgl_.set_default_backend(tiny_backend)
    try:
        state = prog.run(topic="fruits", temperature=0)
    finally:
        sgl_.set_default_backend(None)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.get_meta_info("items")["completion_tokens"] == 4


# ---- fork idioms and join modes ----

def test_fork_item_assignment_broadcast_and_gather(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Ideas:"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f" #{i}"  # __getitem__, __iadd__, __setitem__ of the same branch
        forks += lambda i: sgl.gen("idea", max_tokens=2, ignore_eos=True) if i < 2 else " none"
        forks.join()  # gather_variable: branches that set a variable, in order
        s += " | ".join(s["idea"])

    state = prog.run(backend=tiny_backend, temperature=0)
    assert len(state["idea"]) == 2 and len(state.get_meta_info("idea")) == 2
    assert state.text() == "Ideas:" + " | ".join(state["idea"])


def test_fork_join_concate_and_append_and_errors(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Base."
        forks = s.fork(2)
        forks += [" A", " B"]
        forks += sgl.gen("x", max_tokens=2, ignore_eos=True)
        texts = [f.text() for f in forks]
        forks.join(mode="concate_and_append")
        s["texts"] = texts
        with pytest.raises(TypeError, match="cannot be replaced"):
            forks[0] = forks[1]
        with pytest.raises(ValueError, match="join mode"):
            s.fork(1).join(mode="gather")
        with pytest.raises(ValueError):
            forks += 3

    state = prog.run(backend=tiny_backend, temperature=0)
    a, b = state["texts"]
    assert state.text() == "Base." + a[len("Base."):] + b[len("Base."):]
    assert a.startswith("Base. A") and b.startswith("Base. B")
    group = None

    @sgl.function
    def prog2(s):
        nonlocal group
        s += "x"
        group = s.fork(2)
        group.join()

    prog2.run(backend=tiny_backend)
    assert len(group.states) == 2 and group.src_state is not None


def test_copy_is_a_joined_one_branch_fork(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Q:"
        with s.copy() as c:
            c += " try" + sgl.gen("draft", max_tokens=2, ignore_eos=True)
        s += " final"

    state = prog.run(backend=tiny_backend, temperature=0)
    assert len(state["draft"]) == 1 and state.text() == "Q: final"


# ---- var_scope, bind, separate_reasoning ----

def test_nested_var_scopes_capture_their_blocks(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Start. "
        with s.var_scope("outer"):
            s += "Before "
            with s.var_scope("inner"):
                s += "in" + sgl.gen("g", max_tokens=2, ignore_eos=True)
            s += " after"
        s += " end"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            with f.var_scope("branch"):
                f += f"branch {i}"
        forks.join()

    state = prog.run(backend=tiny_backend, temperature=0)
    assert state["inner"] == "in" + state["g"]
    assert state["outer"] == "Before " + state["inner"] + " after"
    assert state.text() == "Start. " + state["outer"] + " end"
    assert state["branch"] == ["branch 0", "branch 1"]


def test_bind_fixes_arguments():
    @sgl.function
    def prog(s, a, b="x"):
        s["seen"] = (a, b)

    bound = prog.bind(b="bound")
    assert bound.bind_arguments == {"b": "bound"} and prog.bind_arguments == {}
    with pytest.raises(TypeError, match="not arguments"):
        prog.bind(c=1)
    assert bound.bind(a=1).bind_arguments == {"b": "bound", "a": 1}


def test_bind_runs_with_bound_arguments(tiny_backend):
    @sgl.function
    def prog(s, a, b="x"):
        s += f"{a}-{b}"

    assert prog.bind(b="y").run(a="1", backend=tiny_backend).text() == "1-y"
    states = prog.bind(b="z").run_batch([("1",), ("2",)], backend=tiny_backend)
    assert [st.text() for st in states] == ["1-z", "2-z"]


class FixedBackend(sgl.RuntimeBackend):
    """Every gen answers `reply` (its own ids), so reasoning markers appear without a trained model."""

    reply = "<think>two and two</think>The answer is 4."

    def generate(self, ids, params):
        tokens = self.tokenizer.encode(self.reply, add_special_tokens=False)
        return [GenerateOutput(self.reply, tokens, "length", None, len(ids), len(tokens), 0)]


def test_separate_reasoning_splits_variable_and_role_text(tiny_engine):
    backend = FixedBackend(tiny_engine)

    @sgl.function
    def prog(s):
        s += sgl.user("2+2?")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=8), model_type="deepseek-v3"))

    state = prog.run(backend=backend)
    assert state["answer"] == "The answer is 4."
    assert state["answer_reasoning_content"] == "two and two"
    assert state.messages()[-1]["content"] == "The answer is 4."
    assert "<think>" not in state.text()
    assert split_reasoning("deepseek-r1", "still thinking") == ("still thinking", "")
    assert split_reasoning("qwen3", "no think block") == ("", "no think block")
    with pytest.raises(ValueError, match="model_type"):
        split_reasoning("nope", "x")


# ---- gen ----

def test_gen_dtype_regex_json_schema_choices_and_stop(tiny_backend):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    @sgl.function
    def prog(s):
        s += "n:" + sgl.gen("n", dtype=int, max_tokens=6)
        s += " b:" + sgl.gen("b", dtype="bool", max_tokens=4)
        s += " r:" + sgl.gen("r", regex=r"[ab]{3}", max_tokens=6)
        s += " j:" + sgl.gen("j", json_schema=json.dumps(schema), max_tokens=24)
        s += " c:" + sgl.gen("c", choices=["left", "right"])
        s += " s:" + sgl.gen("s", stop=["\n", "."], max_tokens=6)

    state = prog.run(backend=tiny_backend, temperature=0)
    assert re.fullmatch(r"[-+]?[0-9]+", state["n"]) and state["b"] in ("True", "False")
    assert re.fullmatch(r"[ab]{3}", state["r"])
    if state.get_meta_info("j")["finish_reason"] == "stop":
        assert isinstance(json.loads(state["j"])["ok"], bool)
    assert state["c"] in ("left", "right") and "\n" not in state["s"] and "." not in state["s"]


def test_gen_logprob_options_and_meta_info(tiny_backend):
    @sgl.function
    def prog(s):
        s += "One two three four"
        s += sgl.gen("g", max_tokens=3, ignore_eos=True, return_logprob=True, logprob_start_len=1,
                     top_logprobs_num=2, return_text_in_logprobs=True)
        s += sgl.gen("plain", max_tokens=2, ignore_eos=True)

    state = prog.run(backend=tiny_backend, temperature=0)
    meta = state.get_meta_info("g")
    prompt_len = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == prompt_len - 1
    assert all(isinstance(text, str) for _, _, text in meta["input_token_logprobs"])
    assert [len(row) for row in meta["output_top_logprobs"]] == [2, 2, 2]
    lp, tid, text = meta["output_token_logprobs"][0]
    assert lp <= 0 and text == tiny_backend.tokenizer.decode([tid])
    assert meta["finish_reason"] == "length" and meta["finish_reason"]["type"] == "length"
    assert meta["finish_reason"]["length"] == 3 and isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    assert "output_token_logprobs" not in state.get_meta_info("plain")
    with pytest.raises(sgl.UnsupportedFeatureError, match="stop_regex"):
        sgl.gen("x", stop_regex=r"\d")


def test_gen_int_and_gen_string():
    assert sgl.gen_int("n", max_tokens=4).args.regex == sgl.gen("n", dtype=int).args.regex
    assert sgl.gen_string("s").args.regex == sgl.gen("s", dtype=str).args.regex


# ---- select ----

class FirstTokenOnly(sgl.ChoicesSamplingMethod):
    """A method written against SGLang's protocol: keyword arguments, (logprob, id, text) entries."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None):
        best = max(range(len(choices)), key=lambda i: input_token_logprobs[i][0][0])
        self.seen = (list(choices), input_token_logprobs)
        return sgl.ChoicesDecision(decision=choices[best], meta_info={"method": "first-token"})


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized, FirstTokenOnly()], ids=repr)
def test_select_with_every_choices_method(tiny_backend, method):
    choices = ["red", "green", "blue sky"]

    @sgl.function
    def prog(s):
        s += "Colour:" + sgl.select("c", choices=choices, choices_method=method)

    state = prog.run(backend=tiny_backend)
    assert state["c"] in choices and state.text() == "Colour:" + state["c"]
    meta = state.get_meta_info("c")
    assert len(meta["scores"]) == 3
    if isinstance(method, FirstTokenOnly):
        assert meta["method"] == "first-token" and method.seen[0] == choices
        assert all(len(entry) == 3 for row in method.seen[1] for entry in row)


def test_sglang_keyword_call_of_our_methods():
    decision = sgl.token_length_normalized(choices=["a", "b"], normalized_prompt_logprobs=[-1.0, -0.5],
                                           input_token_logprobs=[[(-1.0, 5, None)], [(-0.5, 6, None)]],
                                           output_token_logprobs=[[], []])
    assert decision.decision == "b" and decision.index == 1
    assert decision.meta_info["normalized_prompt_logprobs"] == [-1.0, -0.5]
    assert sgl.ChoicesDecision("x", {"k": 1}).decision == "x"


# ---- roles, state reads ----

def test_roles_and_begin_end_render_the_chat_template(tiny_backend):
    @sgl.function
    def prog(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        s += sgl.user_begin() + "Hi" + sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("a", max_tokens=3, ignore_eos=True) + sgl.assistant_end()
        with s.user():
            s += "Again"
        s += sgl.assistant("ok")

    state = prog.run(backend=tiny_backend, temperature=0)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert state.text() == tiny_backend.tokenizer.apply_chat_template(msgs, tokenize=False)


def test_state_reads_and_writes(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("g", max_tokens=2, ignore_eos=True)
        s.set_var("mine", 5)
        s["other"] = "x"
        return "returned"

    state = prog.run(backend=tiny_backend, temperature=0)
    assert state.get_var("g") == state["g"] and state.get_var("mine") == 5 and state["other"] == "x"
    assert "g" in state and "missing" not in state
    assert state.get_meta_info("g")["completion_tokens"] == 2 and state.ret_value == "returned"
    assert "".join(state.text_iter()) == state.text() and list(state.text_iter("g")) == [state["g"]]
    assert state.messages() == [] and state.error() is None
    with pytest.raises(KeyError, match="missing"):
        state["missing"]


def test_streaming_text_iter_and_text_async_iter(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Tell:" + sgl.gen("story", max_tokens=6, ignore_eos=True)

    state = prog.run(backend=tiny_backend, stream=True, temperature=0)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() and state.text().startswith("Tell:")

    async def collect():
        st = prog.run(backend=tiny_backend, stream=True, temperature=0)
        var_pieces = [p async for p in st.text_async_iter("story")]
        with_meta = [item async for item in prog.run(backend=tiny_backend, stream=True, temperature=0)
                     .text_async_iter("story", return_meta_data=True)]
        return st, var_pieces, with_meta

    st, var_pieces, with_meta = asyncio.run(collect())
    assert "".join(var_pieces) == st["story"] == state["story"]
    assert all(isinstance(item, tuple) and len(item) == 2 for item in with_meta)


# ---- run_batch ----

def test_run_batch_threads_progress_bar_and_generator_style(tiny_backend, capsys):
    @sgl.function
    def prog(s, q, tag="t"):
        s += f"{tag}:{q}" + sgl.gen("a", max_tokens=2, ignore_eos=True)

    items = [{"q": str(i)} for i in range(5)]
    states = prog.run_batch(items, backend=tiny_backend, num_threads=2, progress_bar=True, temperature=0)
    assert [st.text().split(":")[1][0] for st in states] == ["0", "1", "2", "3", "4"]
    assert "5/5" in capsys.readouterr().err  # tqdm's bar
    gen_states = prog.run_batch([("0",), ("1", "u")], backend=tiny_backend, generator_style=True, temperature=0)
    assert not isinstance(gen_states, list)
    texts = [st.text() for st in gen_states]
    assert texts[0].startswith("t:0") and texts[1].startswith("u:1")
    assert prog.run_batch([], backend=tiny_backend) == []
    with pytest.raises(ValueError):
        prog.run_batch([()], backend=tiny_backend)


# ---- backends, default backend, cache, server info, config ----

def test_set_default_backend_flush_cache_get_server_info(tiny_backend):
    previous = sgl.global_config.default_backend
    try:
        sgl.set_default_backend(None)
        assert sgl.flush_cache() is False and sgl.get_server_info() is None
        sgl.set_default_backend(tiny_backend)
        assert sgl.global_config.default_backend is tiny_backend
        info = sgl.get_server_info()
        assert info["max_num_seqs"] == tiny_backend.max_running_requests and "num_free_pages" in info
        assert sgl.flush_cache() is True
    finally:
        sgl.set_default_backend(previous)


def test_global_config_verbosity_prints_final_text(tiny_backend, capsys):
    @sgl.function
    def prog(s):
        s += "printed text"

    sgl.global_config.verbosity = 2
    try:
        prog.run(backend=tiny_backend)
    finally:
        sgl.global_config.verbosity = 0
    assert "printed text" in capsys.readouterr().out


def test_named_chat_template_backend(tiny_engine):
    backend = sgl.RuntimeBackend(tiny_engine, chat_template_name="llama-3-instruct")

    @sgl.function
    def prog(s):
        s += sgl.user("Hi") + sgl.assistant("Hello")

    assert prog.run(backend=backend).text() == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                                "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>")
    assert sgl.RuntimeBackend(tiny_engine, chat_template_name="qwen").chat_template.role_segments(
        [], "user")[0].startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_runtime_answers_sglang_runtime_methods(tiny_llama_path):
    with sgl.Runtime(model_path=str(tiny_llama_path), dtype="float32", kv_cache_tokens=2048) as runtime:
        assert runtime.endpoint is runtime and runtime.get_tokenizer() is runtime.tokenizer
        out = json.loads(runtime.generate("Hello", {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0},
                                          return_logprob=True))
        assert out["meta_info"]["completion_tokens"] == 3 and len(out["meta_info"]["output_token_logprobs"]) == 3
        assert json.loads(runtime.encode("Hello"))["num_tokens"] >= 1
        runtime.cache_prefix("A prefix to cache")

        async def pieces():
            return [p async for p in runtime.async_generate("Hi", {"max_new_tokens": 3, "ignore_eos": True})]

        assert len("".join(asyncio.run(pieces()))) > 0


def test_runtime_endpoint_takes_sglangs_arguments():
    import inspect

    params = list(inspect.signature(sgl.RuntimeEndpoint).parameters)
    assert params == ["base_url", "api_key", "verify", "chat_template_name"]


# ---- what cannot run here ----

def test_unsupported_features_raise_naming_the_feature(tiny_backend):
    for name in ["OpenAI", "Anthropic", "VertexAI", "LiteLLM", "Crusoe"]:
        with pytest.raises(sgl.UnsupportedFeatureError, match=name):
            getattr(sgl, name)("some-model")

    @sgl.function
    def with_image(s):
        s += sgl.user(sgl.image("cat.png") + "What is this?")

    @sgl.function
    def with_video(s):
        s += sgl.user(sgl.video("cat.mp4", 4) + "What happens?")

    with pytest.raises(sgl.UnsupportedFeatureError, match="image"):
        with_image.run(backend=tiny_backend)
    with pytest.raises(sgl.UnsupportedFeatureError, match="video"):
        with_video.run(backend=tiny_backend)
    with pytest.raises(sgl.UnsupportedFeatureError, match="Engine"):
        sgl.Engine
    with pytest.raises(sgl.UnsupportedFeatureError, match="trace"):
        with_image.trace()
    with pytest.raises(NotImplementedError):  # UnsupportedFeatureError is a NotImplementedError
        sgl.OpenAI()
