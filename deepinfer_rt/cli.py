"""Command line: `deepinfer generate "prompt" [--model ...]`."""
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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
