"""Command line: `deepinfer generate "prompt" [--model ...]`, `deepinfer serve [--model ...] [--port ...]`."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer", description="DeepInfer offline inference")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for each prompt")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="smollm2-135m-instruct")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated (first prompt)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--model", default="smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--served-model-name", default=None, help="model id of the API (default: --model)")
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--kv-cache-tokens", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="sequences admitted beyond --max-num-seqs; more get 503 with Retry-After")
    args = ap.parse_args(argv)
    if args.command == "serve":
        return _serve(args)

    from deepinfer_rt import Engine, SamplingParams

    with Engine(args.model, device=args.device, dtype=args.dtype) as engine:
        prompts = args.prompts
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                            add_generation_prompt=True) for p in prompts]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
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


def _serve(args) -> int:
    from deepinfer_rt.server.http_server import ServerArgs, launch_server

    engine_kwargs = {"device": args.device, "dtype": args.dtype, "kv_cache_tokens": args.kv_cache_tokens,
                     "max_num_seqs": args.max_num_seqs}
    launch_server(ServerArgs(args.model, args.host, args.port, args.served_model_name, args.max_queued_requests,
                             engine_kwargs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
