"""IncrementalDetokenizer with the real SmolLM2 byte-level BPE tokenizer: UTF-8 safety, stop strings, streaming."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_rt.tokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld 😀👍🏽 日本語のテキスト café naïve",
    "🤖🧠 漢字 ñandú",
    "Ünïcödé — “quotes” … €100 ½",
    "family 👨\u200d👩\u200d👧\u200d👦 flags 🇫🇷🇯🇵 done",
    "안녕하세요 세계! Привет, мир. مرحبا",
    "日本語",
    "😀",
]
PROMPTS = ["Translate:", "Emoji time 🎉🎉", "é"]


@pytest.fixture(scope="module")
def tok(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def splits_characters(tok, ids) -> bool:
    return any("\ufffd" in tok.decode([i]) for i in ids)


def feed(tok, prompt: str, ids: list[int], stop=()):
    """Add ids one at a time; returns (detokenizer, texts after each add, index of the stop token or None)."""
    d = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop))
    texts = []
    for i, t in enumerate(ids):
        if d.add(t):
            texts.append(d.text)
            return d, texts, i
        texts.append(d.text)
    d.flush()
    return d, texts, None


def reference_stop(tok, ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """Text at the first token after which the decoded output contains a stop string, cut before the earliest
    occurrence; or the whole decode."""
    for i in range(1, len(ids) + 1):
        text = decode(tok, ids[:i])
        if text.endswith("\ufffd"):
            continue
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], i - 1
    return decode(tok, ids), None


# ---------------------------------------------------------------- UTF-8 safety


def test_texts_really_split_characters_across_tokens(tok):
    assert sum(splits_characters(tok, tok.encode(t)) for t in TEXTS) >= 5


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_shows_replacement_char(tok, prompt, text):
    ids = tok.encode(text)
    d, texts, stopped = feed(tok, prompt, ids)
    assert stopped is None
    for i, t in enumerate(texts):
        assert "\ufffd" not in t, f"U+FFFD in the text after token {i}: {t!r}"
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), "text shrank or changed while streaming"
    assert d.text == decode(tok, ids) == text


def test_leading_space_of_first_output_token_survives(tok):
    ids = tok.encode(" world and 世界")
    d, _, _ = feed(tok, "Hello", ids)
    assert d.text == " world and 世界"


def test_special_tokens_are_skipped(tok):
    eos = tok.eos_token_id
    ids = tok.encode("a 😀") + [eos] + tok.encode(" b")
    d, texts, _ = feed(tok, "x", ids)
    assert d.text == decode(tok, ids) == "a 😀 b"
    assert all("\ufffd" not in t for t in texts)


def test_flush_shows_an_incomplete_tail(tok):
    ids = tok.encode("ok 😀")
    assert splits_characters(tok, ids[-1:]) or splits_characters(tok, ids[-2:])
    cut = ids[:-1]  # the emoji's last byte never arrives
    d = IncrementalDetokenizer(tok, tok.encode("hi"), [])
    for t in cut:
        d.add(t)
    assert "\ufffd" not in d.text
    d.flush()
    assert d.text == decode(tok, cut)
    assert d.text.endswith("\ufffd")


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab éü€½中文日本語한글😀🎉👍🏽🇫🇷\n")), min_size=1, max_size=24))
def test_random_multibyte_text_round_trips(tok, text):
    ids = tok.encode(text)
    d, texts, _ = feed(tok, "Say:", ids)
    assert all("\ufffd" not in t for t in texts)
    assert d.text == decode(tok, ids)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab éü€½中文日本語한글😀🎉👍🏽🇫🇷\n")), min_size=1, max_size=24),
       st.lists(st.integers(0, 30), max_size=6))
def test_lazy_detokenizer_reads_the_same_text(tok, text, reads):
    """Without stop strings tokens are queued and decoded when read: read after any tokens (a stream reader's
    catch-up) and at the end, the text is what one add per token gives (so never a held-back U+FFFD)."""
    ids = tok.encode(text)
    eager, texts, _ = feed(tok, "Say:", ids)
    lazy = IncrementalDetokenizer(tok, tok.encode("Say:"), [])
    assert lazy.is_lazy and not IncrementalDetokenizer(tok, [], ["x"]).is_lazy
    streamed = ""
    for i, t in enumerate(ids):
        lazy.queue(t)
        if i in reads:
            streamed += lazy.take_delta(False)
            assert lazy.text == texts[i]
    lazy.flush()
    streamed += lazy.take_delta(True)
    assert lazy.text == streamed == eager.text == decode(tok, ids)


def test_lazy_detokenizer_read_from_another_thread(tok):
    """A stream reader catching up on its own thread while the loop queues tokens: nothing is lost or doubled."""
    import threading

    ids = tok.encode(" ".join(TEXTS) * 4)
    lazy = IncrementalDetokenizer(tok, tok.encode("Say:"), [])
    streamed, done = [], threading.Event()

    def read():
        while not done.is_set():
            streamed.append(lazy.take_delta(False))

    reader = threading.Thread(target=read)
    reader.start()
    for t in ids:
        lazy.queue(t)
    done.set()
    reader.join()
    lazy.flush()
    streamed.append(lazy.take_delta(True))
    assert "".join(streamed) == lazy.text == decode(tok, ids)


# ---------------------------------------------------------------- stop strings


def test_stop_string_inside_one_token(tok):
    text = "The cat sat on the mat. Then it slept."
    ids = tok.encode(text)
    d, _, stopped = feed(tok, "Story:", ids, stop=["mat"])
    assert d.text == "The cat sat on the "
    assert stopped is not None and stopped < len(ids) - 1
    assert "mat" in decode(tok, ids[: stopped + 1]) and "mat" not in decode(tok, ids[:stopped])


def test_stop_string_spanning_token_boundaries(tok):
    ids = tok.encode(" hello world")
    assert len(ids) == 2
    stop = "lo wo"
    assert all(stop not in tok.decode([i]) for i in ids)
    d, _, stopped = feed(tok, "Say:", ids, stop=[stop])
    assert stopped == 1
    assert d.text == " hel"


def test_stop_string_spanning_split_multibyte_characters(tok):
    text = "abc 日本語のテキスト xyz"
    ids = tok.encode(text)
    assert splits_characters(tok, ids)
    for stop in ["本語", "語の", "のテ", "ト x"]:
        d, _, stopped = feed(tok, "x", ids, stop=[stop])
        assert stopped is not None, stop
        assert d.text == text[: text.index(stop)]


def test_stop_string_absent_keeps_whole_text(tok):
    text = "nothing to see here 😀"
    ids = tok.encode(text)
    d, _, stopped = feed(tok, "x", ids, stop=["zzz", "😀😀"])
    assert stopped is None and d.text == text


def test_stop_string_earlier_in_list_but_later_in_text(tok):
    # Two stop strings complete with the same token: the text is cut before the earliest occurrence, so the
    # returned text contains no stop string whatever the order of the list.
    ids = tok.encode(" hello world")
    for stops in (["ld", "wo"], ["wo", "ld"]):
        d, _, stopped = feed(tok, "Say:", ids, stop=stops)
        assert stopped == 1
        assert d.text == " hello ", f"stop={stops}: got {d.text!r}"
        assert not any(s in d.text for s in stops)


def test_stop_string_completing_first_wins_over_longer_earlier_one(tok):
    # "hello wor" starts earlier but completes later than "ll": streaming ends at the first completed match.
    ids = tok.encode(" hello world")
    d, _, stopped = feed(tok, "x", ids, stop=["hello wor", "ll"])
    assert stopped == 0 and d.text == " he"


def test_stop_strings_of_different_lengths(tok):
    text = "one two three four five six"
    ids = tok.encode(text)
    d, _, _ = feed(tok, "x", ids, stop=["four five six seven", "e f", "x"])
    assert d.text == "one two thre"


def test_check_stop_false_does_not_cut(tok):
    ids = tok.encode(" hello world")
    d = IncrementalDetokenizer(tok, tok.encode("x"), ["hello"])
    assert d.add(ids[0], check_stop=False) is False
    assert d.text == " hello"


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cé€中日😀👍🏽")), min_size=1, max_size=20),
       data=st.data())
def test_stop_string_random(tok, text, data):
    ids = tok.encode(text)
    full = decode(tok, ids)
    if data.draw(st.booleans()) and len(full) >= 1:
        i = data.draw(st.integers(0, len(full) - 1))
        j = data.draw(st.integers(i + 1, min(len(full), i + 5)))
        stop = full[i:j]
    else:
        stop = data.draw(st.text(alphabet=st.sampled_from(list("abc é中😀")), min_size=1, max_size=4))
    d, texts, stopped = feed(tok, "Go:", ids, stop=[stop])
    expect_text, expect_at = reference_stop(tok, ids, [stop])
    assert d.text == expect_text
    assert stopped == expect_at
    assert all("\ufffd" not in t for t in texts)


# ---------------------------------------------------------------- take_delta


def stream(tok, prompt: str, ids: list[int], stop):
    d = IncrementalDetokenizer(tok, tok.encode(prompt), list(stop))
    deltas = []
    emitted_after_each = []
    for t in ids:
        done = d.add(t)
        if done:
            deltas.append(d.take_delta(True))
            emitted_after_each.append("".join(deltas))
            return d, deltas, emitted_after_each
        deltas.append(d.take_delta(False))
        emitted_after_each.append("".join(deltas))
    d.flush()
    deltas.append(d.take_delta(True))
    emitted_after_each.append("".join(deltas))
    return d, deltas, emitted_after_each


@pytest.mark.parametrize("text, stop", [
    (" hello world, hello moon", ["o m"]),
    (" hello world, hello moon", ["world!"]),  # a prefix of the stop string is held back, then released
    ("日本語のテキストです", ["テキス"]),
    ("abc 😀👍🏽 def", ["👍"]),
    ("abc 😀👍🏽 def", []),
    ("one two three four", ["three", "tw", "zz"]),
])
def test_take_delta_never_emits_part_of_a_stop_string(tok, text, stop):
    ids = tok.encode(text)
    d, deltas, emitted = stream(tok, "x", ids, stop)
    assert "".join(deltas) == d.text
    for e in emitted:
        assert d.text.startswith(e), f"streamed {e!r}, which is not a prefix of the final text {d.text!r}"
        assert not any(s in e for s in stop)
        assert "\ufffd" not in e


def test_take_delta_holds_back_possible_stop_prefix(tok):
    ids = tok.encode(" hello world")
    d = IncrementalDetokenizer(tok, tok.encode("x"), ["world!"])
    d.add(ids[0])
    d.add(ids[1])
    running = d.take_delta(False)
    assert running == " hello ", "the tail that could start 'world!' must be held back"
    assert d.take_delta(False) == ""
    assert d.take_delta(True) == "world"


def test_take_delta_without_stop_strings_emits_everything(tok):
    ids = tok.encode(" hello 日本")
    d = IncrementalDetokenizer(tok, tok.encode("x"), [])
    out = []
    for t in ids:
        d.add(t)
        out.append(d.take_delta(False))
        assert "".join(out) == d.text
    assert d.take_delta(True) == ""


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab cé中😀")), min_size=1, max_size=20), data=st.data())
def test_take_delta_random(tok, text, data):
    ids = tok.encode(text)
    full = decode(tok, ids)
    stops = data.draw(st.lists(st.text(alphabet=st.sampled_from(list("ab c中😀")), min_size=1, max_size=4),
                               max_size=1))
    if data.draw(st.booleans()) and len(full) >= 2:
        i = data.draw(st.integers(0, len(full) - 2))
        stops = [full[i : i + 2]]
    d, deltas, emitted = stream(tok, "Go:", ids, stops)
    assert "".join(deltas) == d.text
    for e in emitted:
        assert d.text.startswith(e)
        assert "\ufffd" not in e


def test_ids_decoder_equals_tokenizer_decode(tok):
    """The direct Rust decode the detokenizer uses matches transformers' decode, special tokens included."""
    import random

    from deepinfer_rt.tokenizer import ids_decoder

    rng = random.Random(0)
    special = tok.all_special_ids
    decode_ids = ids_decoder(tok)
    for _ in range(500):
        ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 8))]
        assert decode_ids(ids) == tok.decode(ids, skip_special_tokens=True)


def test_batched_decode_of_many_detokenizers_equals_one_at_a_time(tok):
    """The overlap scheduler's path: every request's windows of a step decoded in one batched call (push,
    batch decode, commit) gives the texts and stops of `add` one request at a time."""
    from deepinfer_rt.tokenizer import batch_decoder

    decode_batch = batch_decoder(tok)
    streams = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    stops = [["ü"], [], ["mir"], ["👦 flags"], [], [], []]
    one = [IncrementalDetokenizer(tok, tok.encode(p), s) for p, s in zip(PROMPTS * 3, stops)]
    many = [IncrementalDetokenizer(tok, tok.encode(p), s) for p, s in zip(PROMPTS * 3, stops)]
    stopped_one, stopped_many = [None] * len(one), [None] * len(one)
    for step in range(max(map(len, streams))):
        live = [i for i, ids in enumerate(streams) if step < len(ids) and stopped_one[i] is None]
        for i in live:
            if one[i].add(streams[i][step]):
                stopped_one[i] = step
        windows = [many[i].push(streams[i][step]) for i in live]
        prefixes, texts = decode_batch([w[0] for w in windows]), decode_batch([w[1] for w in windows])
        for i, prefix, text in zip(live, prefixes, texts):
            if many[i].commit(prefix, text):
                stopped_many[i] = step
    assert stopped_many == stopped_one
    assert [d.text for d in many] == [d.text for d in one]
    assert any(s is not None for s in stopped_one) and any(s is None for s in stopped_one)
