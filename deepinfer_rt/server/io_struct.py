"""Messages between the HTTP process and the scheduler process (plain data, pickled over pyzmq)."""
from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_rt.sampling_params import SamplingParams


@dataclass
class GenerateReqInput:
    rid: str
    input_ids: list[int]
    params: SamplingParams


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    """A request answered with one ControlOutput: 'stats' or 'flush_cache'."""
    rid: str
    kind: str


@dataclass
class ShutdownReq:
    pass


@dataclass
class SeqDelta:
    """What one sequence (index k of a request's n) produced since its previous delta."""
    rid: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    """Set on the last delta: 'stop' | 'length' | 'abort' | 'error'."""
    error: str | None = None
    is_rejected: bool = False
    """The request was refused at submission (bad input): no sequence ran; error says why."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None
    """Only on the last delta, when asked for."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """Only on the last delta, when a prompt_logprobs count was asked for."""

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ReadyMessage:
    """Sent once by the scheduler process when its engine is loaded."""
    model_path: str
    max_position: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_num_seqs: int
    enable_prefix_cache: bool
    device: str = ""


@dataclass
class Heartbeat:
    """Sent by the scheduler process every DEEPINFER_HEARTBEAT_INTERVAL while its loop turns: the HTTP process
    counts an engine silent for DEEPINFER_HEARTBEAT_TIMEOUT as stuck."""


@dataclass
class ControlOutput:
    rid: str
    value: dict
