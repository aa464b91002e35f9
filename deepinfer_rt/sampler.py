"""Sampler: logits (one row per sampling request) -> next tokens, plus logprobs when asked.

Order: raw logprobs (reported, from the model's own distribution) -> penalties -> logit_bias -> min_new_tokens
mask -> grammar mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> a seeded draw.

The draw is counter-based: the uniform noise of a request depends only on (its seed, its output position),
never on which rows share the batch, so seeded sampling is reproducible across runs and batch layouts.
Gumbel-max over the filtered logits: argmax(z - log(-log u)) samples softmax(z). On CUDA the whole batch draws in
one kernel (deepinfer_kernels.sampling: Philox noise of the row's stream seed, made in registers); elsewhere each
row's noise comes from a torch generator seeded with it. The two noises differ, so a seed's tokens on a GPU are
not the CPU's; each is reproducible on its own device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_rt.request import Req

_MASK64 = (1 << 64) - 1


_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""splitmix64's constants, for stream_seed and its array form stream_seeds."""


def stream_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed for (seed, position) (splitmix64 finaliser)."""
    c1, c2, c3 = _MIX
    x = (seed * c1 + position * c2 + c3) & _MASK64
    x = ((x ^ (x >> 30)) * c2) & _MASK64
    x = ((x ^ (x >> 27)) * c3) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


_C1, _C2, _C3 = (np.uint64(c) for c in _MIX)


def stream_seeds(seeds: list[int], positions: list[int]) -> np.ndarray:
    """stream_seed of each (seed, position) pair, as int64, computed over arrays (wrapping uint64 arithmetic)."""
    s = np.fromiter((x & _MASK64 for x in seeds), dtype=np.uint64, count=len(seeds))
    p = np.fromiter((x & _MASK64 for x in positions), dtype=np.uint64, count=len(positions))
    with np.errstate(over="ignore"):
        x = s * _C1 + p * _C2 + _C3
        x = (x ^ (x >> np.uint64(30))) * _C2
        x = (x ^ (x >> np.uint64(27))) * _C3
        x = x ^ (x >> np.uint64(31))
    return (x & np.uint64((1 << 63) - 1)).astype(np.int64)


def uniform_noise(seed: int, position: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The noise gumbel_draw uses for (seed, position) off CUDA: a torch generator's uniforms, clamped at 1e-20."""
    return stream_noise(stream_seed(seed, position), vocab_size, device)


def stream_noise(stream: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """uniform_noise of a stream seed (stream_seed's value)."""
    gen = torch.Generator(device=device).manual_seed(stream)
    return torch.rand(vocab_size, generator=gen, device=device).clamp_(min=1e-20)


def gumbel_draw(z: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """Each row of z (B, V) float32 sampled as argmax(z - log(-log u)) with the noise u of its (seed, output
    position): (B,) int64 on z's device, without a host sync."""
    return draw_streams(z, stream_seeds(seeds, positions))


def draw_streams(z: torch.Tensor, streams) -> torch.Tensor:
    """gumbel_draw of rows whose stream seeds (stream_seed's values, a sequence of ints) are given."""
    if z.is_cuda:
        from deepinfer_kernels.sampling import gumbel_argmax
        return gumbel_argmax(z, to_device(streams, torch.long, z.device))
    noise = torch.stack([stream_noise(int(s), z.shape[-1], z.device) for s in streams])
    return (z - torch.log(-torch.log(noise))).argmax(-1)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None
    """Logprob of each chosen token under the raw model distribution (rows that asked; others 0.0)."""
    top_logprobs: list[list[tuple[int, float]]] | None


_NUMPY_INTS = {torch.long: np.int64, torch.int32: np.int32}


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without a host sync: on CUDA through pinned memory, copied
    asynchronously (a pageable copy would wait for the queued GPU work). Integer lists go through numpy, 4-5x
    faster than torch.tensor for a prefill step's tens of thousands of entries."""
    if dtype in _NUMPY_INTS:
        host = torch.from_numpy(np.fromiter(values, dtype=_NUMPY_INTS[dtype], count=len(values)))
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PenaltyState:
    """A request's token counts on the device, for its penalties: `seen` marks prompt and output tokens
    (repetition penalty), `counts` counts output tokens (frequency / presence). Built from the request's tokens
    once, then grown by the tokens added since (`catch_up`): a step touches its new tokens, never the whole
    context (a 32K-token prompt uploaded every step was O(context) host work per step)."""

    def __init__(self, vocab: int, device: torch.device):
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.num_tokens = 0
        """Tokens of token_ids counted so far."""

    def catch_up(self, req: Req) -> None:
        tokens = req.token_ids
        if len(tokens) < self.num_tokens:  # the list was replaced (never happens today): count it again
            self.seen.zero_()
            self.counts.zero_()
            self.num_tokens = 0
        if len(tokens) == self.num_tokens:
            return
        new = to_device(tokens[self.num_tokens :], torch.long, self.seen.device)
        self.seen[new] = True
        first_output = max(0, req.prompt_len - self.num_tokens)
        if first_output < len(new):
            self.counts.index_add_(0, new[first_output:], torch.ones(len(new) - first_output, device=new.device))
        self.num_tokens = len(tokens)

    def plus_outputs(self, tokens: tuple[int, ...]) -> "PenaltyState":
        """A copy with `tokens` appended as outputs (a speculative verification row: its request's counts plus
        the drafts before it), built on the device from this state and the few tokens."""
        if not tokens:
            return self
        state = PenaltyState.__new__(PenaltyState)
        new = to_device(list(tokens), torch.long, self.seen.device)
        state.seen, state.counts = self.seen.clone(), self.counts.clone()
        state.seen[new] = True
        state.counts.index_add_(0, new, torch.ones(len(new), device=new.device))
        state.num_tokens = self.num_tokens + len(tokens)
        return state


def _penalty_state(req: Req, logits: torch.Tensor) -> PenaltyState:
    """req's counts, kept on req and caught up with its new tokens."""
    state = req.penalty_state
    if state is None or state.seen.device != logits.device or state.seen.shape[0] != logits.shape[1]:
        state = req.penalty_state = PenaltyState(logits.shape[1], logits.device)
    state.catch_up(req)
    return state


def apply_penalties(logits: torch.Tensor, reqs: list[Req]) -> None:
    for i, req in enumerate(reqs):
        p = req.params
        wants_counts = (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and req.num_output_tokens
        if p.repetition_penalty == 1.0 and not wants_counts:
            continue
        # A request keeps its counts; a speculative verification row (speculative.verify.DraftRow) is its
        # request's counts plus the drafts before it.
        if isinstance(req, Req):
            state = _penalty_state(req, logits)
        else:
            state = _penalty_state(req.req, logits).plus_outputs(req.drafts)
        if p.repetition_penalty != 1.0:
            row = logits[i]
            penalised = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
            logits[i] = torch.where(state.seen, penalised, row)
        if wants_counts:
            counts = state.counts.to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, reqs: list[Req]) -> None:
    for i, req in enumerate(reqs):
        bias = req.params.logit_bias
        if bias:
            ids = to_device(list(bias), torch.long, logits.device)
            logits[i, ids] += to_device(list(bias.values()), logits.dtype, logits.device)


def filter_logits(z: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Temperature-scaled rows z (B, V): set tokens outside top-k / top-p / min-p to -inf."""
    top_k = [r.params.top_k for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    min_p = [r.params.min_p for r in reqs]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return z
    vocab = z.shape[1]
    sorted_z, order = z.sort(dim=-1, descending=True)
    probs = sorted_z.softmax(dim=-1)
    rank = torch.arange(vocab, device=z.device)[None, :]
    # Clamped to the vocabulary: a huge top_k (offline callers skip validation) must not overflow an int64.
    k = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], torch.long, z.device)[:, None]
    drop = rank >= k
    p = to_device(top_p, probs.dtype, z.device)[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays).
    # Rows without top-p are exempt: in fp32 the running sum of a peaked row reaches 1.0 before its tail.
    drop |= ((probs.cumsum(-1) - probs) >= p) & (p < 1.0)
    m = to_device(min_p, probs.dtype, z.device)[:, None]
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(1, order, sorted_z)


_TINY_TEMPERATURE = 1e-20
"""Below it, logits / temperature can overflow float32 to inf (and inf - inf is nan: every row drew token 0)."""


def _shift_peaks(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """Rows of a tiny temperature with their max shifted to 0, so dividing sends the others to -inf and never the
    max to +inf. Other rows are returned bit for bit (a row's draw never depends on its batch)."""
    peak = logits.amax(-1, keepdim=True)
    tiny = to_device([t < _TINY_TEMPERATURE for t in temperatures], torch.bool, logits.device)[:, None]
    return torch.where(tiny & torch.isfinite(peak), logits - peak, logits)


class Sampler:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def process(self, logits: torch.Tensor, reqs: list, eos_ids: tuple[int, ...], bitmask_fn=None
                ) -> torch.Tensor:
        """A processed copy of fp32 logits (B, vocab): penalties, the min_new_tokens ban, the grammar mask.
        Speculative verification reads the same rows, so its target distribution is the sampler's."""
        logits = logits.clone()
        apply_penalties(logits, reqs)
        apply_logit_bias(logits, reqs)
        for i, r in enumerate(reqs):
            # A grammar decides where a constrained output may end; banning EOS there could leave no token.
            if r.num_output_tokens < r.params.min_new_tokens and r.grammar is None:
                banned = list(r.params.stop_token_ids or []) + ([] if r.params.ignore_eos else list(eos_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        if bitmask_fn is not None:
            bitmask_fn(logits)
        return logits

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...],
                 bitmask_fn=None) -> SampleResult:
        logits = logits[:, : self.vocab_size].float()
        want_lp = [r.params.logprobs or r.params.top_logprobs > 0 for r in reqs]
        raw_lp = logits.log_softmax(-1) if any(want_lp) else None
        tokens = self._choose(logits, reqs, eos_ids, bitmask_fn)
        token_list = tokens.tolist()
        logprobs = top = None
        if raw_lp is not None:
            chosen = raw_lp.gather(1, tokens[:, None]).squeeze(1).tolist()
            logprobs = [c if w else 0.0 for c, w in zip(chosen, want_lp)]
            k = max(r.params.top_logprobs for r in reqs)
            if k > 0:
                vals, ids = raw_lp.topk(k, dim=-1)
                vals, ids = vals.tolist(), ids.tolist()
                top = [list(zip(ids[i][: r.params.top_logprobs], vals[i][: r.params.top_logprobs]))
                       for i, r in enumerate(reqs)]
        return SampleResult(token_list, logprobs, top)

    @staticmethod
    def takes_graph_tokens(reqs: list[Req]) -> bool:
        """Whether every row's token is the one a decode graph ending with the head computes (cuda_graph.py): greedy
        rows (the argmax) and temperature draws without top-k / top-p / min-p (gumbel_draw over logits /
        temperature), none of them changed by a penalty, bias, token ban or grammar."""
        for r in reqs:
            p = r.params
            if p.logit_bias or r.grammar is not None or r.num_output_tokens < p.min_new_tokens:
                return False
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                return False
            if not p.is_greedy and not (p.temperature >= _TINY_TEMPERATURE and p.top_k <= 0 and p.top_p >= 1.0
                                        and p.min_p <= 0.0):
                return False
        return True

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> torch.Tensor:
        """The tokens `__call__` picks, left on the device (overlap scheduling reads them a step later).
        No host sync for rows without penalties or a min_new_tokens ban."""
        return self._choose(logits[:, : self.vocab_size].float(), reqs, eos_ids, None)

    def _choose(self, logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...], bitmask_fn
                ) -> torch.Tensor:
        logits = self.process(logits, reqs, eos_ids, bitmask_fn)
        greedy = [r.params.is_greedy for r in reqs]
        tokens = logits.argmax(-1)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            sub = [reqs[i] for i in rows]
            # Row indices go up as a tensor: indexing with a list would copy it to the device synchronously.
            index = None if len(rows) == len(reqs) else to_device(rows, torch.long, logits.device)
            temperatures = [r.params.temperature for r in sub]
            # (float32 has no 1e-300: a tiny temperature would round to 0 and divide 0 by 0 at the peak)
            temps = to_device([max(t, _TINY_TEMPERATURE) for t in temperatures], torch.float32,
                              logits.device)[:, None]
            picked = logits if index is None else logits[index]
            if min(temperatures) < _TINY_TEMPERATURE:
                picked = _shift_peaks(picked, temperatures)
            z = filter_logits(picked / temps, sub)
            drawn = gumbel_draw(z, [r.seed for r in sub], [r.num_output_tokens for r in sub])
            if index is None:
                tokens = drawn
            else:
                tokens[index] = drawn
        return tokens
