"""KV pool: per-layer K/V buffers indexed by slot, and a refcounted page allocator.

A slot holds one token's KV for every layer. Slots are handed out in pages of `page_size` consecutive slots;
slot = page * page_size + offset. A page is free when its reference count is 0. Requests, the prefix tree
and n > 1 siblings share a page by each holding a reference, so "free + referenced = num_pages" always.

Layouts:
  GQA: k[layer] (num_slots, num_kv_heads, head_dim), v[layer] the same shape.
  MLA: k[layer] (num_slots, 1, kv_lora_rank + rope_dim) holding [latent | rope key];
       v[layer] is a view of its first kv_lora_rank columns (the absorbed form reads the latent as V).
  Per-layer widths (`layer_dims`): k[layer] (num_slots, 1, layer_dims[layer]) for models whose layers keep
       different per-token state (DeepSeek-V4: sliding-window key, compressor inputs, compressed entries).

KV cache dtype (CacheConfig.kv_cache_dtype): 'auto' stores rows in the model dtype; 'fp8_e4m3' stores each
(token, KV head) row in float8_e4m3fn with one float32 scale, amax / 448 at write time, in parallel tensors
k_scale[layer] (num_slots, heads) and v_scale[layer] (for MLA the same tensor as k_scale: V is K's prefix, so
the latent and the rope key share the row's scale). Dequantized row = fp8 value x scale. Quantization is per
row, so a row's stored bits depend only on its own values: not on the batch, the chunk or the prefix cache.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from deepinfer_rt.env import get_env


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    k_shape: tuple[int, int]
    """(heads, dim) stored per slot and layer for K."""
    v_shape: tuple[int, int] | None
    """(heads, dim) for V, or None when V is the first `v_dim` columns of K (MLA latent)."""
    v_dim: int
    layer_dims: tuple[int, ...] | None = None
    """Per-layer K width replacing k_shape[1] (one head, V a prefix of K), or None when all layers are alike."""
    is_fp8_supported: bool = False
    """Whether every row is a K/V head the attention backends read through the pool (kv_cache_dtype='fp8_e4m3'
    may store it); layouts whose rows hold other state (DeepSeek-V4's compact pool) say so themselves."""

    def layer_k_shape(self, layer: int) -> tuple[int, int]:
        return self.k_shape if self.layer_dims is None else (1, self.layer_dims[layer])

    def with_kv_dtype(self, kv_dtype: str) -> "KVLayout":
        """This layout storing KV as `kv_dtype` ('auto' = the model dtype; 'fp8_e4m3' where is_fp8_supported: the
        pool then holds float8 rows and their scales). Layouts with their own cache structure override it."""
        check_kv_cache_dtype(kv_dtype, self)
        return self

    def with_token_layer(self, width: int, lookback: int) -> "KVLayout":
        """This layout with one more layer of per-token state `width` wide that only its owner reads, through
        KVPool.token_rows, over the `lookback` positions before a step at most (DSpark's context keys). Layouts with
        their own cache structure override it."""
        dims = self.layer_dims or (self.k_shape[1],) * self.num_layers
        return KVLayout(self.num_layers + 1, (1, max(self.k_shape[1], width)), self.v_shape, self.v_dim,
                        layer_dims=dims + (width,))

    @property
    def pool_class(self) -> type["KVPool"]:
        """The pool that stores this layout (a model with its own cache structure returns its own)."""
        return KVPool

    def bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """Pool bytes of one token over all layers; with fp8_e4m3, one byte per value plus the rows' scales."""
        shapes = [self.layer_k_shape(layer) for layer in range(self.num_layers)]
        if self.v_shape is not None:
            shapes += [self.v_shape] * self.num_layers
        elems = sum(h * d for h, d in shapes)
        if kv_cache_dtype == "auto":
            return elems * torch.empty((), dtype=dtype).element_size()
        check_kv_cache_dtype(kv_cache_dtype, self)
        return elems + 4 * sum(h for h, _ in shapes)


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp4_e2m1")
"""fp4_e2m1: MXFP4 entries and index keys, DeepSeek-V4.1's compact pool only (models/deepseek_v4/cache.py)."""
FP8_MAX = 448.0
FP8_INV = 1.0 / FP8_MAX
"""What a row's amax is multiplied by for its scale (rounded once to fp32 where it multiplies)."""
"""Largest finite float8_e4m3fn value: a row's amax maps to it."""
_MIN_SCALE = 1e-12
"""Scale floor, so an all-zero row divides by a positive number (and stays zero)."""


def check_kv_cache_dtype(kv_cache_dtype: str, layout: KVLayout | None = None) -> None:
    """ValueError for an unknown kv_cache_dtype, or one that a layout does not take (fp8 where its rows are not
    plain K/V heads; fp4_e2m1 outside the layouts that set supports_fp4)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp4_e2m1" and layout is not None and not getattr(layout, "supports_fp4", False):
        raise ValueError("kv_cache_dtype='fp4_e2m1' (MXFP4 entries) is supported by DeepSeek-V4.1's compact KV pool "
                         "only; use 'fp8_e4m3' or 'auto'")
    if kv_cache_dtype != "auto" and layout is not None and not layout.is_fp8_supported:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by this model's KV layout "
                         "(its pool rows are not plain K/V heads); use 'auto'")


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (float8_e4m3fn (..., D), float32 scale (...)): each row over its last dim scaled so that
    its amax is FP8_MAX (the division and clamp in fp32, then round to nearest). The scale is amax times the fp32
    constant 1/448, not amax / 448: torch divides by a Python number on CUDA as a product with its reciprocal and
    on CPU as a true division, and the store kernel (deepinfer_kernels.elementwise) must match both bit for bit."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) * FP8_INV).clamp_min(_MIN_SCALE)
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_fp8_rows up to FP8 rounding: q (..., D) x scale (...), in fp32, then `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


class PageAllocator:
    """Refcounted pages, on the host only (the scheduler uses it and never touches tensors). Refcounts live in a
    numpy array so that a prompt's thousands of pages are taken and released by vector operations: per-page
    Python cost ~3 ms per 8K-token prefill step, time the GPU waits for."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, dtype=np.int64)
        # Pop from the end; start with low page ids first so small workloads touch little memory.
        self._free = list(range(num_pages - 1, -1, -1))
        self.on_free: Callable[[list[int]], None] | None = None
        """Called with the pages a decref has just freed (a pool that keeps more state per page drops it)."""
        self.prefix_guard: PrefixGuard | None = None
        """Set by a pool whose pages cannot resume at every position (cache/radix_cache.py asks it)."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        pages = self._free[-n:][::-1]  # the order of popping them one by one
        del self._free[-n:]
        self._refs[pages] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        idx = np.fromiter(pages, dtype=np.int64, count=len(pages))
        held = self._refs[idx] > 0
        assert held.all(), f"incref of free page {idx[~held][0]}"
        np.add.at(self._refs, idx, 1)

    def decref(self, pages: list[int]) -> None:
        idx = np.fromiter(pages, dtype=np.int64, count=len(pages))
        ordered = np.sort(idx)
        if (ordered[1:] == ordered[:-1]).any():  # a page listed twice: one at a time, in order
            for p in pages:
                self.decref([p])
            return
        refs = self._refs[idx]
        held = refs > 0
        assert held.all(), f"double free of page {idx[~held][0]}"
        refs -= 1
        self._refs[idx] = refs
        freed = idx[refs == 0].tolist()
        # Reversed, so the next allocations pop a freed run in its own (usually ascending) order: a lone stream
        # after an earlier request then gets consecutive ascending pages, which the CPU attention reads as a view
        # of the pool instead of gathering them (layers/attention/torch_ref.py).
        self._free.extend(reversed(freed))
        if self.on_free is not None and freed:
            self.on_free(freed)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])


class PrefixGuard(Protocol):
    def restorable(self, pages: list[int], num_tokens: int) -> int:
        """Longest page-aligned length <= num_tokens at which a sequence holding `pages` can resume exactly."""

    def keep(self, pages: list[int], num_tokens: int) -> None:
        """A sequence resumes at num_tokens over `pages`: keep what that needs while the pages live."""

    def keep_prompt(self, pages: list[int], prompt_len: int) -> None:
        """A request's prompt is computed: keep what resuming at its end (or its last whole page) needs."""

    def adopt(self, cached: list[int], own: list[int]) -> None:
        """A request's pages `own` hold the same tokens as the cache's `cached` (which stay in the cache):
        give the cached pages the resumable state only the request's copies have."""


def _zeros(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU an anonymous memory map, which the OS zeroes page by page when first touched: a pool
    sized from memory (2 GiB by default) costs nothing to create and occupies only the pages written (torch.zeros
    wrote all of it, ~2 s of an engine's start on a small machine)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(*shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(*shape)


class KVPool:
    def __new__(cls, layout: KVLayout, *args, **kwargs):
        # KVPool(layout, ...) builds the pool the layout asks for, wherever pools are made.
        target = layout.pool_class
        return super().__new__(target if cls is KVPool and issubclass(target, KVPool) else cls)

    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, kv_cache_dtype: str = "auto"):
        check_kv_cache_dtype(kv_cache_dtype, layout)
        self._init_pages(layout, num_pages, page_size, dtype, kv_cache_dtype, is_fp8=kv_cache_dtype == "fp8_e4m3")
        store = torch.float8_e4m3fn if self.is_fp8 else dtype
        self.k = [_zeros(self.num_slots, *layout.layer_k_shape(layer), dtype=store, device=device)
                  for layer in range(layout.num_layers)]
        if layout.v_shape is None:
            self.v = [k[..., : layout.v_dim] for k in self.k]
        else:
            self.v = [_zeros(self.num_slots, *layout.v_shape, dtype=store, device=device)
                      for _ in range(layout.num_layers)]
        if self.is_fp8:
            self.k_scale = [torch.zeros(k.shape[:2], dtype=torch.float32, device=device) for k in self.k]
            self.v_scale = self.k_scale if layout.v_shape is None else [
                torch.zeros(v.shape[:2], dtype=torch.float32, device=device) for v in self.v]

    def _init_pages(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype, kv_cache_dtype: str,
                    is_fp8: bool) -> None:
        """The attributes every pool has (pools with their own buffers call it in place of __init__); the buffers
        k / v (and k_scale / v_scale) are the pool's own to build."""
        self.layout = layout
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.dtype = dtype
        """The model dtype: what readers get back (dequantized rows with fp8_e4m3)."""
        self.kv_cache_dtype = kv_cache_dtype
        self.is_fp8 = is_fp8
        """Whether k / v hold FP8 K/V heads that the attention backends dequantize with k_scale / v_scale."""
        self.allocator = PageAllocator(num_pages)
        self.k_scale: list[torch.Tensor] | None = None
        """fp8_e4m3: (num_slots, heads) float32 per layer, the scale of each stored K row; else None."""
        self.v_scale: list[torch.Tensor] | None = None
        """fp8_e4m3: V's row scales (MLA: k_scale's tensors, V being a prefix of K); else None."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """The slots of one step are distinct: index_copy_, several times faster than index_put_ on CPU (which
        stays for rows given in another shape, broadcast into the pool's)."""
        for buf, scales, x in ((self.k[layer], self.k_scale and self.k_scale[layer], k),
                               (self.v[layer], self.v_scale and self.v_scale[layer], v)):
            if x is None:
                continue
            if x.shape[1:] != buf.shape[1:]:
                x = x.expand(x.shape[0], *buf.shape[1:])
            if scales is None:
                buf.index_copy_(0, slots, x.to(buf.dtype))
            else:
                q, s = quantize_fp8_rows(x)
                _bytes(buf).index_copy_(0, slots, _bytes(q))
                scales.index_copy_(0, slots, s)

    def rows(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` (n, heads, dim) in the model dtype (dequantized with fp8_e4m3; for MLA V is a
        column view of the K rows)."""
        if not self.is_fp8:
            k = self.k[layer].index_select(0, slots)
            return k, (k[..., : self.layout.v_dim] if self.layout.v_shape is None
                       else self.v[layer].index_select(0, slots))
        k = _gather_fp8(self.k[layer], self.k_scale[layer], slots, self.dtype)
        if self.layout.v_shape is None:
            return k, k[..., : self.layout.v_dim]
        return k, _gather_fp8(self.v[layer], self.v_scale[layer], slots, self.dtype)

    def span(self, layer: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the consecutive slots first .. first + n - 1: views of the pool in the model dtype, or
        dequantized copies with fp8_e4m3."""
        if not self.is_fp8:
            return self.k[layer].narrow(0, first, n), self.v[layer].narrow(0, first, n)
        return self.rows(layer, torch.arange(first, first + n, device=self.k[layer].device))

    def token_rows(self, layer: int, slots: torch.Tensor, valid: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer, rows) for a layer added by KVLayout.with_token_layer: buffer (n, width) holds the layer's
        per-token rows, `rows` (slots' shape) the rows of `slots` in it, so buffer[rows] reads them and
        buffer[rows] = x writes them. Padding slots (where `valid` is False) map to row 0."""
        rows = slots if valid is None else torch.where(valid, slots, torch.zeros_like(slots))
        return self.k[layer].view(self.num_slots, -1), rows

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy KV of `src` slots into `dst` slots in every layer (forking a partly filled page)."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for layer in range(self.layout.num_layers):
            k = _bytes(self.k[layer])
            k[d] = k[s]
            if self.layout.v_shape is not None:
                v = _bytes(self.v[layer])
                v[d] = v[s]
            if self.is_fp8:
                self.k_scale[layer][d] = self.k_scale[layer][s]
                if self.layout.v_shape is not None:
                    self.v_scale[layer][d] = self.v_scale[layer][s]


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """float8 tensors as their bytes (CPU index_copy_ / indexing take no float8); others as they are."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def _gather_fp8(buf: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = buf.view(torch.uint8).index_select(0, slots).view(torch.float8_e4m3fn)
    return dequantize_fp8_rows(rows, scales.index_select(0, slots), dtype)


def num_kv_pages(layout: KVLayout, dtype: torch.dtype, device: torch.device, page_size: int,
                 kv_cache_tokens: int | None, max_num_seqs: int, max_position: int, num_sharing_ranks: int = 1,
                 kv_cache_dtype: str = "auto") -> int:
    """Pages of the KV pool, measured once the weights are in place: `kv_cache_tokens` when given, else a share
    of the free memory (CUDA: DEEPINFER_KV_CACHE_MEMORY_FRACTION of what the device has free; CPU: the smaller
    of DEEPINFER_KV_CACHE_MAX_CPU_GIB and a quarter of the available RAM, split between the
    `num_sharing_ranks` processes that each hold a pool in it). Never more than every running request at full
    context could use."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens < page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size ({page_size})")
        return kv_cache_tokens // page_size
    env = get_env()
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * env.kv_cache_memory_fraction
    else:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(env.kv_cache_max_cpu_gib * 2**30, 0.25 * avail) / num_sharing_ranks
    tokens = min(int(budget // layout.bytes_per_token(dtype, kv_cache_dtype)), max_num_seqs * max_position)
    return max(tokens // page_size, 1)


def slots_of(pages: list[int], num_tokens: int, page_size: int) -> list[int]:
    """Slot index of each of the first `num_tokens` positions of a request holding `pages`."""
    if page_size == 1:
        return pages[:num_tokens]
    return [pages[i // page_size] * page_size + i % page_size for i in range(num_tokens)]
