"""Kernel launches of one DeepSeek-V4 decode step, counted on the CPU: the tiny V4 checkpoint with the GPU's layer
methods (V4TritonMethod, its Triton kernels run by Triton's interpreter) beside the torch forms (V4Method), per
module. At batch 1 a V4 step is bound by launch count, not bytes (benchmark/README.md: ~265 kernels a layer on an
H100, most under 3 µs), so this is the figure the glue fusions move; the GPU timing is bench_v4_sweep.py's.

Counted: every torch op that runs a kernel (views, reshapes and allocations excluded) and every Triton launch,
attributed to the innermost module running it. The GPU runs a few more (its GEMMs split K, copies between dtypes
the CPU skips), so the counts compare methods, not devices.

    python benchmark/count_launches.py            # writes benchmark/results/v4_launches_cpu.json
    python benchmark/count_launches.py --model deepseek_v41 --out benchmark/results/v41_launches_cpu.json
    python benchmark/count_launches.py --graph --out benchmark/results/v4_graph_launches_cpu.json

--graph counts the step the GPU replays instead: an engine with the compact FP8 pool (the sweep's release-format
pool), the GPU methods, and its decode steps run as the CUDA-graph body uncaptured (cuda_graph.py is_captured=False:
placeholders, page appends, the forward over the static metadata, the head and the draw), one batch-1 step counted.
The metadata kernels and the FP8 row writes take their CUDA forms; the experts still run their CPU form (the GPU's
fused MoE is a few launches a layer) and the dense products run torch's matmul where the GPU may split K.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the Triton method's kernels run on the CPU

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from make_tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

from deepinfer_rt.cache.kv_pool import KVPool  # noqa: E402
from deepinfer_rt.forward_batch import ForwardBatch  # noqa: E402
from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend  # noqa: E402
from deepinfer_rt.models.deepseek_v4.methods import V4Method, V4TritonMethod  # noqa: E402
from deepinfer_rt.models.deepseek_v41.methods import V41Method, V41TritonMethod  # noqa: E402
from deepinfer_rt.models.loader import build_model, load_model_config  # noqa: E402

NO_KERNEL = {"view", "unsqueeze", "slice", "permute", "expand", "split", "select", "t", "unbind", "detach", "alias",
             "split_with_sizes", "_unsafe_view", "as_strided", "transpose", "squeeze", "reshape", "empty",
             "new_empty", "empty_like", "chunk", "narrow", "diagonal", "unflatten", "flatten", "lift_fresh",
             "_reshape_alias", "view_as_real", "empty_strided"}
"""Ops that run no kernel."""


class Counter:
    def __init__(self, model: torch.nn.Module):
        self.stack, self.counts, self.inside = [], collections.Counter(), False
        for name, mod in model.named_modules():
            mod.register_forward_pre_hook(lambda m, a, name=name: self.stack.append(name))
            mod.register_forward_hook(self._leave)

    def _leave(self, module, args, out) -> None:  # None: the module's output stands
        self.stack.pop()

    def where(self) -> str:
        return re.sub(r"layers\.\d+", "layers.N", self.stack[-1]) if self.stack else "(model)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmark/results/v4_launches_cpu.json"))
    parser.add_argument("--context", type=int, default=35, help="prompt tokens before the counted decode step")
    parser.add_argument("--model", default="deepseek_v4", choices=["deepseek_v4", "deepseek_v41"])
    parser.add_argument("--graph", action="store_true", help="count the graph step (see the module doc)")
    args = parser.parse_args()

    path = make_tiny_checkpoint(args.model, Path(tempfile.mkdtemp()), seed=0)
    active: list[Counter] = []  # the counter of the model being counted
    launch = interpreter.GridExecutor.__call__

    def counted_launch(executor, *a, **k):
        counter = active[-1]
        counter.counts[(counter.where(), "triton:" + getattr(executor.fn, "__name__", "?"))] += 1
        counter.inside = True  # the interpreter's own tensor work is not the kernel's launches
        try:
            return launch(executor, *a, **k)
        finally:
            counter.inside = False

    interpreter.GridExecutor.__call__ = counted_launch

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            counter = active[-1]
            if not counter.inside and name not in NO_KERNEL:
                counter.counts[(counter.where(), name)] += 1
            return func(*args, **(kwargs or {}))

    def summary(counts: collections.Counter) -> dict:
        by_module = collections.Counter()
        for (where, _), n in counts.items():
            by_module[where] += n
        return {"launches": sum(counts.values()), "by_module": dict(by_module.most_common()),
                "by_op": {f"{w} {op}": n for (w, op), n in counts.most_common()}}

    name = {"deepseek_v4": "DeepSeek-V4", "deepseek_v41": "DeepSeek-V4.1"}[args.model]
    if args.graph:
        rows = {"GPU methods (graph step, compact FP8 pool)": graph_step(path, active, Ops, summary)}
        layers = len(rows[next(iter(rows))].pop("layers"))
        print(f"graph step: {rows[next(iter(rows))]['launches']} launches in one decode step of {layers} layers")
        out = {"model": f"tiny {name} (scripts/make_tiny_checkpoint.py, seed 0), bf16, batch 1, graph step",
               "layers": layers, "methods": rows}
        Path(args.out).write_text(json.dumps(out, indent=1))
        return

    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.bfloat16, torch.device("cpu"), seed=0)
    active.append(Counter(model))
    counter = active[-1]

    def step(start: int, end: int, pool: KVPool, count: bool) -> None:
        backend = TorchRefBackend()
        tokens = torch.arange(100, 100 + end)
        slots = torch.arange(end)
        batch = ForwardBatch(input_ids=tokens[start:end], positions=torch.arange(start, end), out_slots=slots[start:end],
                             q_lens=[end - start], kv_lens=[end], kv_slots=[slots], pool=pool, backend=backend)
        backend.prepare(batch)
        with torch.no_grad():
            if count:
                with Ops():
                    model.prepare_batch(batch)
                    model.compute_logits(model(batch))
            else:
                model.prepare_batch(batch)
                model.compute_logits(model(batch))

    rows = {}
    for label, cls, cls41 in (("torch forms (V4Method)", V4Method, V41Method),
                              ("GPU methods (V4TritonMethod)", V4TritonMethod, V41TritonMethod)):
        _use_methods(model, cls, cls41)
        pool = KVPool(model.kv_layout(config), args.context + 8, 1, torch.bfloat16, torch.device("cpu"))
        step(0, args.context, pool, count=False)
        counter.counts.clear()
        step(args.context, args.context + 1, pool, count=True)
        rows[label] = summary(counter.counts)
        print(f"{label}: {rows[label]['launches']} launches in one decode step of {len(model.model.layers)} layers")
    first, second = rows.values()
    print(f"GPU methods / torch forms: {second['launches'] / first['launches']:.2f}")
    out = {"model": f"tiny {name} (scripts/make_tiny_checkpoint.py, seed 0), bf16, batch 1",
           "context": args.context, "layers": len(model.model.layers), "methods": rows}
    Path(args.out).write_text(json.dumps(out, indent=1))


def graph_step(path: Path, active: list, ops, summary) -> dict:
    """Launches of one batch-1 decode step of the graph body (see the module doc)."""
    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.cuda_graph import CudaGraphRunner

    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows
    from deepinfer_rt.models.deepseek_v4.graph_batch import StaticDecode

    StaticDecode.for_step = StaticDecode.kernel_step  # the metadata kernels, as on CUDA
    Fp8Rows.write = Fp8Rows.store_rows  # an FP8 row write in one launch, as on CUDA
    counts = []
    with Engine(str(path), dtype="bfloat16", kv_cache_tokens=1024, max_num_seqs=2, page_size=4,
                kv_cache_dtype="fp8_e4m3") as engine:
        model = engine.model
        _use_methods(model, V4TritonMethod, V41TritonMethod)
        runner = engine.executor
        graphs = CudaGraphRunner(model, engine.pool, None, 1, engine.model_config.max_position, batch_sizes=(1,),
                                 num_rows=runner.pages.table.shape[0], is_captured=False,
                                 head=model.compute_logits, vocab_size=engine.sampler.vocab_size)
        runner.graphs, runner.pages = graphs, graphs.pages
        active.append(Counter(model))
        body = graphs._body

        def counted(bs, fb):
            active[-1].counts.clear()
            with torch.no_grad(), ops():
                body(bs, fb)
            counts.append(collections.Counter(active[-1].counts))

        graphs._body = counted
        params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
        engine.generate(input_ids=[list(range(100, 135))], sampling_params=params)
        layers = list(model.model.layers)
    assert counts, "no decode step ran in the graph body"
    return {**summary(counts[-1]), "layers": layers}


def _use_methods(model, cls, cls41) -> None:
    """Every V4 / V4.1 layer method of the model as cls / cls41 (the torch forms or the GPU methods)."""
    for mod in model.modules():
        m = getattr(mod, "method", None)
        if isinstance(m, V4Method):
            mod.method = cls(m.linear, m.activation, m.head_matmul)
        elif isinstance(m, V41Method):  # V4.1's attention methods, over a V4 method of the same kind
            mod.method = cls41(cls(m.v4.linear, m.v4.activation, m.v4.head_matmul))


if __name__ == "__main__":
    main()
