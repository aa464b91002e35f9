"""DeepSeek-V4.1 Engram: n-gram hash embeddings gated into the residual streams before a layer's attention.

  1. Token ids map to a compressed vocabulary: the text of each token, NFKC then NFD, combining marks (Mn, Mc, Me)
     dropped, lowercased, runs of space / tab / CR / LF collapsed to one space, then Unicode white space trimmed
     unless the text is exactly one space;
     tokens whose text is the same after that share one id (`compressed_vocabulary`). A token whose text holds U+FFFD
     (a partial UTF-8 sequence) is keyed by its raw vocabulary string instead, which may coincide with another
     token's normalised text: on the DeepSeek tokenizer this gives the release's 99,092 ids (unique keys would give
     99,119).
  2. For n = 2 .. max_ngram and each of n_heads heads, the n most recent compressed ids (pad id before the
     sequence start) are mixed as XOR_k id[t-k] * m_k with per-layer odd multipliers m (numpy's default_rng seeded
     by 10007 * layer id) and reduced modulo that (n, head)'s prime table size; the primes are the successive
     primes above engram_vocab_size - 1, none used twice in the model (`EngramHashing`).
  3. The rows of the layer's table (head sections end to end) are concatenated, projected by `wkv` into hc_mult
     keys then one value (keys first), and each stream s gets  s + sigmoid(signed_sqrt(<rms(s) w_h, rms(k) w_e> /
     sqrt(D))) * value, in fp32 (`Engram`).

Checkpoint names: layers.i.engram.{embed, wkv, hidden_norm, embed_norm}.weight. The release stores the tables in
FP8 e4m3 with an e8m0 scale per 32 columns (`embed.scale`, read as `embed.weight_scale_inv`) and `wkv` in the dense
FP8 layout: an FP8 checkpoint's tables stay FP8 in memory (`Fp8EngramTable`, a quarter of fp32's bytes) and only the
rows a step fetches are decoded; 16/32-bit tables load as an nn.Embedding. Both live on the model's device (host
memory, their intended home at full size, is a later step).
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer_rt.layers.fp8 import apply_keeping_quantized
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.layers.quant_formats import ENGRAM, MX_BLOCK, check_layout, decode_e8m0, role_layouts
from deepinfer_rt.models.deepseek_v4.methods import v4_method


# Unicode White_Space (what the tokenizers library's Strip trims; Python's str.strip() would also trim \x1c-\x1f).
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"


def _normalise(text: str) -> str:
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("M")).lower()  # all combining marks
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return " " if text == " " else text.strip(_WHITE_SPACE)


def compressed_vocabulary(token_texts: list[str], raw_tokens: list[str]) -> tuple[np.ndarray, int]:
    """(vocab,) int64 compressed id of every token id, and the number of compressed ids. token_texts: each id
    decoded alone; raw_tokens: each id's vocabulary string (the key of a text holding U+FFFD)."""
    if len(raw_tokens) != len(token_texts):
        raise ValueError(f"{len(raw_tokens)} raw tokens for {len(token_texts)} token texts")
    classes: dict[str, int] = {}
    table = np.empty(len(token_texts), dtype=np.int64)
    for tid, text in enumerate(token_texts):
        key = raw_tokens[tid] if "\ufffd" in text else (_normalise(text) or text)
        table[tid] = classes.setdefault(key, len(classes))
    return table, len(classes)


def tokenizer_vocabulary(path: str, vocab_size: int) -> tuple[np.ndarray, int]:
    """The compressed vocabulary of the tokenizer in a model folder (each id decoded on its own); computed once per
    tokenizer content and vocabulary size in a process, whichever folder holds that tokenizer."""
    files = sorted(Path(path).glob("tokenizer*.json"))
    if not files:
        raise ValueError(f"Engram needs the tokenizer of {path} (no tokenizer*.json there)")
    key = (hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest(), vocab_size)
    if key not in _VOCABULARIES:
        if len(_VOCABULARIES) >= 4:
            _VOCABULARIES.pop(next(iter(_VOCABULARIES)))
        _VOCABULARIES[key] = _vocabulary(path, vocab_size)
    return _VOCABULARIES[key]


_VOCABULARIES: dict[tuple[str, int], tuple[np.ndarray, int]] = {}
"""(tokenizer files' digest, vocab_size) -> compressed vocabulary: the four most recent."""


def _vocabulary(path: str, vocab_size: int) -> tuple[np.ndarray, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(path))
    ids = list(range(min(vocab_size, len(tok))))
    texts, raw = tok.batch_decode([[i] for i in ids]), tok.convert_ids_to_tokens(ids)
    unused = [f"\x00unused{i}" for i in range(len(texts), vocab_size)]
    return compressed_vocabulary(texts + unused, raw + unused)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    d = 3
    while d * d <= n:
        if n % d == 0:
            return False
        d += 2
    return True


class EngramHashing:
    """Table rows of every Engram layer for a token history (host-side numpy, int64)."""

    def __init__(self, layer_ids: tuple[int, ...], max_ngram: int, num_heads: int, vocab_size: int,
                 lookup: np.ndarray, num_compressed: int, pad_token_id: int):
        self.max_ngram, self.num_heads = max_ngram, num_heads
        self.lookup, self.pad = lookup, int(lookup[pad_token_id])
        half = max(1, (np.iinfo(np.int64).max // max(1, num_compressed)) // 2)
        used: set[int] = set()
        self._device_copies: dict[torch.device, DeviceEngramHashing] = {}
        self.sizes, self.offsets, self.multipliers = {}, {}, {}
        for layer in layer_ids:
            sizes = []
            for _ in range(2, max_ngram + 1):
                p = vocab_size - 1
                for _ in range(num_heads):
                    p += 1
                    while not _is_prime(p) or p in used:
                        p += 1
                    used.add(p)
                    sizes.append(p)
            self.sizes[layer] = np.array(sizes, dtype=np.int64)
            self.offsets[layer] = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            rng = np.random.default_rng(10007 * layer)
            self.multipliers[layer] = rng.integers(0, half, size=max_ngram, dtype=np.int64) * 2 + 1

    def table_rows(self, layer: int) -> int:
        return int(self.sizes[layer].sum())

    def rows(self, layer: int, history: np.ndarray) -> np.ndarray:
        """history (T, max_ngram) compressed ids, column k = the token k positions back -> (T, cols) rows."""
        m = self.multipliers[layer]
        out, mix = [], history[:, 0] * m[0]
        for n in range(2, self.max_ngram + 1):
            mix = np.bitwise_xor(mix, history[:, n - 1] * m[n - 1])
            j = slice((n - 2) * self.num_heads, (n - 1) * self.num_heads)
            out.append(self.offsets[layer][j] + mix[:, None] % self.sizes[layer][j])
        return np.concatenate(out, axis=1)

    def on_device(self, device: torch.device) -> "DeviceEngramHashing":
        """The same hashing as device tensors (fixed-shape decode steps: no host round trip), made once per device."""
        cached = self._device_copies.get(device)
        if cached is None:
            cached = self._device_copies[device] = DeviceEngramHashing(self, device)
        return cached


class DeviceEngramHashing:
    """EngramHashing.rows in torch int64 on one device (products stay below 2^63, as on the host: each multiplier
    is below int64 max / the number of compressed ids)."""

    def __init__(self, hashing: EngramHashing, device: torch.device):
        self.max_ngram, self.num_heads, self.pad = hashing.max_ngram, hashing.num_heads, hashing.pad
        self.lookup = torch.from_numpy(hashing.lookup).to(device)
        tables = {layer: (hashing.multipliers[layer], hashing.offsets[layer], hashing.sizes[layer])
                  for layer in hashing.sizes}
        self.tables = {layer: tuple(torch.from_numpy(a).to(device) for a in t) for layer, t in tables.items()}

    def rows(self, layer: int, history: torch.Tensor) -> torch.Tensor:
        """history (T, max_ngram) int64 compressed ids, column k = k positions back -> (T, cols) table rows."""
        m, offsets, sizes = self.tables[layer]
        out, mix = [], history[:, 0] * m[0]
        for n in range(2, self.max_ngram + 1):
            mix = torch.bitwise_xor(mix, history[:, n - 1] * m[n - 1])
            j = slice((n - 2) * self.num_heads, (n - 1) * self.num_heads)
            out.append(offsets[j] + torch.remainder(mix[:, None], sizes[j]))
        return torch.cat(out, dim=1)


class Fp8EngramTable(nn.Module):
    """An Engram table as the release stores it: `weight` float8_e4m3fn (rows, D), `weight_scale_inv` the raw e8m0
    bytes (rows, D / 32) -- each 2^(b - 127) for its 32 columns. Row r of the table = weight[r] x its scales,
    exact in fp32; forward decodes only the rows asked for."""

    _LAYOUT = role_layouts((1, MX_BLOCK), "fp8")[ENGRAM]

    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        if dim % MX_BLOCK:
            raise ValueError(f"FP8 Engram tables need a width that is a multiple of {MX_BLOCK} (one e8m0 scale per "
                             f"{MX_BLOCK} columns), the config's engram_head_dim is {dim}")
        self.num_rows, self.dim = num_rows, dim
        self.weight = nn.Parameter(torch.empty(num_rows, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(num_rows, dim // MX_BLOCK, dtype=torch.uint8),
                                             requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self.weight_scale_inv.weight_loader = self._load_scale

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_layout("engram table", self._LAYOUT, loaded, (self.num_rows, self.dim // MX_BLOCK), (self.num_rows,
                                                                                                self.dim))
        if tuple(loaded.shape) != (self.num_rows, self.dim):
            raise ValueError(f"engram table shape {tuple(loaded.shape)} != {(self.num_rows, self.dim)}")
        param.data.copy_(loaded)

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_layout("engram table", self._LAYOUT, None, tuple(loaded.shape), (self.num_rows, self.dim))
        if loaded.dtype == torch.float8_e8m0fnu or loaded.dtype == torch.uint8:
            decode_e8m0(loaded, "engram table scale")  # refuses the NaN byte
            param.data.copy_(loaded.view(torch.uint8))
        else:  # float32 powers of two (a V3.1-era writer): their e8m0 bytes
            _, exp = torch.frexp(decode_e8m0(loaded, "engram table scale"))
            param.data.copy_((exp - 1 + 127).to(torch.uint8))

    def _apply(self, fn, recurse=True):
        return apply_keeping_quantized(self, fn, lambda f: super(Fp8EngramTable, self)._apply(f, recurse))

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (...) row ids -> (..., D) fp32: value x 2^(b - 127), computed for the fetched rows only."""
        flat = rows.reshape(-1)
        exp = self.weight_scale_inv[flat].to(torch.int32) - 127
        scale = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp).repeat_interleave(MX_BLOCK, dim=-1)
        return (self.weight[flat].float() * scale).view(*rows.shape, self.dim)


def engram_table(num_rows: int, dim: int) -> nn.Module:
    """The module holding an Engram table for the checkpoint being built: FP8 where the checkpoint is quantized."""
    config = current_kernel_config()
    if config.quantization == "fp8" and config.is_checkpoint_quantized:
        return Fp8EngramTable(num_rows, dim)
    return nn.Embedding(num_rows, dim)


class Engram(nn.Module):
    def __init__(self, hidden_size: int, hc_mult: int, num_rows: int, head_dim: int, num_cols: int, eps: float,
                 is_host_table: bool = False):
        super().__init__()
        self.hc_mult, self.hidden_size, self.eps = hc_mult, hidden_size, eps
        self.embed = engram_table(num_rows, head_dim)
        self.is_host_table = is_host_table
        """The table (bf16/fp32, or FP8 + scales) stays in host memory (env.py DEEPINFER_V41_ENGRAM_HOST): device
        moves skip it, and each step gathers (and decodes) its rows on the host and copies them over (pinned when
        the device is a GPU)."""
        self.gather = self._host_rows if is_host_table else self.embed
        self.wkv = Linear(num_cols * head_dim, (hc_mult + 1) * hidden_size)
        self.hidden_norm = nn.Module()
        self.hidden_norm.weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.embed_norm = nn.Module()
        self.embed_norm.weight = nn.Parameter(torch.ones(hc_mult, hidden_size))
        self.method = v4_method(current_kernel_config())
        """Default or batch-invariant sigmoid (deepseek_v4/methods.py)."""

    def _host_rows(self, rows: torch.Tensor) -> torch.Tensor:
        fetched = self.embed(rows.cpu())
        if rows.is_cuda:
            fetched = fetched.pin_memory()
        return fetched.to(rows.device, non_blocking=True)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        if self.is_host_table:  # a model built on the device loads the table there first
            for p in self.embed.parameters():
                p.data = p.data.cpu()

    def _apply(self, fn, recurse=True):
        if not self.is_host_table:
            return super()._apply(fn, recurse)
        devices = [p.device for p in self.embed.parameters()]
        super()._apply(fn, recurse)
        # dtype casts apply to the host table too (an FP8 table keeps its dtype); device moves do not
        for p, device in zip(self.embed.parameters(), devices):
            p.data = p.data.to(device=device)
        return self

    def forward(self, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """streams (T, N, D), rows (T, cols) -> streams with the gated value added (gate in fp32)."""
        n, d = self.hc_mult, self.hidden_size
        kv = self.wkv(self.gather(rows).flatten(1).to(streams.dtype)).float()
        keys, value = kv[:, : n * d].view(-1, n, d), kv[:, n * d :]
        s = streams.float()
        s_rstd = torch.rsqrt(s.square().mean(-1) + self.eps)
        k_rstd = torch.rsqrt(keys.square().mean(-1) + self.eps)
        w = self.hidden_norm.weight.float() * self.embed_norm.weight.float()
        dot = (s * w * keys).sum(-1) * s_rstd * k_rstd * d ** -0.5
        gate = self.method.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))
        return (s + gate.unsqueeze(-1) * value.unsqueeze(1)).to(streams.dtype)
