"""Plain data exchanged between the engine and its EP workers (pickled over zmq).

Workers keep a mirror `Req` of each request in the previous step's batch (distributed/mirrors.py); a step
message carries only what changed since then, column by column (StepItems). A request absent from a step is
forgotten by the workers and sent whole if it returns (after a retraction, or a step that had no budget for it),
so the mirrors never drift from the engine.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.distributed.eplb import EPLBConfig
from deepinfer_rt.model_runner import RunResult
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.config import SpeculativeConfig
from deepinfer_rt.speculative.drafter import Proposal


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    engine_addr: str
    """zmq address of the engine's ROUTER socket."""
    dist_env: dict[str, str]
    """torchrun-style variables (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) for env:// init."""
    model_path: str
    model_config: ModelConfig
    """Parsed by the engine (workers need not import transformers)."""
    dtype: torch.dtype
    device_type: str
    load_format: str
    seed: int
    page_size: int
    kv_cache_tokens: int | None
    """The engine's KV budget, or None: each worker sizes its pool from its memory after loading (cache/kv_pool.py
    num_kv_pages), and all take the minimum."""
    max_num_seqs: int
    max_position: int
    eos_ids: tuple[int, ...]
    num_threads: int
    eplb: EPLBConfig
    timeout_s: float
    batch_invariant: bool = False
    speculative: SpeculativeConfig | None = None
    """Speculation: each worker verifies the drafts its steps carry (prompt lookup's, planned by the engine), and
    with MTP or DSpark drafts the next ones itself (distributed/spec.py)."""
    quantization: str | None = None
    """Engine(quantization=): how the workers' layers hold their weights (KernelConfig.quantization)."""
    kv_cache_dtype: str = "auto"
    """Engine(kv_cache_dtype=): the workers' KV pools ("fp8_e4m3": e4m3 rows with scales)."""


@dataclass
class NewReq:
    """A request the workers do not hold (first step, or back after an absence)."""
    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    params: SamplingParams
    seed: int


COLUMNS = ("rid", "num_computed_tokens", "num_new_tokens", "pages_from", "num_prompt_logprobs",
           "num_inflight_tokens", "is_sampling", "wants_prompt_logprobs", "num_new_token_ids", "num_new_pages")
"""Per-item fields of a step, one column each:
    rid, num_computed_tokens, num_new_tokens, is_sampling, wants_prompt_logprobs   the engine's ScheduledReq
    num_prompt_logprobs     prompt logprobs the request holds (the mirror's count)
    num_inflight_tokens     overlap: the engine's token of the step before, still on the workers' device
    pages_from              the mirror keeps its first pages_from pages (cut there if it holds more: pages
                            of rejected drafts given back) and the new pages follow (0: replace them)
    num_new_token_ids       tokens appended since the previous step (the whole list of a NewReq is its own)
    num_new_pages           pages taken since then (or all of them when pages_from is 0)"""


def _column(values: list[int]) -> int | np.ndarray:
    """One value for the whole column when every item has it (most columns of a decode step), else the array,
    int32 where the values fit."""
    if not values or values.count(values[0]) == len(values):
        return values[0] if values else 0
    return _ints(values)


def _ints(values) -> np.ndarray:
    array = np.asarray(values, dtype=np.int64)
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        return array
    return array.astype(np.int32)


@dataclass
class StepItems:
    """The items of one rank's step, column by column (COLUMNS): each column one int when every item has the
    same value, else an int32 array with an entry per item; the new token ids and pages flat, cut by their
    per-item counts. So a message is what changed since the previous step, a few raw buffers to pickle: a decode
    step of 256 requests at page size 1 is ~3.7 KB (the ids, computed counts, page offsets, new tokens and new
    pages; the rest are single values), where a pickled object per item took ~16 KB and ~1 ms to pickle and
    unpickle."""
    num_items: int
    columns: dict[str, int | np.ndarray]
    new_token_ids: np.ndarray
    new_pages: np.ndarray
    bitmasks: dict[int, torch.Tensor] = field(default_factory=dict)
    """Item index -> grammar bitmask row (int32, ceil(V / 32)) filled by the engine for a constrained sampler."""
    draft_tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Speculation: item index -> the drafts the step verifies after its tokens (counted in num_new_tokens)."""

    @classmethod
    def pack(cls, columns: dict[str, list[int]], new_token_ids: list[list[int]], new_pages: list[list[int]],
             bitmasks: dict[int, torch.Tensor] | None = None,
             draft_tokens: dict[int, tuple[int, ...]] | None = None) -> "StepItems":
        if set(columns) != set(COLUMNS) - {"num_new_token_ids", "num_new_pages"}:
            raise ValueError(f"step columns {sorted(columns)} are not {COLUMNS}")
        num_items = len(columns["rid"])
        packed = {name: _column(values) for name, values in columns.items()}
        packed["num_new_token_ids"] = _column([len(t) for t in new_token_ids])
        packed["num_new_pages"] = _column([len(p) for p in new_pages])
        return cls(num_items, packed, _ints(list(itertools.chain.from_iterable(new_token_ids))),
                   _ints(list(itertools.chain.from_iterable(new_pages))), bitmasks or {}, draft_tokens or {})

    def column(self, name: str) -> list[int]:
        value = self.columns[name]
        return [value] * self.num_items if isinstance(value, int) else value.tolist()

    def ragged(self, name: str) -> list[list[int]]:
        """Each item's new token ids ("new_token_ids") or new pages ("new_pages")."""
        flat = getattr(self, name).tolist()
        counts = self.columns[f"num_{name}"]
        if isinstance(counts, int):
            if counts == 1:
                return [[v] for v in flat]
            return [flat[i * counts : (i + 1) * counts] for i in range(self.num_items)]
        ends = list(itertools.accumulate(counts.tolist()))
        return [flat[end - n : end] for end, n in zip(ends, counts.tolist())]


@dataclass
class StepMsg:
    new_reqs: list[NewReq] = field(default_factory=list)
    items: StepItems | None = None
    """None: an empty step (no requests on this rank)."""
    kv_copies: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(src slots, dst slots) copies the scheduler asked for since the previous step, done before the forward."""
    is_overlapped: bool = False
    """Launched before the step before is collected: its decode inputs read that step's tokens on the device,
    and its answer waits until the next step arrives (or a "flush")."""
    draft_forwards: int = 0
    """MTP: the chain forwards every rank runs after this step's MTP forward (distributed/spec.py); 0 for
    DSpark, whose drafter joins no collective."""
    decode_rows: int = 0
    """A decode step on every rank (each item of each part computes one token, no drafts): the most items any
    rank holds, which sizes the step's capture-safe exchange and CUDA graph alike on every rank; 0 otherwise."""


@dataclass
class StepReply:
    rank: int
    result: RunResult | None
    """This rank's result, item indices within its own part of the step."""
    drafts: Drafts | None = None
    """MTP, DSpark: this rank's proposals for the next step."""


@dataclass
class Drafts:
    """A worker's MTP or DSpark proposals after a step, one row per request that drafted: its id, the token
    count the drafts continue, and its drafts with their confidences (every row the same length, the drafter's
    max_draft). The draft distributions of sampled requests stay in the worker."""
    rids: np.ndarray
    num_tokens: np.ndarray
    tokens: np.ndarray
    """(rows, k) int32."""
    confidences: np.ndarray
    """(rows, k) float64: the drafter's own floats (DSpark's are ratios of survival probabilities), so the
    engine's confidence plan is the in-process one."""

    @classmethod
    def pack(cls, proposals: dict[int, Proposal]) -> "Drafts":
        items = list(proposals.items())
        k = len(items[0][1].tokens) if items else 0
        return cls(np.array([rid for rid, _ in items], dtype=np.int64),
                   np.array([p.num_tokens for _, p in items], dtype=np.int64),
                   np.array([p.tokens for _, p in items], dtype=np.int32).reshape(len(items), k),
                   np.array([p.confidences for _, p in items], dtype=np.float64).reshape(len(items), k))

    def proposals(self) -> dict[int, Proposal]:
        return {rid: Proposal(tokens, confidences, None, num_tokens) for rid, num_tokens, tokens, confidences in
                zip(self.rids.tolist(), self.num_tokens.tolist(), self.tokens.tolist(), self.confidences.tolist())}
