"""DeepSeek-V4.1's DSpark block drafter (speculative="dspark"); the network is dspark_model.py.

No draft prefill: the target's forward writes the drafter's inputs itself. `FeatureCapture`, hooked onto the
target layers named by dspark_target_layer_ids, keeps the mean of their input streams for every row of the step;
after the step (`observe`) those features become each stage's context key (dspark_model.context_keys), written to
one extra pool layer at the rows' own slots. Every row of the step is written: a rejected draft's slot holds a
wrong key only until the forward that computes the token really at that position rewrites it, and no block reads
past the last verified position. Keys are functions of the prefix, so prefix-cache hits and retraction restore them
exactly, as the target's KV.

Then, for each request that produced tokens, one block forward: the last sampled token and dspark_block_size - 1
noise placeholders at the positions after the last verified one, attending to the last sliding_window context keys
and non-causally to each other. Rows are sampled in order with the Markov correction (greedy: argmax, a point
mass; sampled: a draw from q = softmax(corrected / temperature) with the request's seed, q reported for
rejection sampling), and the confidence head's survival probabilities sigma(c_1) >= ... become the per-draft
confidences the planner schedules verification by: c'_i = sigma(c_i) / sigma(c_{i-1}) (capped at 1), so
prod_{j<=i} c'_j is the predicted probability that drafts 1..i are all accepted. With fixed_length (batch-invariant
mode) the planner verifies every proposed draft instead. Verification (verify.py) is exact either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_rt.cache.kv_pool import KVLayout, slots_of
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.kernel_config import build_context
from deepinfer_rt.models.loader import finalize
from deepinfer_rt.models.release_names import from_release_name
from deepinfer_rt.request import Req
from deepinfer_rt.sampler import stream_seed
from deepinfer_rt.speculative.drafter import Drafter, Proposal
from deepinfer_rt.speculative.dspark_model import DSparkModel

_DRAFT_SALT = 0x6A09E667F3BCC909
"""Separates the drafter's draws from the target sampler's noise of the same (seed, position)."""


@dataclass
class _End:
    """A request that produced tokens this step: the block goes after `last`, the last verified position."""

    req: Req
    slots: list[int]
    """Pool slots of the context positions (the last sliding_window up to `last`)."""
    last: int
    seq: list[int]
    """The request's tokens with this step's emitted ones (seq[-1], at position last + 1, starts the block)."""


class FeatureCapture:
    """Called by each target layer with its input streams (T, N, H); `take` returns (T, targets * H).
    `mean_streams`: the drafter's (default or batch-invariant) mean over the streams."""

    def __init__(self, layer_ids: tuple[int, ...], mean_streams):
        self.layer_ids, self.mean_streams = layer_ids, mean_streams
        self._features: dict[int, torch.Tensor] = {}

    def __call__(self, layer_id: int, streams: torch.Tensor) -> None:
        self._features[layer_id] = self.mean_streams(streams)

    def take(self) -> torch.Tensor | None:
        if len(self._features) != len(self.layer_ids):
            self._features.clear()
            return None
        out = torch.cat([self._features[i] for i in self.layer_ids], dim=-1)
        self._features.clear()
        return out


def survival_to_confidences(survival: list[float]) -> list[float]:
    """Predicted P(drafts 1..i accepted) -> per-draft P(draft i accepted | drafts before it accepted)."""
    out, before = [], 1.0
    for s in survival:
        out.append(min(1.0, s / before) if before > 0 else 0.0)
        before = min(before, s)
    return out


def read_weights(path: Path):
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(("mtp.", "model.mtp.")):
                    yield name, sf.get_tensor(name)


class DSparkDrafter(Drafter):
    num_kv_layers = 1

    def __init__(self, net: DSparkModel, target, max_draft: int):
        self.net, self.max_draft = net, max_draft
        self.window = net.cfg.sliding_window
        self.layer = net.cfg.num_layers  # the pool layer after the target's
        self.capture = FeatureCapture(net.cfg.dspark_target_layer_ids, net.method.mean_streams)
        for layer in target.model.layers:
            if layer.spec.layer_id in net.cfg.dspark_target_layer_ids:
                layer.capture = self.capture
        self._proposals: dict[int, Proposal] = {}

    @classmethod
    def load(cls, model, config: ModelConfig, path: Path, load_format: str, seed: int, max_draft: int
             ) -> DSparkDrafter:
        if getattr(model, "v41", None) is None:
            raise ValueError("speculative='dspark' needs a DeepSeek-V4.1 model")
        if model.model.truncate_prefill:
            raise ValueError("speculative='dspark' reads target features of every prompt row: turn YOCO prefill "
                             "truncation (DEEPINFER_V41_YOCO_TRUNCATION) off")
        weights = [] if load_format == "dummy" else list(read_weights(path))
        if load_format != "dummy" and not weights:
            raise ValueError("speculative='dspark': the checkpoint has no mtp.* DSpark tensors")
        main_proj_fp8 = load_format == "dummy" or any(
            from_release_name(name).endswith("mtp.0.main_proj.weight_scale_inv") for name, _ in weights)
        with torch.device("cpu"), build_context(model.kernel_config):
            net = DSparkModel(config, model, main_proj_fp8)
        if load_format == "dummy":
            net.init_dummy(seed + 1)
        else:
            net.load_weights(iter(weights))
        p = next(model.parameters())
        return cls(finalize(net.to(device=p.device, dtype=p.dtype).eval()), model, max_draft)

    def kv_layout(self, layout: KVLayout) -> KVLayout:
        # A block reads the context keys of the last sliding_window positions up to the one before it.
        return layout.with_token_layer(self.net.key_width, self.window - 1)

    def propose(self, req: Req, k: int) -> Proposal | None:
        proposal = self._proposals.get(req.rid)
        return None if proposal is None else proposal.truncate(k)

    @torch.no_grad()
    def observe(self, runner, batch, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        features = self.capture.take()
        if features is None:
            raise RuntimeError("DSpark: the target forward captured no features (a CUDA-graph replay?)")
        pool, ps = runner.pool, runner.pool.page_size
        positions, out_slots, ends = [], [], []
        for i, item in enumerate(batch.items):
            req, start, n = item.req, item.start, item.num_new_tokens
            slots = slots_of(req.pages, start + n, ps)
            positions.extend(range(start, start + n))
            out_slots.extend(slots[start:])
            if i in emitted:
                valid = item.num_input_tokens + (len(emitted[i]) - 1 if item.draft_tokens else 0)
                last = start + valid - 1  # the last position whose target features are final
                lo = max(0, last - self.window + 1)
                ends.append(_End(req, slots[lo : last + 1], last, req.token_ids + emitted[i]))
        dev = pool.k[self.layer].device
        buf, rows = pool.token_rows(self.layer, torch.tensor(out_slots, device=dev))
        keys = self.net.context_keys(features, torch.tensor(positions, device=dev))
        buf[rows, : keys.shape[1]] = keys.to(buf.dtype)
        self._proposals = self._draft(runner, ends) if ends else {}

    def _draft(self, runner, ends) -> dict[int, Proposal]:
        pool, dev = runner.pool, runner.pool.k[self.layer].device
        num_ctx = max(len(e.slots) for e in ends)
        ctx_slots = torch.zeros(len(ends), num_ctx, dtype=torch.long)
        ctx_mask = torch.zeros(len(ends), num_ctx, dtype=torch.bool)
        for j, end in enumerate(ends):
            ctx_slots[j, : len(end.slots)] = torch.tensor(end.slots, dtype=torch.long)
            ctx_mask[j, : len(end.slots)] = True
        bonus = torch.tensor([e.seq[-1] for e in ends], device=dev)
        first = torch.tensor([e.last + 1 for e in ends], device=dev)
        buf, rows = pool.token_rows(self.layer, ctx_slots.to(dev), ctx_mask.to(dev))
        hidden = self.net(buf[rows, : self.net.key_width], ctx_mask.to(dev), bonus, first)  # (R, B, H)
        base = self.net.base_logits(hidden)[..., : runner.sampler.vocab_size]
        reqs = [e.req for e in ends]
        k = min(self.max_draft, self.net.block_size)
        prev, tokens, survival, probs = bonus, [], [], []
        for row in range(k):
            bias, embed = self.net.markov(prev)
            logits = base[:, row] + bias[:, : base.shape[-1]]
            survival.append(torch.sigmoid(self.net.confidence(hidden[:, row], embed)).tolist())
            d, q = self._pick(logits, reqs, row)
            tokens.append(d)
            probs.append(q)
            prev = torch.tensor(d, device=dev)
        out = {}
        for j, end in enumerate(ends):
            q = None if end.req.params.is_greedy else torch.stack([p[j] for p in probs])
            out[end.req.rid] = Proposal([t[j] for t in tokens], survival_to_confidences([s[j] for s in survival]),
                                        q, len(end.seq))
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, reqs: list[Req], row: int) -> tuple[list[int], torch.Tensor]:
        temps = torch.tensor([1.0 if r.params.is_greedy else r.params.temperature for r in reqs],
                             device=logits.device)
        probs = (logits.float() / temps[:, None]).softmax(-1)
        tokens = []
        for j, req in enumerate(reqs):
            if req.params.is_greedy:
                tokens.append(int(logits[j].argmax()))
            else:
                gen = torch.Generator(device=probs.device).manual_seed(
                    stream_seed(req.seed ^ _DRAFT_SALT, req.num_output_tokens * 16 + row))
                tokens.append(int(torch.multinomial(probs[j], 1, generator=gen)))
        return tokens, probs
