"""Programs on the tiny random Llama (SmolLM2's tokenizer and chat template): prompt ids, roles, sampling defaults,
fork/join, run_batch, streaming and errors."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import deepinfer_lang as sgl
import deepinfer_lang.backend
from deepinfer_lang.chat_template import ChatTemplate
from deepinfer_rt import SamplingParams


def encode(backend, text: str) -> list[int]:
    return backend.tokenizer.encode(text, add_special_tokens=False)


class RecordingBackend(sgl.RuntimeBackend):
    """Records the prompt of every gen and how many gens were in the engine at once."""

    def __init__(self, engine):
        super().__init__(engine)
        self.prompts: list[list[int]] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def generate(self, ids, params):
        with self._lock:
            self.prompts.append(list(ids))
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            return super().generate(ids, params)
        finally:
            with self._lock:
                self.num_in_flight -= 1


def test_prompt_is_segment_tokens_then_model_ids(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Pick one\n\n"
        s += "The sea is"
        s += sgl.gen("g", max_tokens=6, ignore_eos=True)
        s += " end."

    state = prog.run(backend=tiny_backend, temperature=0)
    prompt = encode(tiny_backend, "Pick one\n\n") + encode(tiny_backend, "The sea is")
    out = tiny_backend.engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=6, temperature=0, ignore_eos=True))[0]
    assert state.ids == prompt + out.token_ids + encode(tiny_backend, " end.")
    assert state.text() == "Pick one\n\nThe sea is" + out.text + " end." and state["g"] == out.text
    meta = state.get_meta_info("g")
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["finish_reason"]) == (len(prompt), 6, "length")


def test_stop_string_keeps_model_ids_or_retokenizes_the_cut_text(tiny_backend):
    tok = tiny_backend.tokenizer
    prompt = encode(tiny_backend, "Once upon a time")
    base = tiny_backend.engine.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_new_tokens=16, temperature=0, ignore_eos=True))[0]
    token_texts = [tok.decode(base.token_ids[: k + 1]) for k in range(len(base.token_ids))]
    boundaries = {len(t) for t in token_texts}
    # A stop string (first occurrence, not at position 0) that ends the text at a token boundary, and one
    # that ends it inside a token.
    firsts = [k for k in range(1, len(base.text)) if base.text[k] not in base.text[:k] and base.text[k].strip()]
    at_boundary = next(k for k in firsts if k in boundaries)
    inside = next(k for k in firsts if k not in boundaries)

    @sgl.function
    def prog(s, stop_at):
        s += "Once upon a time"
        s += sgl.gen("g", max_tokens=16, ignore_eos=True, stop=stop_at)

    state = prog.run(stop_at=base.text[at_boundary], backend=tiny_backend, temperature=0)
    assert state["g"] == base.text[:at_boundary]
    assert state.ids == prompt + base.token_ids[: [len(t) for t in token_texts].index(at_boundary) + 1]
    state = prog.run(stop_at=base.text[inside], backend=tiny_backend, temperature=0)
    assert state["g"] == base.text[:inside]
    assert state.ids == prompt + encode(tiny_backend, base.text[:inside])


def test_multi_turn_chat_renders_like_apply_chat_template(tiny_engine):
    backend = RecordingBackend(tiny_engine)

    @sgl.function
    def chat(s, with_system):
        if with_system:
            s += sgl.system("You are terse.")
        s += sgl.user("Hi there")
        s += sgl.assistant(sgl.gen("a1", max_tokens=4))
        with s.user():
            s += "Second " + "question"
        s += sgl.assistant_begin()
        s += sgl.gen("a2", max_tokens=4)
        s += sgl.assistant_end()
        s += sgl.user_begin() + "  Third, padded  " + sgl.user_end()  # content is kept exactly
        s.assistant("A fixed answer.")

    for with_system in (False, True):
        backend.prompts.clear()
        state = chat.run(with_system=with_system, backend=backend, temperature=0)
        messages = state.messages()
        assert [m["role"] for m in messages] == ["system"] * with_system + ["user", "assistant"] * 3
        assert [m["content"] for m in messages[-6:]] == [
            "Hi there", state["a1"], "Second question", state["a2"], "  Third, padded  ", "A fixed answer."]
        assert state.text() == tiny_engine.tokenizer.apply_chat_template(messages, tokenize=False)
        # SmolLM2's default system message appears exactly when the program has no system message.
        assert ("You are a helpful AI assistant named SmolLM" in state.text()) is not with_system
        # The generation sits where the template puts the assistant's content.
        assert f"<|im_start|>assistant\n{state['a1']}<|im_end|>\n<|im_start|>user\nSecond" in state.text()
        # Every prompt sent extends the previous one: the prefix cache stays aligned.
        first, second = backend.prompts
        assert second[: len(first)] == first and state.ids[: len(second)] == second


def test_roles_render_as_plain_lines_without_a_chat_template(tiny_backend):
    tiny_backend.chat_template = ChatTemplate(SimpleNamespace(chat_template=None))

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=3))

    state = chat.run(backend=tiny_backend, temperature=0)
    assert state.text() == f"user: Hi\nassistant: {state['a']}\n"


def test_run_defaults_apply_unless_the_gen_sets_its_own(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Count:" + sgl.gen("default") + sgl.gen("own", max_tokens=2)
        s += sgl.gen("sampled", max_tokens=8, temperature=1.5)

    state = prog.run(backend=tiny_backend, max_new_tokens=5, ignore_eos=True, temperature=0)
    assert state.get_meta_info("default")["completion_tokens"] == 5
    assert state.get_meta_info("own")["completion_tokens"] == 2
    again = prog.run(backend=tiny_backend, max_new_tokens=5, ignore_eos=True, temperature=0)
    assert again["default"] == state["default"] and again["own"] == state["own"]  # greedy by default
    samples = {prog.run(backend=tiny_backend, max_new_tokens=5, ignore_eos=True, temperature=0)["sampled"]
               for _ in range(3)}
    assert len(samples) > 1  # the gen's own temperature wins over the program's 0


def test_gen_n_and_logprobs_in_meta_info(tiny_backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("many", max_tokens=3, n=2, temperature=1.0, ignore_eos=True)
        s += sgl.gen("lp", max_tokens=3, return_logprob=True, top_logprobs_num=2, ignore_eos=True)

    state = prog.run(backend=tiny_backend, temperature=0)
    assert isinstance(state["many"], list) and len(state["many"]) == 2 and len(state.get_meta_info("many")) == 2
    assert state.text().startswith("x" + state["many"][0])
    meta = state.get_meta_info("lp")
    assert len(meta["output_token_logprobs"]) == 3 and all(lp <= 0 for lp, *_ in meta["output_token_logprobs"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2, 2, 2]
    assert [top[0][0] >= lp for top, (lp, *_) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"])] \
        == [True] * 3


def test_fork_runs_branches_together_on_a_prefix_computed_once(tiny_engine):
    """Depends on the prefix cache for the cached_tokens check."""
    backend = RecordingBackend(tiny_engine)
    tiny_engine.flush_cache()
    header = "A shared header with enough words in it to be worth computing once before the branches start. "

    @sgl.function
    def prog(s):
        s += header
        forks = s.fork(3)
        forks += lambda i: f"Branch {i}:"
        forks += sgl.gen("tip", max_tokens=16, ignore_eos=True)
        forks.join()
        s += " | ".join(s["tip"])

    state = prog.run(backend=backend, temperature=0)
    tips = state["tip"]
    assert len(tips) == 3 and len(state.get_meta_info("tip")) == 3
    assert state.text() == header + " | ".join(tips)
    assert backend.max_in_flight >= 2  # the branches' gens were in the engine together, not one after another
    num_header_ids = len(encode(backend, header))
    assert all(meta["cached_tokens"] >= num_header_ids for meta in state.get_meta_info("tip"))


def test_fork_concatenate_and_sglang_style_reads(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Start."
        forks = s.fork(2)
        forks += [" one", " two"]
        forks += sgl.gen("x", max_tokens=3, ignore_eos=True)
        s["seen"] = [forks[i]["x"] for i in range(2)]  # SGLang style: read the branches without joining
        forks.join("concate_and_append")
        return forks

    state = prog.run(backend=tiny_backend, temperature=0)
    x0, x1 = state["seen"]
    forks = state.ret_value
    assert state.text() == "Start. one" + x0 + " two" + x1
    start = encode(tiny_backend, "Start.")
    assert state.ids == forks[0].ids + forks[1].ids[len(start):]
    assert forks[1].text() == "Start. two" + x1
    with pytest.raises(RuntimeError, match="already joined"):
        forks[0] += "more"


def test_nested_fork_gathers_into_each_level(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Root."
        outer = s.fork(2)
        for i, branch in enumerate(outer):
            branch += f" Outer {i}."
            inner = branch.fork(2)
            inner += sgl.gen("leaf", max_tokens=2, ignore_eos=True)
            inner.join()
        outer.join()

    state = prog.run(backend=tiny_backend, temperature=0)
    assert [len(leaves) for leaves in state["leaf"]] == [2, 2]


def test_a_failed_branch_fails_join(tiny_backend):
    @sgl.function
    def prog(s):
        s += "Go."
        forks = s.fork(2)
        forks += [sgl.gen("x", max_tokens=2), sgl.gen("x", max_tokens=2, top_p=0.0)]
        forks.join()

    with pytest.raises(RuntimeError, match="fork branch 1 of program 'prog'.*gen 'x'.*top_p"):
        prog.run(backend=tiny_backend)


def test_run_batch_returns_states_in_input_order_with_a_progress_bar(tiny_backend, capsys):
    @sgl.function
    def item(s, i):
        s += f"Item {i}:"
        s += sgl.gen("g", max_tokens=2, ignore_eos=True)

    states = item.run_batch([{"i": i} for i in range(200)], backend=tiny_backend, progress_bar=True, temperature=0)
    assert [st.text().startswith(f"Item {i}:") for i, st in enumerate(states)] == [True] * 200
    assert all(st.error() is None and st.get_meta_info("g")["completion_tokens"] == 2 for st in states)
    assert "200/200" in capsys.readouterr().err
    states = item.run_batch([(7,), (8,)], backend=tiny_backend, num_threads=1, temperature=0)
    assert [st.text()[:7] for st in states] == ["Item 7:", "Item 8:"]


def test_run_batch_keeps_a_failure_on_its_state_and_finishes_the_rest(tiny_backend):
    @sgl.function
    def prog(s, i):
        s += f"n{i}" + sgl.gen("g", max_tokens=2)
        if i == 3:
            s += s["missing"]
        s += sgl.select("pick", ["a", "b"])

    states = prog.run_batch([{"i": i} for i in range(8)], backend=tiny_backend)
    errors = [st.error() for st in states]
    assert isinstance(errors[3], KeyError) and "'missing'" in str(errors[3]) and "'prog'" in str(errors[3])
    assert all(e is None for i, e in enumerate(errors) if i != 3)
    assert all(st["pick"] in ("a", "b") for i, st in enumerate(states) if i != 3)
    with pytest.raises(KeyError, match="'pick'.*failed first"):
        states[3]["pick"]


def test_errors_name_what_went_wrong(tiny_backend):
    @sgl.function
    def qa(s):
        s += "Q:" + sgl.gen("answer", max_tokens=2)
        s += s["answr"]

    with pytest.raises(KeyError, match="'answr' is not set in program 'qa'"):
        qa.run(backend=tiny_backend)

    @sgl.function
    def nested(s):
        s += sgl.user_begin() + sgl.assistant_begin()

    with pytest.raises(ValueError, match="roles do not nest"):
        nested.run(backend=tiny_backend)

    @sgl.function
    def starts_with_gen(s):
        s += sgl.gen("a", max_tokens=2)

    with pytest.raises(ValueError, match="gen 'a' in program 'starts_with_gen'.*prompt is empty"):
        starts_with_gen.run(backend=tiny_backend)

    @sgl.function
    def empty_choice(s):
        s += "Pick:" + sgl.select("c", ["x", ""])

    with pytest.raises(ValueError, match="select 'c'.*choice '' has no tokens"):
        empty_choice.run(backend=tiny_backend)


def test_streaming_pieces_join_to_the_final_text(tiny_backend):
    @sgl.function
    def chat(s):
        s += sgl.user("Tell me something.")
        s += sgl.assistant(sgl.gen("a", max_tokens=12, ignore_eos=True))
        s += sgl.user("More.")
        s += sgl.assistant(sgl.gen("b", max_tokens=12, ignore_eos=True))

    state = chat.run(backend=tiny_backend, stream=True, temperature=0)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text() and len(pieces) > 4
    assert state["a"] == chat.run(backend=tiny_backend, temperature=0)["a"]
    state = chat.run(backend=tiny_backend, stream=True, temperature=0)
    assert "".join(state.text_iter("b")) == state["b"] and state.error() is None

    @sgl.function
    def fails(s):
        s += "Start:" + sgl.gen("a", max_tokens=4)
        raise RuntimeError("boom")

    state = fails.run(backend=tiny_backend, stream=True)
    assert "".join(state.text_iter()) == state.text() and state.text().startswith("Start:")
    assert str(state.error()) == "boom"


def test_select_scores_choices_after_the_exact_prefix_ids(tiny_backend):
    """A prefix ending in "\\n\\n" (one token) followed by a choice would tokenize as "\\n", "\\n", choice if the
    text were tokenized again; the prefix ids stay as they are and every choice is scored after them."""
    prefix = encode(tiny_backend, "Pick one\n\n")
    assert tiny_backend.tokenizer.decode(prefix[-1:]) == "\n\n"
    assert encode(tiny_backend, "Pick one\n\nA")[: len(prefix)] != prefix
    choices = ["A", "B", "\nC"]

    @sgl.function
    def pick(s, method):
        s += "Pick one\n\n"
        s += sgl.select("c", choices, choices_method=method)

    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        state = pick.run(method=method, backend=tiny_backend)
        assert state.ids == prefix + encode(tiny_backend, state["c"])
        meta = state.get_meta_info("c")
        for choice, logprobs in zip(choices, meta["input_token_logprobs"]):
            ids = prefix + encode(tiny_backend, choice)
            direct = tiny_backend.engine.generate(input_ids=[ids], sampling_params=SamplingParams(
                max_new_tokens=1, temperature=0, prompt_logprobs=True))[0].prompt_logprobs[len(prefix):]
            assert logprobs == pytest.approx(direct, abs=1e-4)
        assert state["c"] == choices[method(meta["input_token_logprobs"],
                                            meta.get("unconditional_token_logprobs")).index]
        assert len(meta["scores"]) == 3


def test_programs_sharing_a_prefix_hit_the_cache(tiny_backend):
    """Depends on the prefix cache."""
    header = "".join(f"Question: is {i} even?\nAnswer: {'yes' if i % 2 == 0 else 'no'}\n\n" for i in range(8))

    @sgl.function
    def few_shot(s, i):
        s += header + f"Question: is {i} even?\nAnswer:"
        # The programs start together: their first call finds the header cached only because run_batch
        # prefilled the first program's prompt before starting them.
        s += sgl.gen("first", max_tokens=2)
        s += "\nSo:" + sgl.select("answer", [" yes", " no"])

    states = few_shot.run_batch([{"i": i} for i in range(8)], backend=tiny_backend, temperature=0)
    num_header_ids = len(encode(tiny_backend, header))
    for state in states:
        assert state.get_meta_info("first")["cached_tokens"] >= num_header_ids
        assert state.get_meta_info("answer")["cached_tokens"] >= 2 * num_header_ids  # both choices' requests


def test_default_backend_runtime_and_flush_cache(tiny_backend, tiny_llama_path, monkeypatch):
    """flush_cache part depends on the prefix cache."""
    monkeypatch.setattr(deepinfer_lang.backend, "_default_backend", None)

    @sgl.function
    def prog(s):
        s += "A prompt long enough to leave some full pages in the radix tree." + sgl.gen("g", max_tokens=2)

    with pytest.raises(RuntimeError, match="set_default_backend"):
        prog.run()
    sgl.set_default_backend(tiny_backend)
    prog.run()
    assert prog.run().get_meta_info("g")["cached_tokens"] > 0
    sgl.flush_cache()
    assert prog.run().get_meta_info("g")["cached_tokens"] == 0
    with sgl.Runtime(model=str(tiny_llama_path), dtype="float32", kv_cache_tokens=1024) as runtime:
        assert prog.run(backend=runtime, max_new_tokens=3, ignore_eos=True).get_meta_info("g")["completion_tokens"] == 2
