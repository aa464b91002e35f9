"""Model contract.

A model is a short composition of shared blocks whose attribute names match the HF checkpoint keys, so that
loading is mostly name identity. Fused parameters list their HF sources in `packed_modules`:
(fused fragment, HF fragment, shard id), e.g. ("qkv_proj", "q_proj", "q").

    prepare_batch(batch)                        once per step, after the attention backend's prepare: the
                                                per-step metadata the model's layers share (kept on the batch;
                                                layers never build or cache per-batch state themselves)
    forward(batch) -> hidden (T, hidden)        over a flattened varlen batch (ForwardBatch)
    prepare_graph_batch(batch, seq_lens)        a CUDA-graph decode step's metadata over its static inputs
                                                (cuda_graph.py), once at capture; prepare_graph_step(pool,
                                                reqs, positions): the host's part of each such step, before
                                                its replay
    compute_logits(hidden) -> (N, vocab) fp32   only for the rows the sampler needs
    kv_layout(config) -> KVLayout               what the pool stores per token and layer

A model is built inside `layers.kernel_config.build_context(kernel_config)` (models.loader.build_model): its
layers take their methods from that KernelConfig when constructed, and the model keeps it as `kernel_config`.
"""
from __future__ import annotations

from typing import ClassVar, Iterable

import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVLayout
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.int8 import head_method


class CausalLM(nn.Module):
    packed_modules: ClassVar[list[tuple[str, str, str]]] = []
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    """Checkpoint name fragments that are not parameters here (buffers, heads we do not run)."""
    supports_cuda_graphs: ClassVar[bool] = True
    """Whether a decode step reads only the attention backend's graph-static metadata (CUDA-graph capture)."""
    supports_overlap: bool = True
    """Whether a step's token ids may still be placeholders on the host when the model prepares it (overlap
    scheduling resolves them on the device); False for a model that reads the ids on the host (V4.1's Engram
    hashing)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.kernel_config = current_kernel_config()
        """The modes the layers were built for (layers/kernel_config.py)."""
        self.logits_method = head_method(self.kernel_config)

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        raise NotImplementedError

    def prepare_batch(self, batch: ForwardBatch) -> None:
        """Build the step's model metadata on `batch` (called by the runner after backend.prepare)."""

    def prepare_graph_batch(self, batch: ForwardBatch, seq_lens: torch.Tensor) -> None:
        """The metadata of a captured decode step (deepinfer_rt/cuda_graph.py), built once at capture over the
        graph's static device inputs: batch.input_ids / positions / out_slots, batch.pages (the page table and
        each row's table row) and seq_lens (B,) (0 for padding rows); q_lens / kv_lens are placeholders. Only the
        forward is captured, so a model whose indices depend on those inputs' values computes them in forward.
        By default the eager prepare_batch, for models whose metadata is the backend's (graph-static)."""
        self.prepare_batch(batch)

    def prepare_graph_step(self, pool, reqs: list, positions: list[int]) -> None:
        """Host work of one captured decode step before its replay (request i computes position positions[i]
        over reqs[i].pages): none by default; it may not read device values back."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_method.apply(self.lm_head, hidden).float()

    def process_weights_after_loading(self) -> None:
        """The head's layout for its method (an int8 head of a weight-only quantized model), once the weights are
        final: called by the loader's finalize after every module inside."""
        prepare = getattr(self.logits_method, "prepare_head", None)
        if prepare is not None:
            prepare(self.lm_head if hasattr(self, "lm_head") else self.head)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            checkpoint_name = name
            if any(frag in name for frag in self.ignored_weights):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            shard = None
            for fused, hf, shard_id in self.packed_modules:
                if f".{hf}." in name:
                    name, shard = name.replace(f".{hf}.", f".{fused}."), shard_id
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                try:
                    loader(param, tensor, shard) if shard is not None else loader(param, tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {checkpoint_name!r}: {e}") from e
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(name)
        missing = [n for n in params if n not in loaded and not self._is_tied(n)]
        if missing:
            raise ValueError(f"checkpoint lacks parameters: {missing[:8]}{'...' if len(missing) > 8 else ''}")

    def _is_tied(self, name: str) -> bool:
        return self.config.tie_word_embeddings and name == "lm_head.weight"

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_dummy(self, seed: int) -> None:
        """Random weights from the config alone (load_format='dummy'): normal(0, 0.02), norms at 1. Drawn on
        the parameters' device (the values depend on the seed and the device type). FP8 weights (an FP8
        checkpoint's config) draw normal(0, 1) with every block scale 0.02: the same spread once dequantized; e8m0
        byte scales (MXFP4 experts kept packed, FP8 Engram tables) are 2^-6, their packed codes random bytes.
        Tensors past DUMMY_DRAW_ELEMENTS draw in blocks of leading slices (_draw_normal)."""
        gen = None
        params = dict(self.named_parameters())
        for name, p in params.items():
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("_scale_inv") and p.dtype == torch.uint8:  # raw e8m0 bytes (MXFP4, Engram)
                p.fill_(127 - 6)  # 2^-6, the power of two nearest 0.02
            elif name.endswith("_scale_inv"):
                p.fill_(0.02)
            elif name + "_scale_inv" in params and p.dtype == torch.int8:  # packed e2m1 pairs: any byte
                p.copy_(torch.randint(-128, 128, p.shape, generator=gen, dtype=torch.int8, device=p.device))
            else:  # FP8 values (or their exact copy) of a block-scaled weight: normal(0, 1); the rest 0.02 of it
                _draw_normal(p, gen, 1.0 if name + "_scale_inv" in params else 0.02)


DUMMY_DRAW_ELEMENTS = 1 << 28
"""init_dummy draws a larger tensor in blocks of leading slices of about this many elements: a whole draw is an fp32
temporary of the tensor's size (DeepSeek-V3's 256 experts' gate_up: 28 GiB beside the 28 GiB parameter)."""


def _draw_normal(p: torch.Tensor, gen: torch.Generator, std: float) -> None:
    if p.numel() <= DUMMY_DRAW_ELEMENTS or p.dim() < 2 or p.shape[0] == 1 and p.dim() == 2:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32, device=p.device).mul_(std))
        return
    per_block = max(1, DUMMY_DRAW_ELEMENTS // p[0].numel())
    for block in p.split(per_block):
        if per_block == 1:  # one slice is past the bound itself: its own slices
            _draw_normal(block[0], gen, std)
        else:
            block.copy_(torch.randn(block.shape, generator=gen, dtype=torch.float32, device=p.device).mul_(std))
