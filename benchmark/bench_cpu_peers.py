"""The embedded default on CPU beside the engines CPU users pick, on the same prompts, in one run.

    python benchmark/bench_cpu_peers.py [--repeats 3] [--new-tokens 128] [--batch 32] [--prefill-tokens 1000]

Systems: this engine in fp32, bf16 (eager, and compiled: DEEPINFER_CPU_COMPILE, models/llama_compiled.py; also
ours-fp32-compiled on request; ours-bf16-mv / -linear / -packed force a lone row's product, DEEPINFER_CPU_BF16_GEMV,
where ours-bf16 takes `auto`), weight-only int8 and Q4_1 (bf16 activations); transformers `generate` in fp32 and
bf16; llama.cpp through llama-cpp-python on the shipped GGUF when that package is installed (skipped with a message
otherwise). Workloads (greedy, EOS ignored so every system does the same work):

    single    one ~100-token prompt, 128 new tokens          tok/s = new tokens / time
    batch     32 ~100-token prompts, 128 new tokens each     tok/s = all new tokens / time
    prefill   one 1,000-token prompt, 1 new token            tok/s = prompt tokens / time
    long      (--long-context N) one N-token prompt, --long-new-tokens new tokens: decode tok/s at that context,
              timed from the first new token to the last (each system's own streaming: the engine's text
              deltas, llama.cpp's token generator, transformers' streamer)

Every repeat runs every system once per workload, interleaved (the machine is shared and noisy); the figure is
the median of the repeats. Also reported: how many of each system's single-stream tokens equal transformers'
fp32 ones before the first that differs (greedy agreement), and ratios to transformers fp32. Writes benchmark/results/cpu_peers.json.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.layers.kernel_config import cpu_has_native_bf16
from deepinfer_rt.models.loader import resolve_model_path

SENTENCE = ("The harbour town woke slowly: fishermen mended nets, the baker opened his shutters, and gulls "
            "argued over the morning catch while the lighthouse keeper climbed the stairs. ")


def make_prompts(tokenizer, n: int, num_tokens: int) -> list[list[int]]:
    """n distinct prompts of exactly num_tokens tokens."""
    out = []
    for i in range(n):
        ids = tokenizer.encode(f"Story {i}. " + SENTENCE * (num_tokens // 20 + 2))
        out.append(ids[:num_tokens])
    return out


class Ours:
    def __init__(self, name: str, dtype: str, quantization: str | None, kv_tokens: int, compiled: bool = False,
                 gemv: str = "auto"):
        self.name = name
        # DEEPINFER_CPU_COMPILE is read when the engine is built, DEEPINFER_CPU_BF16_GEMV at its first step
        settings = {"DEEPINFER_CPU_COMPILE": "1" if compiled else "0", "DEEPINFER_CPU_BF16_GEMV": gemv}
        previous = {key: os.environ.get(key) for key in settings}
        os.environ.update(settings)
        try:
            self.engine = Engine("smollm2-135m-instruct", dtype=dtype, quantization=quantization,
                                 kv_cache_tokens=kv_tokens, enable_prefix_cache=False)
            self.generate([[1, 2, 3]], 1)
        finally:
            for key, value in previous.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        return [o.token_ids for o in self.engine.generate(input_ids=prompts, sampling_params=sp)]

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """Decode tok/s after the first new token: the time from the first text delta to the end."""
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        first = None
        for _ in self.engine.stream(input_ids=prompt, sampling_params=sp):
            first = first or time.perf_counter()
        return (new_tokens - 1) / (time.perf_counter() - first)


class Transformers:
    def __init__(self, name: str, dtype: torch.dtype, path: Path, pad_id: int):
        from transformers import AutoModelForCausalLM

        self.name = name
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.pad_id = pad_id

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id)
        return out[:, width:].tolist()

    @torch.no_grad()
    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        stamps = []

        class Streamer:  # generate calls put() with the prompt, then with each new token
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        self.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=self.pad_id, streamer=Streamer())
        return (len(stamps) - 2) / (stamps[-1] - stamps[1])


class LlamaCpp:
    def __init__(self, name: str, gguf: Path, n_ctx: int, extra_buffer_types: bool = False):
        import llama_cpp
        import llama_cpp.llama

        self.name = name
        # llama.cpp's extra buffer types (weights repacked for AMX / wider SIMD) die with SIGILL on a machine whose
        # kernel does not grant AMX tile use (this one): off by default, its plain CPU kernels run instead.
        default_params = llama_cpp.llama_model_default_params

        def model_params():
            params = default_params()
            params.use_extra_bufts = extra_buffer_types
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = model_params
        try:
            self.llm = llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=torch.get_num_threads(), verbose=False)
        finally:
            llama_cpp.llama.llama_cpp.llama_model_default_params = default_params

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        outs = []
        for p in prompts:  # the Python binding runs one sequence at a time
            self.llm.reset()
            tokens = []
            for tok in self.llm.generate(p, temp=0.0, reset=True):
                tokens.append(tok)
                if len(tokens) == new_tokens:
                    break
            outs.append(tokens)
        return outs

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        self.llm.reset()
        stamps = []
        for _ in self.llm.generate(prompt, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == new_tokens:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def report(args, systems, workloads, runs, single_tokens, notes, repeats_done: int) -> None:
    """Print the table and write the JSON (after every repeat: an interrupted run keeps what it measured)."""
    result = {
        "benchmark": "cpu_peers", "model": "smollm2-135m-instruct", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "cpu_native_bf16": cpu_has_native_bf16(), "repeats": repeats_done, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "batch": args.batch, "prefill_tokens": args.prefill_tokens,
        "long_context": args.long_context, "long_new_tokens": args.long_new_tokens, "notes": notes,
        "command": "python benchmark/bench_cpu_peers.py " + " ".join(sys.argv[1:]), "systems": {},
        "load_average": os.getloadavg(),
    }
    ref = single_tokens.get("hf-fp32")
    print(f"\n{'system':16s} " + " ".join(f"{w:>9s}" for w in workloads) + f"   (tok/s, median of {repeats_done}; "
          "x = ratio to hf-fp32; agree = share of single-stream tokens before the first one unlike hf-fp32's)")
    for s in systems:
        med = {w: statistics.median(r) for w, r in runs[s.name].items()}
        entry = {"tok_s": med, "runs": runs[s.name]}
        if ref is not None:
            entry["greedy_agreement_with_hf_fp32"] = common_prefix(single_tokens[s.name], ref) / len(ref)
            entry["ratio_to_hf_fp32"] = {w: med[w] / statistics.median(runs["hf-fp32"][w]) for w in workloads}
        result["systems"][s.name] = entry
        ratio = entry.get("ratio_to_hf_fp32", {})
        print(f"{s.name:16s} " + " ".join(f"{med[w]:9.1f}" for w in workloads)
              + ("   x " + " ".join(f"{ratio[w]:.2f}" for w in workloads) if ratio else "")
              + (f"   agree {entry['greedy_agreement_with_hf_fp32']:.2f}" if ref is not None else ""))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--long-context", type=int, default=0,
                    help="add the 'long' workload: decode at a prompt of this many tokens (0: off)")
    ap.add_argument("--long-new-tokens", type=int, default=128)
    ap.add_argument("--systems", default="ours-fp32,ours-bf16,ours-bf16-compiled,ours-int8,ours-q4_1,hf-fp32,hf-bf16,"
                                          "llama.cpp")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_peers.json"))
    args = ap.parse_args()
    wanted = args.systems.split(",")
    kv_tokens = (args.batch * (args.prompt_tokens + args.new_tokens) + args.prefill_tokens + 256
                 + args.long_context + args.long_new_tokens)
    systems = []
    for name, dtype, quant in (("ours-fp32", "float32", None), ("ours-bf16", "bfloat16", None),
                               ("ours-bf16-mv", "bfloat16", None), ("ours-bf16-linear", "bfloat16", None),
                               ("ours-bf16-packed", "bfloat16", None),
                               ("ours-fp32-compiled", "float32", None), ("ours-bf16-compiled", "bfloat16", None),
                               ("ours-int8", "bfloat16", "int8"), ("ours-q4_1", "bfloat16", "q4_1")):
        if name in wanted:  # -mv / -linear / -packed: DEEPINFER_CPU_BF16_GEMV forced (ours-bf16 takes `auto`)
            gemv = name.rsplit("-", 1)[1] if name.endswith(("-mv", "-linear", "-packed")) else "auto"
            systems.append(Ours(name, dtype, quant, kv_tokens, compiled=name.endswith("-compiled"), gemv=gemv))
    tokenizer = (systems[0].engine.tokenizer if systems else None)
    path = resolve_model_path("smollm2-135m-instruct")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for name, dtype in (("hf-fp32", torch.float32), ("hf-bf16", torch.bfloat16)):
        if name in wanted:
            systems.append(Transformers(name, dtype, path, pad))
    notes = []
    if "llama.cpp" in wanted:
        if importlib.util.find_spec("llama_cpp") is None:
            notes.append("llama.cpp skipped: llama-cpp-python is not installed (PyPI has no wheel for this "
                         "platform; building it from source does not fit this run)")
            print(notes[-1])
        else:
            from gguf_unquantized import unquantized_gguf

            from deepinfer_rt.models.smollm2 import gguf_path

            systems.append(LlamaCpp("llama.cpp-q4_1", gguf_path(), kv_tokens))
            for kind in ("f32", "bf16"):  # the same weights as ours-fp32 / ours-bf16 (gguf_unquantized.py)
                systems.append(LlamaCpp(f"llama.cpp-{kind}", unquantized_gguf(kind), kv_tokens))
            notes.append("llama.cpp: llama-cpp-python " + importlib.metadata.version("llama_cpp_python")
                         + ", the shipped Q4_1 GGUF and that file dequantized to F32 / BF16 "
                         "(benchmark/gguf_unquantized.py), extra buffer types (AMX repacking) off; the binding runs "
                         "one sequence at a time, so its batch column is sequential")
    prompts = make_prompts(tokenizer, args.batch, args.prompt_tokens)
    long_prompt = make_prompts(tokenizer, 1, args.prefill_tokens)
    workloads = {"single": (prompts[:1], args.new_tokens), "batch": (prompts, args.new_tokens),
                 "prefill": (long_prompt, 1)}
    if args.long_context:
        workloads["long"] = (make_prompts(tokenizer, 1, args.long_context), args.long_new_tokens)
    for s in systems:  # warm-up: first-call costs (allocations, oneDNN kernel selection) out of the timings
        s.generate(prompts[:2], 4)
    runs = {s.name: {w: [] for w in workloads} for s in systems}
    single_tokens = {}
    for rep in range(args.repeats):
        for wname, (batch, new) in workloads.items():
            for s in systems:
                if wname == "long":
                    rate = s.decode_rate(batch[0], new)
                    runs[s.name][wname].append(rate)
                    print(f"repeat {rep} {wname:8s} {s.name:16s} {rate:8.1f} tok/s", flush=True)
                    continue
                t = time.perf_counter()
                out = s.generate(batch, new)
                elapsed = time.perf_counter() - t
                count = sum(map(len, batch)) if wname == "prefill" else sum(map(len, out))
                runs[s.name][wname].append(count / elapsed)
                if wname == "single":
                    single_tokens[s.name] = out[0]
                print(f"repeat {rep} {wname:8s} {s.name:16s} {count / elapsed:8.1f} tok/s", flush=True)
        report(args, systems, workloads, runs, single_tokens, notes, rep + 1)
    for s in systems:
        if isinstance(s, Ours):
            s.engine.shutdown()


if __name__ == "__main__":
    main()
