"""Command line: `deepinfer generate`, `deepinfer serve`, `deepinfer batch`, `deepinfer --version`.

Every Engine option is a flag of each command (ENGINE_OPTIONS, checked against Engine.__init__ by a test). What a
user can fix (a missing extra, a torch without CUDA, a model that is not on this machine, bad arguments) ends in
one line naming the fix, never a traceback. Nothing here reaches the network: a hub id resolves only through the
local Hugging Face cache.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass

from deepinfer_rt.preflight import CliError, require_extra, resolve_device, resolve_local_model

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineOption:
    name: str
    """Engine.__init__ parameter."""
    default: object
    help: str
    type: type | None = None
    choices: tuple | None = None


ENGINE_OPTIONS = (
    EngineOption("model", DEFAULT_MODEL, "the embedded default model, a local Hugging Face folder (config.json + "
                 "*.safetensors) or a hub id already in the local Hugging Face cache", str),
    EngineOption("dtype", "auto", "weights, activations and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)", str,
                 ("auto", "float32", "bfloat16", "float16")),
    EngineOption("device", "auto", "cpu, cuda or cuda:N (auto: cuda when a GPU is visible, else cpu)", str),
    EngineOption("load_format", "auto", "auto: the checkpoint's weights; dummy: random weights from config.json",
                 str, ("auto", "dummy")),
    EngineOption("max_num_seqs", 256, "most sequences running at once", int),
    EngineOption("kv_cache_tokens", None, "KV pool size in tokens (default: from --kv-cache-memory-fraction)",
                 int),
    EngineOption("kv_cache_dtype", "auto", "KV cache storage: auto (the model dtype), fp8_e4m3 (float8 rows with "
                 "a float32 scale per token and KV head: about twice the tokens per byte) or fp4_e2m1 (DeepSeek-V4.1: "
                 "MXFP4 entries and index keys, FP8 sliding keys)", str, ("auto", "fp8_e4m3", "fp4_e2m1")),
    EngineOption("page_size", 1, "tokens per KV page", int),
    EngineOption("chunked_prefill_tokens", 2048, "token budget of one step (prompts are prefilled in chunks of "
                 "at most this many tokens)", int),
    EngineOption("enable_prefix_cache", True, "reuse KV of shared prompt prefixes (radix cache)"),
    EngineOption("schedule_policy", "lpm", "order of waiting requests: lpm (longest prefix match) or fcfs", str,
                 ("lpm", "fcfs")),
    EngineOption("batch_invariant", False, "bitwise-identical outputs whatever shares the batch"),
    EngineOption("ep_size", 1, "expert-parallel ranks (processes) for MoE models", int),
    EngineOption("seed", 0, "engine seed: dummy weights and the draws of requests without a seed", int),
    EngineOption("speculative", None, "speculative decoding method (off by default)", str,
                 ("prompt_lookup", "mtp")),
    EngineOption("quantization", None, "quantize 16/32-bit checkpoint weights at load (int8 / q4_1: weight-only, "
                 "CPU)", str, ("fp8", "int8", "q4_1")),
)
ENV_OPTIONS = (
    ("kv_cache_memory_fraction", "DEEPINFER_KV_CACHE_MEMORY_FRACTION", 0.85, float,
     "share of free memory given to the KV pool when --kv-cache-tokens is not set"),
    ("num_threads", "DEEPINFER_NUM_THREADS", 0, int, "torch intra-op threads on CPU (0: torch's default)"),
)
"""Options read from the environment (env.py): the flag sets the variable, which server processes inherit."""
LOG_LEVELS = ("debug", "info", "warning", "error")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for opt in ENGINE_OPTIONS:
        if isinstance(opt.default, bool):
            group.add_argument(_flag(opt.name), action=argparse.BooleanOptionalAction, default=opt.default,
                               help=opt.help + " (default: %(default)s)")
        else:
            shown = "" if opt.default is None else " (default: %(default)s)"
            group.add_argument(_flag(opt.name), type=opt.type, default=opt.default, choices=opt.choices,
                               help=opt.help + shown)
    for name, var, default, kind, why in ENV_OPTIONS:
        group.add_argument(_flag(name), type=kind, default=None,
                           help=f"{why} (default: ${var} or {default})")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                       help="log level of the deepinfer loggers (default: $DEEPINFER_LOG_LEVEL or warning)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Engine keyword arguments from parsed flags, with the device and model resolved (and checked)."""
    for name, var, _, _, _ in ENV_OPTIONS:
        if getattr(args, name) is not None:
            os.environ[var] = str(getattr(args, name))
    if args.log_level is not None:
        os.environ["DEEPINFER_LOG_LEVEL"] = args.log_level.upper()
    # serve logs its startup line and requests at INFO unless a level is asked for; the other commands stay quiet
    default = "INFO" if getattr(args, "command", None) == "serve" else "WARNING"
    logging.basicConfig(level=os.environ.get("DEEPINFER_LOG_LEVEL", default).upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = {opt.name: getattr(args, opt.name) for opt in ENGINE_OPTIONS}
    kwargs["device"] = resolve_device(kwargs["device"])
    kwargs["model"] = resolve_local_model(kwargs["model"])
    return kwargs


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer: LLM inference for DeepSeek models")
    ap.add_argument("--version", action="version", version=f"deepinfer {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for each prompt")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    gen.add_argument("--request-seed", type=int, default=None,
                     help="seed of the requests' draws (default: from --seed)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (first prompt)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    add_engine_args(gen)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument("--port", type=int, default=30000, help="port (default: %(default)s)")
    serve.add_argument("--served-model-name", default=None, help="model id of the API (default: --model)")
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="sequences admitted beyond --max-num-seqs; more get 503 with Retry-After "
                       "(default: %(default)s)")
    serve.add_argument("--tool-call-parser", choices=["deepseek_v3", "dsml", "none"], default=None,
                       help="format of tool calls in the model's replies (default: by the checkpoint)")
    serve.add_argument("--chat-encoding", choices=["deepseek_v4", "deepseek_v41"], default=None,
                       help="render chats with deepseek-recipe's encoder (default: the tokenizer's template, or "
                       "the renderer registered for the checkpoint)")
    serve.add_argument("--log-requests", action="store_true", help="log one line per finished request")
    add_engine_args(serve)
    batch = sub.add_parser("batch", help="run an OpenAI batch file (JSONL) offline")
    batch.add_argument("input", help="JSONL of {custom_id, method, url, body} requests")
    batch.add_argument("output", help="JSONL of results; custom_ids already in it are skipped (resume)")
    batch.add_argument("--served-model-name", default=None,
                       help="model id the requests' `model` field may name besides --model and 'default'")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(batch)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CliError as e:
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as e:  # bad arguments the engine refused, or a model it cannot load
        if logging.getLogger("deepinfer_rt").isEnabledFor(logging.DEBUG):
            raise
        print(f"deepinfer: error: {e}".splitlines()[0], file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        require_extra("server", "deepinfer serve")
        return _serve(args)
    if args.command == "batch":
        require_extra("server", "deepinfer batch (it reads requests with the server's request models)")
        from deepinfer_rt.batch_runner import run_batch_file

        kwargs = engine_kwargs(args)
        summary = run_batch_file(args.input, args.output, kwargs,
                                 model_names={args.model, "default", *(n for n in [args.served_model_name] if n)},
                                 progress=not args.no_progress)
        print(json.dumps(summary), file=sys.stderr)
        return 0
    return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    from deepinfer_rt.engine import Engine
    from deepinfer_rt.sampling_params import SamplingParams

    with Engine(**engine_kwargs(args)) as engine:
        prompts = args.prompts
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                            add_generation_prompt=True) for p in prompts]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.request_seed)
        if args.stream:
            for delta in engine.stream(prompts[0], sp):
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        for out in engine.generate(prompts, sampling_params=sp):
            if args.json:
                print(json.dumps({"text": out.text, "finish_reason": out.finish_reason,
                                  "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}))
            else:
                print(out.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from deepinfer_rt.server.http_server import ServerArgs, launch_server

    kwargs = engine_kwargs(args)
    model = kwargs.pop("model")
    launch_server(ServerArgs(model, args.host, args.port, args.served_model_name or args.model,
                             args.max_queued_requests, kwargs, tool_call_parser=args.tool_call_parser,
                             log_requests=args.log_requests, chat_encoding=args.chat_encoding))
    return 0


if __name__ == "__main__":
    sys.exit(main())
