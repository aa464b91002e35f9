"""Prefix sharing: a few-shot multiple-choice evaluation with the prefix cache on vs off, in one run.

    python benchmark/bench_prefix.py [--num-questions 128] [--model smollm2-135m-instruct] [--page-size 1]

Every question is asked after the same ~1K-token 5-shot header. Per question, two requests share the prompt
header + passage + question + "Answer:": a select-style scoring request (one greedy token with its top-20
logprobs; the choice whose first token scores highest is picked, a choice outside the top 20 scores -inf) and
a short greedy answer (up to 8 tokens, ending at a newline). All requests of a mode go to the engine in one
`generate` call, so the scheduler sees them together (and LPM can order them). Prints per mode the prefill
tokens computed and wall time, the cache hit rate against the best any cache could do on this workload, and
the speedup; writes benchmark/results/prefix_<device>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import time
from pathlib import Path

import torch

from deepinfer_rt import Engine, SamplingParams

ANIMALS = ["fox", "whale", "owl", "badger", "heron", "otter", "lynx", "beetle", "falcon", "tortoise", "moose",
           "gecko", "pelican", "squirrel", "salmon", "camel", "penguin", "wolf", "hedgehog", "parrot"]
COLORS = ["red", "blue", "grey", "golden", "spotted", "striped", "pale", "dark", "silver", "green"]
PLACES = ["forest", "river", "desert", "meadow", "swamp", "mountain", "harbor", "canyon", "orchard", "tundra",
          "valley", "island"]
FOODS = ["berries", "fish", "seeds", "grass", "mushrooms", "insects", "apples", "worms", "nuts", "clover",
         "shrimp", "honey", "acorns", "carrots", "plums", "crabs"]
HABITS = ["sleeps during the day", "travels in large groups", "hides its food for winter", "sings at dawn",
          "builds a nest of twigs", "swims long distances", "stays alone most of the year", "digs deep burrows"]

INSTRUCTION = "Read each passage and answer the question with one of the choices.\n\n"
NUM_SHOTS = 5
NUM_CHOICES = 4


def make_item(rng: random.Random, num_facts: int, tokenizer) -> tuple[str, list[str], str]:
    """A passage of `num_facts` creature facts, a question about one of them, its choices and the answer.

    Choices have distinct first tokens (after the space that follows "Answer:"), so one next-token
    distribution scores all of them."""
    creatures = rng.sample([(c, a) for c in COLORS for a in ANIMALS], num_facts)
    foods = [rng.choice(FOODS) for _ in creatures]
    facts = [f"The {c} {a} lives in the {rng.choice(PLACES)}, {rng.choice(HABITS)} and eats {food}."
             for (c, a), food in zip(creatures, foods)]
    asked = rng.randrange(num_facts)
    answer = foods[asked]
    choices, first_tokens = [answer], {first_token(tokenizer, answer)}
    for food in rng.sample(FOODS, len(FOODS)):
        if len(choices) < NUM_CHOICES and first_token(tokenizer, food) not in first_tokens:
            choices.append(food)
            first_tokens.add(first_token(tokenizer, food))
    rng.shuffle(choices)
    color, animal = creatures[asked]
    text = (f"Passage: {' '.join(facts)}\nQuestion: What does the {color} {animal} eat?\n"
            f"Choices: {', '.join(choices)}\nAnswer:")
    return text, choices, answer


def first_token(tokenizer, choice: str) -> int:
    return tokenizer.encode(" " + choice, add_special_tokens=False)[0]


def make_header(tokenizer, target_tokens: int, seed: int) -> list[int]:
    """The 5-shot header: shots grow a fact at a time until the header reaches target_tokens."""
    for num_facts in range(1, len(COLORS) * len(ANIMALS)):
        rng = random.Random(seed)
        shots = [make_item(rng, num_facts, tokenizer) for _ in range(NUM_SHOTS)]
        text = INSTRUCTION + "".join(f"{q} {answer}\n\n" for q, _, answer in shots)
        ids = tokenizer.encode(text, add_special_tokens=True)
        if len(ids) >= target_tokens:
            return ids
    raise ValueError(f"cannot build a header of {target_tokens} tokens from the word lists")


def make_workload(tokenizer, num_questions: int, header_tokens: int, seed: int):
    """Prompts (token ids) and params in submission order, and each question's choices and answer."""
    header = make_header(tokenizer, header_tokens, seed)
    rng = random.Random(seed + 1)
    select = SamplingParams(max_new_tokens=1, temperature=0, logprobs=True, top_logprobs=20)
    answer = SamplingParams(max_new_tokens=8, temperature=0, stop="\n")
    prompts, params, questions = [], [], []
    for _ in range(num_questions):
        text, choices, correct = make_item(rng, 3, tokenizer)
        ids = header + tokenizer.encode(text, add_special_tokens=False)
        prompts += [ids, ids]
        params += [select, answer]
        questions.append((choices, correct))
    return header, prompts, params, questions


def optimal_cached_tokens(prompts: list[list[int]], page_size: int) -> int:
    """Tokens a perfect cache with unbounded memory reuses: per prompt, its longest prefix shared with any
    earlier prompt (each prefix computed once), kept below the prompt length (the last token is always
    computed) and floored to whole pages."""
    trie: dict = {}
    total = 0
    for ids in prompts:
        node, shared = trie, 0
        while shared < len(ids) and ids[shared] in node:
            node = node[ids[shared]]
            shared += 1
        total += min(shared, len(ids) - 1) // page_size * page_size
        for token in ids[shared:]:
            node = node.setdefault(token, {})
    return total


def pick_choice(top_logprobs: list[tuple[int, float]], choices: list[str], tokenizer) -> str:
    scores = dict(top_logprobs)
    return max(choices, key=lambda c: scores.get(first_token(tokenizer, c), -math.inf))


def run_mode(args, enable_prefix_cache: bool, prompts, params, questions) -> dict:
    engine = Engine(args.model, dtype=args.dtype, device=args.device, page_size=args.page_size,
                    kv_cache_tokens=args.kv_cache_tokens, enable_prefix_cache=enable_prefix_cache)
    # Warm up on an unrelated prompt, then start cold: the timed run must build its cache itself.
    engine.generate(input_ids=[engine.tokenizer.encode("Hello there, how are you?")],
                    sampling_params=SamplingParams(max_new_tokens=2, temperature=0))
    engine.flush_cache()
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    picks = [pick_choice(o.top_logprobs[0], choices, engine.tokenizer)
             for o, (choices, _) in zip(outs[0::2], questions)]
    prompt_tokens = sum(o.prompt_tokens for o in outs)
    cached_tokens = sum(o.cached_tokens for o in outs)
    result = {
        "wall_s": wall, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "prefill_tokens_computed": prompt_tokens - cached_tokens, "hit_rate": cached_tokens / prompt_tokens,
        "accuracy": sum(p == correct for p, (_, correct) in zip(picks, questions)) / len(questions),
        "picks": picks, "answers": [o.text for o in outs[1::2]], "engine_stats": engine.stats,
    }
    engine.shutdown()
    del engine
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-questions", type=int, default=128)
    ap.add_argument("--header-tokens", type=int, default=1000)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from deepinfer_rt.models.loader import resolve_model_path
    from deepinfer_rt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    header, prompts, params, questions = make_workload(tokenizer, args.num_questions, args.header_tokens,
                                                       args.seed)
    total_prompt = sum(len(p) for p in prompts)
    optimal = optimal_cached_tokens(prompts, args.page_size) / total_prompt
    off = run_mode(args, False, prompts, params, questions)
    on = run_mode(args, True, prompts, params, questions)
    speedup = off["wall_s"] / on["wall_s"]
    same_picks = sum(a == b for a, b in zip(on["picks"], off["picks"])) / len(questions)
    same_answers = sum(a == b for a, b in zip(on["answers"], off["answers"])) / len(questions)
    for name, mode in (("cache off", off), ("cache on", on)):
        print(f"{name:9s}: {mode['prefill_tokens_computed']:8d} prefill tokens computed | {mode['wall_s']:7.2f} s "
              f"| hit rate {mode['hit_rate']:.3f} | accuracy {mode['accuracy']:.3f}")
    print(f"optimal hit rate {optimal:.3f} | achieved / optimal {on['hit_rate'] / optimal:.3f} | "
          f"speedup {speedup:.2f}x | same picks {same_picks:.3f} | same answers {same_answers:.3f}")
    result = {
        "benchmark": "prefix", "model": args.model, "device": args.device, "dtype": args.dtype,
        "num_questions": args.num_questions, "num_requests": len(prompts), "header_tokens": len(header),
        "page_size": args.page_size, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "prompt_tokens": total_prompt,
        "optimal_hit_rate": optimal, "hit_rate_over_optimal": on["hit_rate"] / optimal, "speedup": speedup,
        "same_picks_on_off": same_picks, "same_answers_on_off": same_answers, "cache_on": on, "cache_off": off,
    }
    out = Path(args.out or Path(__file__).parent / "results" / f"prefix_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
