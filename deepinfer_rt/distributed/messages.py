"""Plain data exchanged between the engine and its EP workers (pickled over zmq).

Workers keep a mirror `Req` of each request in the previous step's batch; a step message carries only what
changed since then. A request absent from a step is forgotten by the workers and sent whole if it returns
(after a retraction, or a step that had no budget for it), so the mirrors never drift from the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.distributed.eplb import EPLBConfig
from deepinfer_rt.model_runner import RunResult
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.speculative.config import SpeculativeConfig


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
    """Prompt-lookup speculation: each worker verifies the drafts its steps carry."""


@dataclass
class NewReq:
    """A request the workers do not hold (first step, or back after an absence)."""
    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    params: SamplingParams
    seed: int


@dataclass
class StepItem:
    rid: int
    num_computed_tokens: int
    num_new_tokens: int
    new_token_ids: list[int]
    """Tokens appended since the previous step (the whole list for a NewReq is in NewReq.token_ids)."""
    pages_from: int
    """new_pages extend the mirror's pages from this index (0: replace them)."""
    new_pages: list[int]
    num_prompt_logprobs: int
    is_sampling: bool
    wants_prompt_logprobs: bool
    num_inflight_tokens: int
    """Overlap: the engine's token of the step before, still on the workers' device (see model_runner)."""
    bitmask: torch.Tensor | None = None
    draft_tokens: tuple[int, ...] = ()
    """Speculation: the drafts the step verifies after the item's tokens (counted in num_new_tokens)."""
    """Grammar bitmask row (int32, ceil(V / 32)) filled by the engine when the item samples constrained."""


@dataclass
class StepMsg:
    new_reqs: list[NewReq] = field(default_factory=list)
    items: list[StepItem] = field(default_factory=list)
    kv_copies: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(src slots, dst slots) copies the scheduler asked for since the previous step, done before the forward."""
    is_overlapped: bool = False
    """Launched before the step before is collected: its decode inputs read that step's tokens on the device,
    and its answer waits until the next step arrives (or a "flush")."""


@dataclass
class StepReply:
    rank: int
    result: RunResult | None
    """This rank's result, item indices within its own part of the step."""
