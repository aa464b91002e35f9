"""The language without a model: expressions, argument mapping, select's scoring methods, chat-template roles."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

import deepinfer_lang as sgl
from deepinfer_lang.chat_template import ChatTemplate
from deepinfer_lang.choices import sample_index
from deepinfer_lang.ir import ExprList, Gen, GenArgs, RoleBegin, RoleEnd, Select, Text


def test_plus_builds_one_flat_expression():
    expr = "Q: " + sgl.gen("a") + "\n" + (sgl.select("b", ["x", "y"]) + "!")
    assert isinstance(expr, ExprList)
    assert [type(e) for e in expr.items] == [Text, Gen, Text, Select, Text]
    assert sgl.user("hi").items == (RoleBegin("user"), Text("hi"), RoleEnd("user"))
    assert sgl.assistant(sgl.gen("a")).items[1].name == "a"
    assert sgl.system_begin() == RoleBegin("system") and sgl.assistant_end() == RoleEnd("assistant")
    with pytest.raises(TypeError, match="format values"):
        _ = "n = " + sgl.gen("a") + 3


def test_gen_arguments_map_to_sampling_params_over_run_defaults():
    gen = sgl.gen("a", max_tokens=5, min_tokens=1, stop="\n", return_logprob=True, top_logprobs_num=2, top_k=7)
    defaults = GenArgs(max_new_tokens=99, temperature=0.0, stop=["never"])
    params = gen.args.over(defaults).to_sampling_params()
    assert (params.max_new_tokens, params.min_new_tokens, params.stop, params.temperature) == (5, 1, "\n", 0.0)
    assert (params.logprobs, params.top_logprobs, params.top_k) == (True, 2, 7)
    assert GenArgs().over(GenArgs()).to_sampling_params().max_new_tokens == 128  # SamplingParams' own default


def test_run_rejects_unknown_sampling_arguments():
    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(TypeError, match="max_tokenz"):
        prog.run_batch([{}], max_tokenz=3)
    with pytest.raises(TypeError, match="first parameter"):
        sgl.function(lambda: None)


def test_gen_choices_dtype_and_regex():
    sel = sgl.gen("city", choices=["a", "b"], choices_method=sgl.greedy_token_selection)
    assert isinstance(sel, Select) and sel.choices == ("a", "b") and sel.choices_method is sgl.greedy_token_selection
    as_int = sgl.gen_int("n", stop="x")
    assert as_int.args.regex.startswith("[-+]?[0-9]+") and as_int.args.stop == ["x", " ", "\n"]
    assert sgl.gen("n", dtype="int").args.regex == as_int.args.regex
    assert sgl.gen_string("s").args.regex.startswith('\\"')
    with pytest.raises(ValueError, match="gen 'n'.*dtype"):
        sgl.gen("n", dtype=list)
    with pytest.raises(ValueError, match="gen 'n'.*not both"):
        sgl.gen("n", dtype=int, regex="[0-9]+")


def test_invalid_regex_names_the_gen():
    with pytest.raises(ValueError, match="gen 'code'.*invalid regex"):
        sgl.gen("code", regex="([0-9]+")


def test_select_without_choices_names_the_variable():
    with pytest.raises(ValueError, match="select 'answer'"):
        sgl.select("answer", [])
    with pytest.raises(ValueError, match="select 'answer'"):
        sgl.gen("answer", choices=[])


def test_token_length_normalized_takes_the_best_mean():
    decision = sgl.token_length_normalized([[-1.0], [-3.0, -0.1], [-0.9, -0.95]])
    assert decision.index == 2 and decision.scores == pytest.approx([-1.0, -1.55, -0.925])


def test_greedy_token_selection_breaks_ties_on_later_tokens():
    # "organ" vs "organism": same first token (logprobs differ by batch noise), the second decides; the shorter
    # choice continues with its mean.
    decision = sgl.greedy_token_selection([[-0.5], [-0.5 + 1e-6, -0.2], [-2.0, -0.01]])
    assert decision.index == 1 and decision.scores[2] == -2.0
    assert sgl.greedy_token_selection([[-0.5], [-0.5, -0.9]]).index == 0
    assert sgl.greedy_token_selection([[-3.0, -0.01], [-0.4, -5.0]]).index == 1


def test_unconditional_likelihood_normalized_divides_out_the_prior():
    # Choice 0 is likelier after the prompt, but only because it is a common string anyway.
    conditional, unconditional = [[-1.0], [-2.0]], [[-0.5], [-6.0]]
    assert sgl.token_length_normalized(conditional).index == 0
    decision = sgl.unconditional_likelihood_normalized(conditional, unconditional)
    assert decision.index == 1 and decision.scores == pytest.approx([-0.5, 4.0])
    assert sgl.unconditional_likelihood_normalized.requires_unconditional_logprobs
    with pytest.raises(ValueError):
        sgl.unconditional_likelihood_normalized(conditional, None)


def test_select_temperature_samples_by_score():
    rng = random.Random(0)
    assert {sample_index([-1.0, -5.0, -9.0], 1e-3, rng) for _ in range(50)} == {0}
    assert {sample_index([-1.0, -5.0, -9.0], 100.0, rng) for _ in range(200)} == {0, 1, 2}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _render_by_segments(template: ChatTemplate, messages: list[dict]) -> str:
    text, done = "", []
    for m in messages:
        begin, end = template.role_segments(done, m["role"])
        text += begin + m["content"] + end
        done.append(m)
    return text


def test_role_segments_rebuild_apply_chat_template(smollm2_tokenizer):
    template = ChatTemplate(smollm2_tokenizer)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "  spaces kept  "}, {"role": "assistant", "content": ""}]
    for messages in (chat, [{"role": "system", "content": "Be brief."}] + chat):
        expected = smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
        assert _render_by_segments(template, messages) == expected
    # SmolLM2's template adds a default system message when the conversation does not start with one.
    begin, end = template.role_segments([], "user")
    assert begin.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert begin.endswith("<|im_end|>\n<|im_start|>user\n")
    assert template.role_segments([], "system") == ("<|im_start|>system\n", "<|im_end|>\n")
    assert end == "<|im_end|>\n"


def test_roles_without_a_chat_template_are_plain_lines():
    template = ChatTemplate(SimpleNamespace(chat_template=None))
    assert _render_by_segments(template, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]) \
        == "user: Hi\nassistant: Yo\n"


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class Rewriting:  # renders the last message differently from the earlier ones
        chat_template = "..."

        def apply_chat_template(self, messages, tokenize):
            return "".join(("LAST:" if i == len(messages) - 1 else "") + m["content"] + "\n"
                           for i, m in enumerate(messages))

    template = ChatTemplate(Rewriting())
    assert template.role_segments([], "user") == ("LAST:", "\n")
    with pytest.raises(ValueError, match="re-renders earlier turns"):
        template.role_segments([{"role": "user", "content": "a"}], "assistant")
