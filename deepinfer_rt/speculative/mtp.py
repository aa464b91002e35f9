"""DeepSeek multi-token prediction (MTP) head as a drafter.

The checkpoint stores `num_nextn_predict_layers` MTP layers after the main stack (`model.layers.{N}.*`, N =
num_hidden_layers). One layer maps (token t_{j+1}, target hidden h_j) at position j to a prediction of t_{j+2}:

    x = eh_proj([enorm(embed(t_{j+1})) | hnorm(h_j)]);  x = decoder_layer(x);  logits = head(shared_head.norm(x))

embed and head are shared with the target (the checkpoint's copies are identical and not loaded); h_j is the
target's output hidden state (after its final norm, as vLLM and SGLang feed it). The decoder layer attends over
its own KV, kept in one extra pool layer at the same slots as the target's: after every target forward the
layer runs over each position the step computed (`observe`), so its KV stays complete for every computed
token (prefix-cache hits included). Drafts chain the layer on its own output: d1 from the last position, then
(d_i, x_i) at the next position -> d_{i+1}, with the chain's KV in scratch pages freed right after.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from deepinfer_rt.cache.kv_pool import slots_of
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.kernel_config import build_context, current_kernel_config
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.layers.methods import linear_method
from deepinfer_rt.layers.mla import MLAttention
from deepinfer_rt.layers.mlp import GatedMLP
from deepinfer_rt.layers.moe import MoE, fuse_expert_weights
from deepinfer_rt.layers.norm import RMSNorm
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.blocks import DecoderLayer
from deepinfer_rt.models.deepseek_v3 import DeepseekV3ForCausalLM, is_moe_layer
from deepinfer_rt.models.loader import finalize
from deepinfer_rt.request import Req
from deepinfer_rt.sampler import stream_seed
from deepinfer_rt.speculative.drafter import Drafter, Proposal

_DRAFT_SALT = 0x2545F4914F6CDD1D
"""Separates the drafter's draws from the target sampler's noise of the same (seed, position)."""


class MTPLayer(DecoderLayer):
    """Checkpoint names below `model.layers.{N}.`: the decoder layer's own plus enorm, hnorm, eh_proj and
    shared_head.norm. In an FP8 checkpoint the decoder layer is FP8 like the target's; eh_proj is 16-bit in the
    V3 / R1 releases (vLLM and SGLang build it unquantized), so it takes the quantized method only where the
    checkpoint ships its scale (eh_fp8)."""

    def __init__(self, config: ModelConfig, eh_fp8: bool = False):
        layer_id = config.num_layers
        mlp = MoE(config) if is_moe_layer(config, layer_id) else GatedMLP(config.hidden_size,
                                                                          config.intermediate_size)
        super().__init__(config, MLAttention(config, layer_id), mlp)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        kept = None if eh_fp8 else linear_method(current_kernel_config())
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, method=kept)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekMTP(CausalLM):
    packed_modules = DeepseekV3ForCausalLM.packed_modules
    ignored_weights = ("rotary_emb.inv_freq", "embed_tokens.", "shared_head.head.")

    def __init__(self, config: ModelConfig, target: CausalLM, eh_fp8: bool = False):
        super().__init__(config)
        self.layer = MTPLayer(config, eh_fp8)
        self._target = (target,)  # a tuple: embed and head stay the target's parameters, not ours

    def forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor) -> torch.Tensor:
        """batch.input_ids: the token after each position; prev_hidden (T, H): the hidden state of it."""
        layer = self.layer
        e = layer.enorm(self._target[0].model.embed_tokens(batch.input_ids))
        return layer(layer.eh_proj(torch.cat([e, layer.hnorm(prev_hidden)], dim=-1)), batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].lm_head(self.layer.shared_head.norm(hidden)).float()


def check_has_mtp(config: ModelConfig) -> None:
    if not config.is_mla or config.raw.get("num_nextn_predict_layers", 0) < 1:
        raise ValueError("speculative='mtp' needs a DeepSeek-V3 model with num_nextn_predict_layers >= 1")


def mtp_weights(path: Path, layer_id: int):
    """(name below the MTP layer, tensor) for every checkpoint tensor of model.layers.{layer_id}."""
    prefix = f"model.layers.{layer_id}."
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(prefix):
                    yield "layer." + name[len(prefix):], sf.get_tensor(name)


class MTPDrafter(Drafter):
    num_kv_layers = 1

    def __init__(self, mtp: DeepseekMTP, max_draft: int):
        self.mtp = mtp
        self.max_draft = max_draft
        self._proposals: dict[int, Proposal] = {}

    @classmethod
    def load(cls, model: CausalLM, config: ModelConfig, path: Path, load_format: str, seed: int,
             max_draft: int, shard=None) -> MTPDrafter:
        """`shard` (an EP rank's models.loader.Shard): the layer's MoE keeps this rank's experts and joins the
        rank group's dispatch/combine, as the target's MoE layers do."""
        check_has_mtp(config)
        weights = [] if load_format == "dummy" else list(mtp_weights(path, config.num_layers))
        if load_format != "dummy" and not weights:
            raise ValueError(f"speculative='mtp': the checkpoint has no MTP layer model.layers."
                             f"{config.num_layers}.* (use load_format='dummy' or prompt_lookup)")
        eh_fp8 = any(name == "layer.eh_proj.weight_scale_inv" for name, _ in weights)
        with torch.device("cpu"), build_context(model.kernel_config):  # the target's modes
            mtp = DeepseekMTP(config, model, eh_fp8)
        if shard is not None:
            shard(mtp, torch.device("cpu"), torch.get_default_dtype())
        if load_format == "dummy":
            shard.init_dummy(mtp, seed + 1) if shard is not None else mtp.init_dummy(seed + 1)
        else:
            mtp.load_weights(fuse_expert_weights(iter(weights), config.n_routed_experts))
        p = next(model.parameters())
        return cls(finalize(mtp.to(device=p.device, dtype=p.dtype).eval()), max_draft)

    def propose(self, req: Req, k: int) -> Proposal | None:
        proposal = self._proposals.get(req.rid)
        return None if proposal is None else proposal.truncate(k)

    @torch.no_grad()
    def observe(self, runner, batch, hidden: torch.Tensor, emitted: dict[int, list[int]]) -> None:
        """Extend the MTP KV over every position this step computed, then draft for the items that sampled."""
        ps = runner.pool.page_size
        ids, positions, out_slots, q_lens, kv_lens, kv_slots, rows, ends = [], [], [], [], [], [], [], []
        row = out_row = 0
        for i, item in enumerate(batch.items):
            req, start, n = item.req, item.start, item.num_new_tokens
            # Verified tokens: the inputs, plus the drafts accepted (an item with drafts emits accepted + 1).
            valid = item.num_input_tokens + (len(emitted.get(i, ())) - 1 if item.draft_tokens else 0)
            seq = req.token_ids + emitted.get(i, [])
            slots = slots_of(req.pages, start + valid, ps)
            ids.extend(seq[start + 1 : start + valid + 1])
            positions.extend(range(start, start + valid))
            out_slots.extend(slots[start:])
            q_lens.append(valid)
            kv_lens.append(start + valid)
            kv_slots.append(slots)
            rows.extend(range(row, row + valid))
            row += n
            out_row += valid
            if i in emitted:
                ends.append((req, out_row - 1, slots, len(seq)))
        fb = runner.forward_batch(ids, positions, out_slots, q_lens, kv_lens, kv_slots)
        x = self.mtp(fb, hidden[rows])
        self._proposals = self._draft(runner, ends, x) if ends else {}

    def _draft(self, runner, ends, x: torch.Tensor) -> dict[int, Proposal]:
        k = self.max_draft
        allocator, ps = runner.pool.allocator, runner.pool.page_size
        scratch_pages = allocator.alloc(-(-len(ends) * (k - 1) // ps)) if k > 1 else None
        if scratch_pages is None:
            k = 1
        scratch = slots_of(scratch_pages or [], len(ends) * (k - 1), ps)
        h = x[[r for _, r, _, _ in ends]]
        reqs = [req for req, _, _, _ in ends]
        tokens, confs, probs = [], [], []
        try:
            for step in range(k):
                if step:
                    h = self._chain_step(runner, ends, scratch, k, step, tokens[-1], h)
                d, c, q = self._pick(self.mtp.compute_logits(h)[:, : runner.sampler.vocab_size], reqs, step)
                tokens.append(d)
                confs.append(c)
                probs.append(q)
        finally:
            if scratch_pages:
                allocator.decref(scratch_pages)
        out = {}
        for j, (req, _, _, num_tokens) in enumerate(ends):
            q = None if req.params.is_greedy else torch.stack([p[j] for p in probs])
            out[req.rid] = Proposal([t[j] for t in tokens], [c[j] for c in confs], q, num_tokens)
        return out

    def _chain_step(self, runner, ends, scratch, k, step, prev_tokens, h) -> torch.Tensor:
        """Run the layer on (d_step, x) at the position after the last one; its KV goes to scratch slots."""
        positions, out_slots, kv_lens, kv_slots = [], [], [], []
        for j, (_, _, slots, num_tokens) in enumerate(ends):
            own = scratch[j * (k - 1) : j * (k - 1) + step]
            positions.append(num_tokens - 2 + step)
            out_slots.append(own[-1])
            kv_slots.append(slots + own)
            kv_lens.append(len(slots) + step)
        fb = runner.forward_batch(prev_tokens, positions, out_slots, [1] * len(ends), kv_lens, kv_slots)
        return self.mtp(fb, h)

    def _pick(self, logits: torch.Tensor, reqs: list[Req], step: int):
        """Greedy requests draft the argmax (a point mass); sampled ones draw from q = softmax(logits / T)
        with the request's seed, reporting q for rejection sampling. Confidence: q(draft)."""
        tokens, confs, qs = [], [], []
        temps = torch.tensor([1.0 if r.params.is_greedy else r.params.temperature for r in reqs],
                             device=logits.device)
        probs = (logits / temps[:, None]).softmax(-1)
        for j, req in enumerate(reqs):
            q = probs[j]
            if req.params.is_greedy:
                d = int(q.argmax())
            else:
                gen = torch.Generator(device=q.device).manual_seed(
                    stream_seed(req.seed ^ _DRAFT_SALT, req.num_output_tokens * 8 + step))
                d = int(torch.multinomial(q, 1, generator=gen))
            tokens.append(d)
            confs.append(float(q[d]))
            qs.append(q)
        return tokens, confs, qs

