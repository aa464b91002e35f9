"""DeepSeek-V4.1 oracle: a deliberately plain full-recompute forward of one sequence in fp32 (no cache, no batching).

It reads the raw HF text config (dict) and a state dict by checkpoint name, and shares no code with
deepinfer_rt. Every loop is over positions and layers in the open, so each rule is checkable by eye.

Which source each part follows (all public; nothing copied):
  * per-layer roles (raw compress_ratios 0/1/2; the latest kv / index source at or before a layer; the candidate
    source feeding later index sources): TensorRT-LLM tensorrt_llm/_torch/configs/deepseek_v41.py
    (build_layer_descriptors) and DeepInfer 0.1.0 v4_modules/cross_layer.py.
  * attention (shared-KV MQA, K = V, interleaved partial RoPE on the trailing rope dims, output RoPE undone, per-head
    sinks, scale head_dim^-0.5, grouped output projection): the V4 engine model (transformers' DeepseekV4) minus the
    per-head q norm, which V4.1 drops (TensorRT-LLM csa2/README.md "omission of projected-Q head normalization").
  * compressor: ratio 1 = one projected, RMS-normed, rotated entry per position, no gate; ratio 2 = per-channel
    softmax over the two tokens of a window of the gate projection, weighted sum of the kv projection, fp32, no
    APE (csa2/README.md; DeepInfer v4_modules/compress.py). The entry's RoPE position is its window's first
    token (as in V4); that choice is this oracle's reading, not a quoted fact.
  * indexer: K = linear + RMSNorm of the main compressor's *pre-RoPE* normed entry, then RoPE (DeepInfer
    compress.py KProject); Q = the tail of wq_b (fused); score = sum_h w_h relu(q_h . k) * Di^-0.5 with
    w = weights_proj(x) * Hi^-0.5 (V4 engine); top index_topk over causally visible entries, equal scores
    taken in entry order (ReLU makes exact ties common; the sources do not state a rule, this is ours).
  * candidate two-level top-k: blocks of candidate_block_size entries scored by the block max of the candidate
    source's (visible) index scores, the query's newest block always kept, the top candidate_topk_blocks blocks
    published; later index sources take their top-k inside them (cross_layer.py, csa2/README.md "block maxima,
    pinned newest block, Top-K blocks expanded to positions").
  * mHC: V4's Sinkhorn hyper-connections; shifted (hc_shifted): each sublayer's input applies the pre-mix the
    previous sublayer computed (one-hot on stream 0 first), mixes from the current streams, the model ends with
    the last pre-mix, no head (DeepInfer v4_modules/hc.py HCLayerMixin._hc_pre, deepseek.py). Mixer RMS uses
    rms_norm_eps, pre/Sinkhorn use hc_eps.
  * Engram: compressed vocabulary by NFKC, NFD, combining marks dropped, lowercase, space/tab/CR/LF runs
    collapsed, Unicode white space trimmed unless the text is one space (the `tokenizers` normalizer sequence
    TensorRT-LLM's CompressedTokenizer builds; test/unit/test_deepseek_v41_engram.py checks the equivalence);
    per-layer odd multipliers from numpy default_rng(10007 * layer_id); n-gram mix = XOR of token * multiplier
    over the n most recent compressed ids (pad before the start); per (n, head) a distinct prime table size found
    upwards from engram_vocab_size - 1, primes unique across layers; rows concatenated -> wkv -> hc_mult keys then
    one value; gate = sigmoid(signed sqrt(max(|dot|, 1e-6))) of the RMS-normed stream and key (fp32); streams +=
    gate * value, before the layer's attention pre-mix (TensorRT-LLM modules/engram/{engram,functional}.py,
    configs/deepseek_v41.py notes; DeepInfer v4_modules/engram*.py).
  * YOCO: layers >= n_prefill_layer take their KV (sliding keys and compressor input) from the first consumer's
    attention-norm output (DeepInfer v4_modules/yoco.py, decoder_layer.py); n_prefill_layer, else the first
    ratio-1 layer (shared/V41.md).
  * MoE: logits / gate_temp, sqrt(softplus) scores, top-k of scores + bias, weights renormalised (1e-20) times
    routed_scaling_factor, SwiGLU with gate <= limit and |up| <= limit, one shared expert.

Cross-checks against public code run on CPU (same tensors): the Engram gate equals the CPU branch of TensorRT-LLM's
modules/engram/functional.py engram_gate to 2e-6; the prime tables of the released config hold its declared
engram_num_embeddings (384006168, 384016682).
"""
from __future__ import annotations

import math
import re
import unicodedata

import numpy as np
import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- small pieces

def rms(x, weight, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def yarn(dim, base, factor, orig, beta_fast, beta_slow):
    """Inverse frequencies (dim/2,) and the cos/sin factor of YaRN (the formulas of the YaRN paper as written in
    transformers' rope utilities)."""
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    freq = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # extrapolation share
    inv = (1 / (factor * freq)) * (1 - keep) + (1 / freq) * keep
    return inv, (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0


def rotate(x, pos, inv, scale, sign=1.0):
    """x (..., C) rotated on its trailing 2*len(inv) channels, adjacent pairs, at integer position pos."""
    r = 2 * inv.shape[0]
    out = x.clone().float()
    ang = pos * inv
    c, s = torch.cos(ang) * scale, torch.sin(ang) * scale * sign
    a, b = out[..., -r::2].clone(), out[..., -r + 1::2].clone()
    out[..., -r::2] = a * c - b * s
    out[..., -r + 1::2] = a * s + b * c
    return out


def swiglu(x, w1, w2, w3, limit):
    g, u = x @ w1.float().T, x @ w3.float().T
    return (F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)) @ w2.float().T


# ---------------------------------------------------------------- Engram hashing

WHITE_SPACE = ("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
               "\u2028\u2029\u202f\u205f\u3000")  # the Unicode White_Space property

def compressed_vocabulary(token_texts, raw_tokens):
    """old id -> compressed id, and the number of compressed ids."""
    key_to_new, table = {}, []
    for tid, text in enumerate(token_texts):
        if "\ufffd" in text:
            key = raw_tokens[tid]  # a partial UTF-8 sequence: keyed by its vocabulary string
        else:
            norm = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
            norm = "".join(ch for ch in norm if unicodedata.category(ch)[0] != "M").lower()
            norm = re.sub(r"[ \t\r\n]+", " ", norm)
            norm = " " if norm == " " else norm.strip(WHITE_SPACE)
            key = norm if norm else text
        table.append(key_to_new.setdefault(key, len(key_to_new)))
    return table, len(key_to_new)


def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_primes(layer_ids, max_ngram, n_heads, vocab_size):
    seen, out = set(), {}
    for layer in layer_ids:
        sizes = []
        for _n in range(2, max_ngram + 1):
            p = vocab_size - 1
            for _h in range(n_heads):
                p += 1
                while not is_prime(p) or p in seen:
                    p += 1
                seen.add(p)
                sizes.append(p)
        out[layer] = sizes
    return out


def engram_rows(compressed_ids, layer, sizes, max_ngram, n_heads, num_compressed, pad):
    """(T, (max_ngram-1)*n_heads) rows of the layer's table (head sections laid end to end)."""
    half = max(1, (np.iinfo(np.int64).max // num_compressed) // 2)
    mult = [int(m) * 2 + 1 for m in np.random.default_rng(10007 * layer).integers(0, half, size=max_ngram)]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    rows = []
    for t in range(len(compressed_ids)):
        hist = [compressed_ids[t - k] if t - k >= 0 else pad for k in range(max_ngram)]
        row = []
        for n in range(2, max_ngram + 1):
            mix = 0
            for k in range(n):
                mix ^= hist[k] * mult[k]
            for h in range(n_heads):
                j = (n - 2) * n_heads + h
                row.append(offsets[j] + mix % sizes[j])
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------- the model

class V41Reference:
    def __init__(self, cfg: dict, weights: dict, token_texts=None, prefix="model.", raw_tokens=None):
        self.c, self.w, self.p = cfg, {k: v.float() for k, v in weights.items()}, prefix
        c = cfg
        n = c["num_hidden_layers"]
        self.ratios = list(c["compress_ratios"])[:n]
        self.kv_src, self.idx_src = set(c.get("kv_source_layer_ids", [])), set(c.get("index_source_layer_ids", []))
        self.cand_src = c.get("candidate_source_layer_id")
        first_ratio_1 = next((i for i, r in enumerate(self.ratios) if r == 1), n)
        self.n_prefill = c["n_prefill_layer"] if c.get("n_prefill_layer") is not None else first_ratio_1
        self.engram_ids = list(c.get("engram_layer_ids", []))
        rd = c["qk_rope_head_dim"]
        self.main_inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        y = c["rope_scaling"]
        self.comp_inv, self.comp_scale = yarn(rd, c["compress_rope_theta"], y["factor"],
                                              y["original_max_position_embeddings"], y["beta_fast"], y["beta_slow"])
        if self.engram_ids:
            assert token_texts is not None and raw_tokens is not None, "Engram needs each token's text and raw string"
            self.lookup, self.num_compressed = compressed_vocabulary(token_texts, raw_tokens)
            self.primes = engram_primes(self.engram_ids, c["engram_max_ngram_size"], c["engram_n_heads"],
                                        c["engram_vocab_size"])

    def W(self, name):
        return self.w[self.p + name]

    # ---- sublayers ----

    def hc_mixes(self, streams, pre_name):
        c, nh = self.c, self.c["hc_mult"]
        flat = rms(streams.reshape(streams.shape[0], -1), None, c["rms_norm_eps"])
        mix = flat @ self.W(pre_name + "_fn").T
        base, scale = self.W(pre_name + "_base"), self.W(pre_name + "_scale")
        eps = c["hc_eps"]
        pre = torch.sigmoid(mix[:, :nh] * scale[0] + base[:nh]) + eps
        post = 2 * torch.sigmoid(mix[:, nh:2 * nh] * scale[1] + base[nh:2 * nh])
        comb = torch.softmax(mix[:, 2 * nh:].view(-1, nh, nh) * scale[2] + base[2 * nh:].view(nh, nh), -1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb

    def engram(self, i, streams, ids):
        c, L = self.c, f"layers.{i}.engram."
        comp = [self.lookup[t] for t in ids]
        rows = engram_rows(comp, i, self.primes[i], c["engram_max_ngram_size"], c["engram_n_heads"],
                           self.num_compressed, self.lookup[c["engram_pad_token_id"]])
        emb = self.W(L + "embed.weight")[rows].flatten(1)
        kv = emb @ self.W(L + "wkv.weight").T
        nh, d = c["hc_mult"], c["hidden_size"]
        keys, value = kv[:, :nh * d].view(-1, nh, d), kv[:, nh * d:]
        eps = c["rms_norm_eps"]
        q = rms(streams, self.W(L + "hidden_norm.weight"), eps)
        k = rms(keys, self.W(L + "embed_norm.weight"), eps)
        dot = (q * k).sum(-1) / math.sqrt(d)
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())
        return streams + gate[..., None] * value[:, None, :]

    def compress(self, i, x):
        """Entries (E, Dh) post-RoPE, their pre-RoPE normed form, and their RoPE positions."""
        A, eps, r = f"layers.{i}.attn.compressor.", self.c["rms_norm_eps"], self.ratios[i]
        kv = x @ self.W(A + "wkv.weight").T
        if r == 1:
            pooled, pos = kv, list(range(x.shape[0]))
        else:
            gate = x @ self.W(A + "wgate.weight").T
            num = x.shape[0] // 2
            pooled = torch.stack([(torch.softmax(gate[2 * w:2 * w + 2], 0) * kv[2 * w:2 * w + 2]).sum(0)
                                  for w in range(num)]) if num else kv[:0]
            pos = [2 * w for w in range(num)]
        pre = rms(pooled, self.W(A + "norm.weight"), eps)
        post = torch.stack([rotate(pre[e], p, self.comp_inv, self.comp_scale) for e, p in enumerate(pos)]) \
            if pos else pre
        ik = rms(pre @ self.W(f"layers.{i}.attn.indexer.wk.weight").T, self.W(f"layers.{i}.attn.indexer.k_norm.weight"), eps)
        ik = torch.stack([rotate(ik[e], p, self.comp_inv, self.comp_scale) for e, p in enumerate(pos)]) if pos else ik
        return post, ik

    def visible(self, r, t, num_entries):
        return [e for e in range(num_entries) if (e <= t if r == 1 else e < (t + 1) // 2)]

    def attention(self, i, x, kv_x, st):
        c, A = self.c, f"layers.{i}.attn."
        T, H, Dh, eps, r = x.shape[0], c["num_attention_heads"], c["head_dim"], c["rms_norm_eps"], self.ratios[i]
        Hi, Di, W = c["index_n_heads"], c["index_head_dim"], c["sliding_window"]
        inv, sc = (self.comp_inv, self.comp_scale) if r else (self.main_inv, 1.0)
        qr = rms(x @ self.W(A + "wq_a.weight").T, self.W(A + "q_norm.weight"), eps)
        qall = qr @ self.W(A + "wq_b.weight").T
        q = qall[:, :H * Dh].view(T, H, Dh)
        swa = rms(kv_x @ self.W(A + "wkv.weight").T, self.W(A + "norm.weight"), eps)
        swa = torch.stack([rotate(swa[t], t, inv, sc) for t in range(T)])
        if i in self.kv_src:
            st["entries"][i], st["index_keys"][i] = self.compress(i, kv_x)
        picks = [[] for _ in range(T)]
        if r:
            src = max(s for s in self.kv_src if s <= i)
            isrc = max(s for s in self.idx_src if s <= i)
            entries = st["entries"][src]
            if i == isrc:
                iq = qall[:, H * Dh:].view(T, Hi, Di)
                wts = (x @ self.W(A + "indexer.weights_proj.weight").T) * Hi ** -0.5
                iq = torch.stack([rotate(iq[t], t, self.comp_inv, self.comp_scale) for t in range(T)])
                # all[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) / sqrt(Di)
                all_scores = (torch.einsum("thd,ed->the", iq, st["index_keys"][src]).relu()
                              * wts[:, :, None]).sum(1) * Di ** -0.5
                for t in range(T):
                    vis = self.visible(r, t, entries.shape[0])
                    score = {e: float(all_scores[t, e]) for e in vis}
                    if self.cand_src is not None and i == self.cand_src:
                        st["candidates"].setdefault(t, self.candidate_set(score, vis))
                    if self.cand_src is not None and i > self.cand_src and self.ratios[self.cand_src] == r:
                        score = {e: s for e, s in score.items() if e in st["candidates"][t]}
                    ranked = sorted(score, key=lambda e: (-score[e], e))  # ties: the earlier entry
                    picks[t] = sorted(ranked[:c["index_topk"]])
                st["picks"][i] = picks
            else:
                picks = st["picks"][isrc]
        # keys: this layer's sliding keys of every position, then the source's entries; allow[t] marks the ones
        # query t sees (its window of W positions and its picked entries)
        keys = torch.cat([swa, entries]) if r else swa
        allow = torch.zeros(T, keys.shape[0], dtype=torch.bool)
        for t in range(T):
            allow[t, max(0, t - W + 1):t + 1] = True
            for e in picks[t]:
                allow[t, T + e] = True
        qrot = torch.stack([rotate(q[t], t, inv, sc) for t in range(T)])
        logits = torch.einsum("thd,kd->thk", qrot, keys) * Dh ** -0.5
        logits = logits.masked_fill(~allow[:, None, :], -math.inf)
        sink = self.W(A + "attn_sink")[None, :, None].expand(T, H, 1)
        p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        mixed = torch.einsum("thk,kd->thd", p, keys)
        out = torch.stack([rotate(mixed[t], t, inv, sc, sign=-1.0) for t in range(T)])
        g = c["o_groups"]
        wo_a = self.W(A + "wo_a.weight").view(g, c["o_lora_rank"], -1)
        grouped = torch.einsum("tgi,gri->tgr", out.reshape(T, g, -1), wo_a).reshape(T, -1)
        return grouped @ self.W(A + "wo_b.weight").T

    def candidate_set(self, score, vis):
        c = self.c
        B = c["candidate_block_size"]
        if not vis:
            return set()
        blocks = {}
        for e in vis:
            blocks[e // B] = max(blocks.get(e // B, -math.inf), score[e])
        newest = max(vis) // B
        others = sorted((b for b in blocks if b != newest), key=lambda b: (-blocks[b], b))
        keep = {newest, *others[:c["candidate_topk_blocks"] - 1]}
        return {e for e in vis if e // B in keep}

    def moe(self, i, x, prefix=None, top_k=None):
        c, L = self.c, f"layers.{i}.ffn." if prefix is None else prefix
        logits = x @ self.W(L + "gate.weight").T / c.get("gate_temp", 1.0)
        scores = torch.sqrt(F.softplus(logits))
        ids = (scores + self.W(L + "gate.bias")).topk(top_k or c["num_experts_per_tok"], dim=-1).indices
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * c["routed_scaling_factor"]
        lim = c["swiglu_limit"]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                E = L + f"experts.{e}."
                out[t] += wts[t, k] * swiglu(x[t:t + 1], self.W(E + "w1.weight"), self.W(E + "w2.weight"),
                                             self.W(E + "w3.weight"), lim)[0]
        S = L + "shared_experts."
        return out + swiglu(x, self.W(S + "w1.weight"), self.W(S + "w2.weight"), self.W(S + "w3.weight"), lim)

    # ---- whole forward ----

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """(T, vocab) fp32 logits of every position."""
        return self.forward(ids)[0]

    @torch.no_grad()
    def forward(self, ids: list[int]):
        """(T, vocab) logits and (T, targets * hidden) DSpark features: the mean over the streams of each
        dspark_target_layer_ids layer's input (after its Engram), concatenated in config order."""
        c, nh, eps = self.c, self.c["hc_mult"], self.c["rms_norm_eps"]
        targets, captured = list(c.get("dspark_target_layer_ids") or []), {}
        shifted = c.get("hc_shifted", True)
        x = self.W("embed_tokens.weight")[torch.tensor(ids)]
        streams = x[:, None, :].repeat(1, nh, 1)
        carried = torch.zeros(len(ids), nh)
        carried[:, 0] = 1.0
        st = {"entries": {}, "index_keys": {}, "picks": {}, "candidates": {}, "shared": None}
        for i in range(c["num_hidden_layers"]):
            L = f"layers.{i}."
            if i in self.engram_ids:
                streams = self.engram(i, streams, ids)
            if i in targets:
                captured[i] = streams.mean(1)
            for kind in ("attn", "ffn"):
                pre, post, comb = self.hc_mixes(streams, L + f"hc_{kind}")
                use = carried if shifted else pre
                h = rms((use[..., None] * streams).sum(1), self.W(L + f"{kind}_norm.weight"), eps)
                if kind == "attn":
                    if i == self.n_prefill:
                        st["shared"] = h
                    y = self.attention(i, h, st["shared"] if i >= self.n_prefill else h, st)
                else:
                    y = self.moe(i, h)
                streams = post[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, streams)
                carried = pre
        if shifted:
            h = (carried[..., None] * streams).sum(1)
        else:
            flat = rms(streams.reshape(len(ids), -1), None, eps)
            w = torch.sigmoid(flat @ self.W("hc_head.hc_fn").T * self.W("hc_head.hc_scale")[0]
                              + self.W("hc_head.hc_base")) + c["hc_eps"]
            h = (w[..., None] * streams).sum(1)
        features = torch.cat([captured[i] for i in targets], dim=-1) if targets else None
        return rms(h, self.W("norm.weight"), eps) @ self.w["head.weight"].T, features


# ---------------------------------------------------------------- the DSpark drafter

class DSparkReference:
    """The DSpark block drafter's plain forward over V41Reference (sources: speculative/dspark_model.py's
    docstring; the release's DSparkBlock / DSparkAttention as ported in public code, TensorRT-LLM
    modeling_dspark{,_v41}.py). One request, greedy rows, every loop in the open."""

    def __init__(self, target: V41Reference):
        self.t, c = target, target.c
        self.c, self.num_stages, self.B = c, c["num_nextn_predict_layers"], c["dspark_block_size"]
        self.noise = c.get("dspark_noise_token_id", c["vocab_size"] - 1)

    def M(self, name):
        w = self.t.w
        return w["mtp." + name] if "mtp." + name in w else w["model.mtp." + name]

    def attention(self, s, x, pos0, ctx_x, ctx_pos):
        """Block rows x (B, D) at pos0 .. pos0+B-1 over context inputs ctx_x (L, D) at ctx_pos and the block."""
        c, A, t = self.c, f"{s}.attn.", self.t
        H, Dh, eps, inv = c["num_attention_heads"], c["head_dim"], c["rms_norm_eps"], t.main_inv
        B = x.shape[0]
        q = (rms(x @ self.M(A + "wq_a.weight").T, self.M(A + "q_norm.weight"), eps) @ self.M(A + "wq_b.weight").T)
        q = torch.stack([rotate(q[j].view(H, Dh), pos0 + j, inv, 1.0) for j in range(B)])
        def key(v, p):
            return rotate(rms(v @ self.M(A + "wkv.weight").T, self.M(A + "kv_norm.weight"), eps), p, inv, 1.0)
        keys = torch.stack([key(ctx_x[j], ctx_pos[j]) for j in range(len(ctx_pos))]
                           + [key(x[j], pos0 + j) for j in range(B)])
        logits = torch.einsum("bhd,kd->bhk", q, keys) * Dh ** -0.5  # no mask: context and the whole block
        sink = self.M(A + "attn_sink")[None, :, None].expand(B, H, 1)
        p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        mixed = torch.einsum("bhk,kd->bhd", p, keys)
        out = torch.stack([rotate(mixed[j], pos0 + j, inv, 1.0, sign=-1.0) for j in range(B)])
        g = c["o_groups"]
        wo_a = self.M(A + "wo_a.weight").view(g, c["o_lora_rank"], -1)
        return torch.einsum("bgi,gri->bgr", out.reshape(B, g, -1), wo_a).reshape(B, -1) @ self.M(A + "wo_b.weight").T

    @torch.no_grad()
    def draft(self, ids: list[int], bonus: int):
        """Greedy block after `ids` (target features of every position) and the sampled `bonus`: (tokens (B,),
        corrected logits (B, V), survival probabilities sigmoid(confidence) (B,))."""
        c, t, eps, nh = self.c, self.t, self.c["rms_norm_eps"], self.c["hc_mult"]
        features = t.forward(ids)[1]
        last, W = len(ids) - 1, c["sliding_window"]
        ctx_pos = list(range(max(0, last - W + 1), last + 1))
        main_x = rms(features[ctx_pos] @ self.M("0.main_proj.weight").T, self.M("0.main_norm.weight"), eps)
        block = [bonus] + [self.noise] * (self.B - 1)
        streams = t.W("embed_tokens.weight")[torch.tensor(block)][:, None, :].repeat(1, nh, 1)
        carried = torch.zeros(self.B, nh)
        carried[:, 0] = 1.0
        k = c.get("dspark_num_experts_per_tok") or c["num_experts_per_tok"]
        for s in range(self.num_stages):
            for kind in ("attn", "ffn"):
                pre, post, comb = self.hc(streams, s, kind)
                h = rms((carried[..., None] * streams).sum(1), self.M(f"{s}.{kind}_norm.weight"), eps)
                y = self.attention(s, h, last + 1, main_x, ctx_pos) if kind == "attn" else self.moe(s, h, k)
                streams = post[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, streams)
                carried = pre
        h = (carried[..., None] * streams).sum(1)
        L = f"{self.num_stages - 1}."
        base = rms(h, self.M(L + "norm.weight"), eps) @ t.w["head.weight"].T
        tokens, corrected, survival, prev = [], [], [], bonus
        for j in range(self.B):
            e = self.M(L + "markov_head.embed.weight")[prev]
            z = base[j] + self.M(L + "markov_head.head.weight") @ e
            conf = torch.cat([h[j], e]) @ self.M(L + "confidence_head.proj.weight")[0]
            prev = int(z.argmax())
            tokens.append(prev)
            corrected.append(z)
            survival.append(torch.sigmoid(conf))
        return tokens, torch.stack(corrected), torch.stack(survival)

    def _as_draft(self):
        """The target's sublayer helpers read names below self.t.p: point it at the draft stages for a call."""
        return V41Reference.__new__(V41Reference), "mtp." if "mtp.0.main_norm.weight" in self.t.w else "model.mtp."

    def hc(self, streams, s, kind):
        view, prefix = self._as_draft()
        view.c, view.w, view.p = self.c, self.t.w, prefix
        return view.hc_mixes(streams, f"{s}.hc_{kind}")

    def moe(self, s, x, k):
        view, prefix = self._as_draft()
        view.c, view.w, view.p = self.c, self.t.w, prefix
        return view.moe(None, x, prefix=f"{s}.ffn.", top_k=k)
