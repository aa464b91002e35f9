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
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

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

    def layer_k_shape(self, layer: int) -> tuple[int, int]:
        return self.k_shape if self.layer_dims is None else (1, self.layer_dims[layer])

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elems = sum(h * d for h, d in map(self.layer_k_shape, range(self.num_layers)))
        if self.v_shape is not None:
            elems += self.v_shape[0] * self.v_shape[1] * self.num_layers
        return elems * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Refcounted pages, on the host only (the scheduler uses it and never touches tensors). Refcounts live in a
    numpy array so that a prompt's thousands of pages are taken and released by vector operations: per-page
    Python cost ~3 ms per 8K-token prefill step, time the GPU waits for."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, dtype=np.int64)
        # Pop from the end; start with low page ids first so small workloads touch little memory.
        self._free = list(range(num_pages - 1, -1, -1))

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
        self._free.extend(idx[refs == 0].tolist())

    def refcount(self, page: int) -> int:
        return int(self._refs[page])


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
    return torch.frombuffer(buffer, dtype=dtype).view(*shape)


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.layout = layout
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.allocator = PageAllocator(num_pages)
        self.k = [_zeros(self.num_slots, *layout.layer_k_shape(layer), dtype=dtype, device=device)
                  for layer in range(layout.num_layers)]
        if layout.v_shape is None:
            self.v = [k[..., : layout.v_dim] for k in self.k]
        else:
            self.v = [_zeros(self.num_slots, *layout.v_shape, dtype=dtype, device=device)
                      for _ in range(layout.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """The slots of one step are distinct: index_copy_, several times faster than index_put_ on CPU (which
        stays for rows given in another shape, broadcast into the pool's)."""
        for buf, x in ((self.k[layer], k), (self.v[layer], v)):
            if x is None:
                continue
            if x.shape[1:] == buf.shape[1:]:
                buf.index_copy_(0, slots, x.to(buf.dtype))
            else:
                buf[slots] = x

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy KV of `src` slots into `dst` slots in every layer (forking a partly filled page)."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for layer in range(self.layout.num_layers):
            self.k[layer][d] = self.k[layer][s]
            if self.layout.v_shape is not None:
                self.v[layer][d] = self.v[layer][s]


def num_kv_pages(layout: KVLayout, dtype: torch.dtype, device: torch.device, page_size: int,
                 kv_cache_tokens: int | None, max_num_seqs: int, max_position: int, num_sharing_ranks: int = 1) -> int:
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
    tokens = min(int(budget // layout.bytes_per_token(dtype)), max_num_seqs * max_position)
    return max(tokens // page_size, 1)


def slots_of(pages: list[int], num_tokens: int, page_size: int) -> list[int]:
    """Slot index of each of the first `num_tokens` positions of a request holding `pages`."""
    if page_size == 1:
        return pages[:num_tokens]
    return [pages[i // page_size] * page_size + i % page_size for i in range(num_tokens)]
