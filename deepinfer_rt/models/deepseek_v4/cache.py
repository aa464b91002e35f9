"""DeepSeek-V4's compact KV pool: long-lived compressed entries in the main pages, recent per-token state in a
second, smaller page pool reached through a per-main-page indirection.

What a layer keeps (columns in models/deepseek_v4/common.py, PoolColumns.compact):

    entries[layer]  (num_slots // min(m, page_size), D [+ Di])   compressed entry (and indexer entry) of each
                    window, in row slot((w+1)m - 1) // min(m, page_size) of its last token: one row per window
                    when page_size % m == 0, one row per page (the page of the window's last token) when
                    m % page_size == 0.
    recent[layer]   (num_recent_pages * page_size, ...)          sliding key and the compressor's raw inputs of
                    a token, at recent_of[page] * page_size + offset for the token's main page.

A step of a sequence that computes positions start .. kv_len - 1 reads recent state of positions >=
start - recent_tokens only (the sliding window, and the windows the compressor completes: for CSA the
previous window too), so the recent page of a main page whose tokens all lie before that can go. Recent pages
are kept (pinned) where a later sequence may resume: pages within recent_tokens before every multiple of
checkpoint_tokens, before the end of every prefill step (a prompt's end, a chunk boundary, the point n > 1
siblings start from) and before every prefix-cache hit point. Only pinned pages are ever read by a sequence
other than the one that wrote them: hits are cut back (restorable) to positions whose recent state exists,
and then pinned (keep). Pinned recent pages go when their main page is freed, or, if the recent pool runs
short, when no sequence of the step needs them (the cache then cuts later hits back further).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_kernels.dispatch import pdl_supported
from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.env import get_env
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.models.deepseek_v4.common import Fp4Rows, Fp8Rows, LayerKV, PoolColumns, fp4_row_bytes

_MIN_RECENT_TOKENS = 16384
"""The recent pool holds at least this many tokens (or as many as the main pool): a step's new tokens all need
recent rows at once, and a small pool cannot lend a fraction."""
_FALLBACK_LOOKBACK = 64
"""Tokens a release scan looks back when the sequence's previous step is not known (more than any draft)."""
KV_DTYPES = ("auto", "fp8_e4m3", "fp4_e2m1")


@dataclass(frozen=True)
class V4KVLayout(KVLayout):
    """KVLayout of the compact pool; layer_dims are the recent row widths."""

    ratios: tuple[int, ...] = ()
    """Per layer: tokens per compressed entry, 0 for sliding-window layers."""
    entry_dims: tuple[int, ...] = ()
    """Per layer: width of an entry row (0 for sliding-window layers)."""
    recent_tokens: int = 0
    """R: positions before a step's first new token whose recent state the step reads."""
    checkpoint_tokens: int = 16384
    recent_fraction: float = 0.05
    kv_dtype: str = "auto"
    """'auto' (the model dtype), 'fp8_e4m3': sliding keys, entries and indexer entries as float8 e4m3 with an
    fp32 scale per row, or 'fp4_e2m1': sliding keys as in 'fp8_e4m3', entries and indexer entries as MXFP4
    (e2m1 + an e8m0 scale per 32 values, common.py Fp4Rows); the compressor inputs stay in the model dtype."""
    swa_dim: int = 0
    """Width of the sliding key (the first columns of every recent row in 'auto')."""
    idx_entry_dims: tuple[int, ...] = ()
    """Per layer: the indexer entry's share of entry_dims."""
    release_margin: int = 64
    """Tokens a sequence keeps beyond R before releasing (a speculative rewind, and hits a little before the end
    of a finished sequence resume exactly)."""
    supports_fp8: bool = True
    """False where the model's layers cannot read FP8 rows."""
    supports_fp4: bool = False
    """True where the model's layers read MXFP4 entries and indexer entries (kv_dtype 'fp4_e2m1')."""
    num_token_layers: int = 0
    """Trailing layers added by with_token_layer: per-token state of their owner only, no sliding key (their
    rows stay in the model dtype under 'fp8_e4m3')."""

    @property
    def pool_class(self) -> type[KVPool]:
        return V4Pool

    @property
    def is_fp8(self) -> bool:
        """Whether the sliding keys are FP8 rows (kv_dtype 'fp8_e4m3' or 'fp4_e2m1')."""
        return self.kv_dtype != "auto"

    @property
    def is_fp4(self) -> bool:
        """Whether the entries and indexer entries are MXFP4 rows (kv_dtype 'fp4_e2m1')."""
        return self.kv_dtype == "fp4_e2m1"

    def with_kv_dtype(self, kv_dtype: str) -> "V4KVLayout":
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES} for DeepSeek-V4, got {kv_dtype!r}")
        if kv_dtype != "auto" and not self.supports_fp8:
            raise ValueError(f"kv_cache_dtype={kv_dtype!r} is not supported for this model's KV pool yet")
        if kv_dtype == "fp4_e2m1":
            if not self.supports_fp4:
                raise ValueError("kv_cache_dtype='fp4_e2m1' (MXFP4 entries) is not supported for this model's KV "
                                 "pool; use 'fp8_e4m3'")
            widths = {w - di for w, di in zip(self.entry_dims, self.idx_entry_dims) if w} | set(self.idx_entry_dims)
            if any(w % 16 for w in widths):
                raise ValueError(f"kv_cache_dtype='fp4_e2m1' needs entry and index-key widths that are multiples of "
                                 f"16, got {sorted(widths)}")
        return dataclasses.replace(self, kv_dtype=kv_dtype)

    def with_token_layer(self, width: int, lookback: int) -> "V4KVLayout":
        # The layer's rows are recent state (one more layer that owns no entries); the pool keeps at least the
        # lookback's positions.
        dims = self.layer_dims or (self.k_shape[1],) * self.num_layers
        return dataclasses.replace(
            self, num_layers=self.num_layers + 1, k_shape=(1, max(self.k_shape[1], width)), layer_dims=dims + (width,),
            ratios=self.ratios + (0,), entry_dims=self.entry_dims + (0,), idx_entry_dims=self.idx_entry_dims + (0,),
            recent_tokens=max(self.recent_tokens, lookback), num_token_layers=self.num_token_layers + 1)

    @property
    def num_swa_layers(self) -> int:
        """Layers that keep a sliding key (the model's; not the token layers)."""
        return self.num_layers - self.num_token_layers

    @property
    def recent_row_dims(self) -> tuple[int, ...]:
        """Per layer: width of the `recent` tensor's rows (without the sliding key when it is FP8)."""
        if not self.is_fp8:
            return self.layer_dims
        n = self.num_swa_layers
        return tuple(w - self.swa_dim for w in self.layer_dims[:n]) + self.layer_dims[n:]

    def entry_row_bytes(self, layer: int, dtype: torch.dtype) -> tuple[int, int]:
        """(entry, indexer entry) bytes of one entry row of `layer` (0, 0 on layers without entries): the model
        dtype; FP8 a byte per value and a 4-byte scale; MXFP4 half a byte per value and a scale byte per 32 values
        (per 16 where 32 does not divide the width: common.py fp4_block)."""
        w, di = self.entry_dims[layer], self.idx_entry_dims[layer]
        if not self.ratios[layer]:
            return 0, 0
        if self.is_fp4:
            return fp4_row_bytes(w - di), fp4_row_bytes(di) if di else 0
        if self.is_fp8:
            return w - di + 4, di + 4 if di else 0
        size = torch.empty((), dtype=dtype).element_size()
        return (w - di) * size, di * size

    def long_lived_bytes_per_token(self, dtype: torch.dtype) -> float:
        """Entries per token of context: an entry row (entry_row_bytes) per m tokens on each compressed layer."""
        if self.is_fp4:
            return sum(sum(self.entry_row_bytes(i, dtype)) / m for i, m in enumerate(self.ratios) if m)
        if self.is_fp8:
            return sum((w + 4 * (1 + (di > 0))) / m
                       for w, di, m in zip(self.entry_dims, self.idx_entry_dims, self.ratios) if m)
        size = torch.empty((), dtype=dtype).element_size()
        return sum(w / m for w, m in zip(self.entry_dims, self.ratios) if m) * size

    def recent_bytes_per_token(self, dtype: torch.dtype) -> int:
        """One token's recent row over all layers (held for ~recent_tokens tokens per sequence, plus pins)."""
        size = torch.empty((), dtype=dtype).element_size()
        fp8_swa = (self.swa_dim + 4) * self.num_swa_layers if self.is_fp8 else 0
        return sum(self.recent_row_dims) * size + fp8_swa

    def window_bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return self.recent_tokens * self.recent_bytes_per_token(dtype)

    def bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str | None = None) -> int:
        """For pool sizing: the entries plus the recent pool's share per main-pool token (the KV dtype is the
        layout's own, set by with_kv_dtype; `kv_cache_dtype` is accepted for the base signature)."""
        return math.ceil(self.long_lived_bytes_per_token(dtype) + self.recent_fraction * self.recent_bytes_per_token(dtype))


class V4Pool(KVPool):
    def __init__(self, layout: V4KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str | None = None):
        if kv_cache_dtype not in (None, layout.kv_dtype):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the layout's ({layout.kv_dtype!r}): "
                             "build the layout with with_kv_dtype")
        for m in set(layout.ratios) - {0}:
            if page_size % m and m % page_size:
                raise ValueError(f"the compact DeepSeek-V4 pool needs page_size ({page_size}) to divide or be a "
                                 f"multiple of every compression ratio (got ratio {m})")
        # The generic pool's FP8 attributes describe plain K/V rows read by the attention backends; this pool's
        # FP8 rows (layout.is_fp8) are read by the V4 layers through LayerKV only.
        self._init_pages(layout, num_pages, page_size, dtype, layout.kv_dtype, is_fp8=False)
        self.allocator.on_free = self._drop_main
        self.allocator.prefix_guard = self
        frac_pages = math.ceil(layout.recent_fraction * num_pages)
        self.num_recent_pages = min(num_pages, max(frac_pages, math.ceil(_MIN_RECENT_TOKENS / page_size)))
        # One more row than the pages hold in every buffer: the padding row, where the padding rows of a
        # fixed-size (CUDA-graph) decode step write (deepseek_v4/graph_batch.py); no step reads it.
        rows = self.num_recent_pages * page_size
        self.pad_recent_slot = rows
        self.recent = [torch.zeros(rows + 1, w, dtype=dtype, device=device) for w in layout.recent_row_dims]
        self.k = self.v = [r.view(rows + 1, 1, r.shape[1]) for r in self.recent]  # what generic code reads
        entry_rows = [self.num_slots // self.entry_divisor(m) + 1 if m else 0 for m in layout.ratios]
        fp8 = layout.is_fp8
        self.entries = [torch.zeros(n, 0 if fp8 else w, dtype=dtype, device=device)
                        for n, w in zip(entry_rows, layout.entry_dims)]
        pdl = get_env().gpu_pdl and pdl_supported(device)  # the FP8 row writes' launches
        self.fp8_swa = [Fp8Rows.zeros(rows + 1, layout.swa_dim, device, pdl)
                        if fp8 and i < layout.num_swa_layers else None for i in range(layout.num_layers)]
        fp8_entries, fp4 = fp8 and not layout.is_fp4, layout.is_fp4
        self.fp8_entry = [Fp8Rows.zeros(n, w - di, device, pdl) if fp8_entries and m else None
                          for n, w, di, m in zip(entry_rows, layout.entry_dims, layout.idx_entry_dims, layout.ratios)]
        self.fp8_idx_entry = [Fp8Rows.zeros(n, di, device, pdl) if fp8_entries and di else None
                              for n, di in zip(entry_rows, layout.idx_entry_dims)]
        self.fp4_entry = [Fp4Rows.zeros(n, w - di, device) if fp4 and m else None
                          for n, w, di, m in zip(entry_rows, layout.entry_dims, layout.idx_entry_dims, layout.ratios)]
        self.fp4_idx_entry = [Fp4Rows.zeros(n, di, device) if fp4 and di else None
                              for n, di in zip(entry_rows, layout.idx_entry_dims)]
        self._recent_of = np.full(num_pages, -1, dtype=np.int64)
        self._pinned = np.zeros(num_pages, dtype=bool)
        self._recent_free = list(range(self.num_recent_pages - 1, -1, -1))
        self._recent_owner = np.full(self.num_recent_pages, -1, dtype=np.int64)
        self.recent_of_t = torch.full((num_pages,), -1, dtype=torch.long, device=device)
        """Device copy of the indirection, brought up to date in `prepare`."""
        self._dirty: set[int] = set()
        self._last_start: dict[int, int] = {}
        """Main page of a sequence's last computed position -> the start of the step that computed it."""
        self.num_recent_reclaimed = 0
        """Pinned recent pages given up because the recent pool ran short."""

    def layer_kv(self, layer: int, cols: dict[bool, PoolColumns]) -> LayerKV:
        """The layer's buffers; `cols` its compact columns without (False) and with (True) FP8 storage."""
        return LayerKV(self.recent[layer], self.entries[layer], cols[self.layout.is_fp8], self.fp8_swa[layer],
                       self.fp8_entry[layer], self.fp8_idx_entry[layer], self.fp4_entry[layer],
                       self.fp4_idx_entry[layer])

    def token_rows(self, layer: int, slots: torch.Tensor, valid: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """KVPool.token_rows: the layer's recent rows, reached through the page indirection (so only positions
        whose recent state is still held, RuntimeError otherwise)."""
        ps = self.page_size
        recent = self.recent_of_t[slots // ps]
        held = recent >= 0 if valid is None else (recent >= 0) | ~valid
        if not bool(held.all()):
            raise RuntimeError("token_rows: the recent state of a requested position was released")
        rows = recent * ps + slots % ps
        return self.recent[layer], rows if valid is None else torch.where(valid, rows, torch.zeros_like(rows))

    def _copy_recent_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for buf, fp8 in zip(self.recent, self.fp8_swa):
            buf[dst] = buf[src]
            if fp8 is not None:
                fp8.values[dst], fp8.scales[dst] = fp8.values[src], fp8.scales[src]

    # ---- geometry ----

    def entry_divisor(self, ratio: int) -> int:
        return min(ratio, self.page_size)

    def pad_entry_row(self, ratio: int) -> int:
        """The padding row of the entry buffers of layers of this ratio (see __init__)."""
        return self.num_slots // self.entry_divisor(ratio)

    @property
    def num_recent_in_use(self) -> int:
        return self.num_recent_pages - len(self._recent_free)

    def has_recent(self, page: int) -> bool:
        return bool(self._recent_of[page] >= 0)

    def is_pinned(self, page: int) -> bool:
        return bool(self._pinned[page])

    # ---- prefix guard (cache/radix_cache.py) ----

    def restorable(self, pages: list[int], num_tokens: int) -> int:
        """num_tokens itself when the recent state of the R positions before it exists, else the longest
        page-aligned length below it where it does."""
        ps, r = self.page_size, self.layout.recent_tokens
        has = self._recent_of[np.asarray(pages[: math.ceil(num_tokens / ps)], dtype=np.int64)] >= 0
        bad = np.concatenate([[0], np.cumsum(~has)])
        if bad[len(has)] - bad[max(0, num_tokens - r) // ps] == 0:
            return num_tokens
        k = np.arange(num_tokens // ps + 1)
        ok = bad[k] - bad[np.maximum(0, k * ps - r) // ps] == 0
        return int(k[ok].max()) * ps

    def keep(self, pages: list[int], num_tokens: int) -> None:
        ps = self.page_size
        self._pin(pages[max(0, num_tokens - self.layout.recent_tokens) // ps : math.ceil(num_tokens / ps)])

    def keep_prompt(self, pages: list[int], prompt_len: int) -> None:
        # Siblings resume at prompt_len - 1, a resubmitted prompt at its last whole page before that.
        ps, r = self.page_size, self.layout.recent_tokens
        first = max(0, (prompt_len - 1) // ps * ps - r) // ps
        self._pin(pages[first : math.ceil(prompt_len / ps)])

    def adopt(self, cached: list[int], own: list[int]) -> None:
        # The cache keeps the first copy of a prefix; a later request that computed the same tokens may be the
        # one that kept (pinned) recent state there. Copy it so hits can resume there.
        moves = [(c, o) for c, o in zip(cached, own) if c != o and self._pinned[o] and self._recent_of[c] < 0]
        moves = moves[: len(self._recent_free)]  # never reclaims: a running sequence may need every pinned page
        if not moves:
            return
        for c, _ in moves:
            self._attach(c, set(own))
            self._pinned[c] = True
        self._sync()
        device = self.recent_of_t.device
        src = self.recent_of_t[torch.tensor([o for _, o in moves], device=device)]
        dst = self.recent_of_t[torch.tensor([c for c, _ in moves], device=device)]
        offsets = torch.arange(self.page_size, device=device)
        src, dst = (src[:, None] * self.page_size + offsets).flatten(), (dst[:, None] * self.page_size + offsets).flatten()
        self._copy_recent_rows(src, dst)

    # ---- per step ----

    def prepare(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """Give the step's new tokens recent rows, pin checkpoints, release what no step needs any more;
        returns each sequence's recent slot of every position (valid from start - recent_tokens on)."""
        ps = self.page_size
        # Release scans start where this sequence's previous step stood (looked up by the page of its last
        # computed position; a miss scans a short way back and at worst keeps a page until the request ends).
        lasts = [slots[n - q - 1 : n - q] for q, n, slots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots)]
        last_pages = (torch.cat(lasts) // ps).tolist() if lasts else []
        spans, probes, at = [], [], 0
        for q_len, kv_len, slots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots):
            start = kv_len - q_len
            lo = self._scan_start(start, last_pages[at] if start > 0 else None)
            at += start > 0
            spans.append((lo, start, kv_len))
            probes.append(slots[lo * ps : kv_len : ps])
        ids = (torch.cat(probes) // ps).tolist() if probes else []
        seqs, at = [], 0
        for lo, start, kv_len in spans:
            n = math.ceil(kv_len / ps) - lo
            seqs.append((lo, start, kv_len, ids[at : at + n]))
            at += n
        self._track(seqs)
        return [self.recent_of_t[s // ps] * ps + s % ps for s in batch.kv_slots]

    def prepare_decode(self, page_lists: list[list[int]], positions: list[int]) -> None:
        """`prepare`'s bookkeeping for a decode step (sequence i computes position positions[i] over its pages
        page_lists[i]) from the host's page lists, reading nothing back from the device: what a CUDA-graph step
        runs before its replay, whose indices come from `recent_of_t` and the page table on the device."""
        ps, seqs = self.page_size, []
        for pages, start in zip(page_lists, positions):
            lo = self._scan_start(start, pages[(start - 1) // ps] if start > 0 else None)
            seqs.append((lo, start, start + 1, pages[lo : start // ps + 1]))
        self._track(seqs)

    def _scan_start(self, start: int, last_page: int | None) -> int:
        """First main page (index in the sequence's list) a step from `start` scans for release."""
        prev = start - _FALLBACK_LOOKBACK
        if last_page is not None:
            prev = min(prev, self._last_start.pop(last_page, prev))
        return max(0, prev - self.layout.recent_tokens - self.layout.release_margin) // self.page_size

    def _track(self, seqs: list[tuple[int, int, int, list[int]]]) -> None:
        """seqs: (lo, start, kv_len, pages lo .. of the sequence) per sequence of the step."""
        ps, r = self.page_size, self.layout.recent_tokens
        needed: set[int] = set()
        for lo, start, kv_len, pages in seqs:
            first = max(0, start - r) // ps - lo
            for j, page in enumerate(pages[first : (start + ps - 1) // ps - lo], start=first):
                if self._recent_of[page] < 0:
                    raise RuntimeError(f"recent KV state of positions {(lo + j) * ps}.. is gone (the compact "
                                       f"DeepSeek-V4 pool resumes a sequence only where it was kept)")
            needed.update(pages[first:])
        for lo, start, kv_len, pages in seqs:
            for page in pages[: max(0, (start - r - self.layout.release_margin) // ps - lo)]:
                if page not in needed and not self._pinned[page] and self._recent_of[page] >= 0:
                    self._free_recent(page)
        for lo, start, kv_len, pages in seqs:
            for page in pages[start // ps - lo :]:
                if self._recent_of[page] < 0:
                    self._attach(page, needed)
            self._pin_checkpoints(lo, start, kv_len, pages)
            self._last_start[pages[-1]] = start
        self._sync()

    def _pin_checkpoints(self, lo: int, start: int, kv_len: int, pages: list[int]) -> None:
        ps, r, every = self.page_size, self.layout.recent_tokens, self.layout.checkpoint_tokens
        spans = [(end - r, end) for end in range((start // every + 1) * every, kv_len + 1, every)]
        for a, b in spans:
            self._pin(pages[max(0, max(0, a) // ps - lo) : math.ceil(b / ps) - lo])

    def _pin(self, pages: list[int]) -> None:
        for page in pages:
            if self._recent_of[page] >= 0:
                self._pinned[page] = True

    def _attach(self, page: int, needed: set[int]) -> None:
        if not self._recent_free:
            self._reclaim(needed)
        recent = self._recent_free.pop()
        self._recent_of[page] = recent
        self._recent_owner[recent] = page
        self._dirty.add(page)

    def _reclaim(self, needed: set[int]) -> None:
        """The recent pool is full: give up pinned pages no sequence of this step needs (older hits get cut
        back further), lowest main page first."""
        owners = self._recent_owner[self._recent_owner >= 0]
        for page in np.sort(owners).tolist():
            if self._pinned[page] and page not in needed:
                self._free_recent(page)
                self.num_recent_reclaimed += 1
                if len(self._recent_free) >= min(64, self.num_recent_pages // 8 + 1):
                    break
        if not self._recent_free:
            raise RuntimeError(f"the recent-state pool ({self.num_recent_pages} pages) is too small for this "
                               "step: raise DEEPINFER_V4_RECENT_FRACTION")

    def _free_recent(self, page: int) -> None:
        recent = int(self._recent_of[page])
        self._recent_of[page] = -1
        self._pinned[page] = False
        self._recent_owner[recent] = -1
        self._recent_free.append(recent)
        self._dirty.add(page)

    def _drop_main(self, pages: list[int]) -> None:
        for page in pages:
            self._last_start.pop(page, None)
            if self._recent_of[page] >= 0:
                self._free_recent(page)
            self._pinned[page] = False

    def _sync(self) -> None:
        if self._dirty:
            idx = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
            stage = torch.from_numpy(np.stack([idx, self._recent_of[idx]]))
            # On a GPU from pinned memory, without waiting: a pageable copy would wait for the queued steps (the
            # host would stall under overlap, and a CUDA-graph step's host part must not sync). The caching host
            # allocator keeps the pinned block until the copy has read it.
            is_cuda = self.recent_of_t.is_cuda
            dev = (stage.pin_memory() if is_cuda else stage).to(self.recent_of_t.device, non_blocking=is_cuda)
            self.recent_of_t[dev[0]] = dev[1]
            self._dirty.clear()

    # ---- copies (n > 1 siblings fork a partly filled page) ----

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        ps = self.page_size
        for page in {d // ps for d in dst}:
            if self._recent_of[page] < 0:
                self._attach(page, {s // ps for s in src})
        self._sync()
        device = self.recent[0].device
        s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        rs, rd = (self.recent_of_t[t // ps] * ps + t % ps for t in (s, d))
        self._copy_recent_rows(rs, rd)
        for layer, m in enumerate(self.layout.ratios):
            if m:
                es, ed = s // self.entry_divisor(m), d // self.entry_divisor(m)
                self.entries[layer][ed] = self.entries[layer][es]
                for rows in (self.fp8_entry[layer], self.fp8_idx_entry[layer], self.fp4_entry[layer],
                             self.fp4_idx_entry[layer]):
                    if rows is not None:
                        rows.values[ed], rows.scales[ed] = rows.values[es], rows.scales[es]
