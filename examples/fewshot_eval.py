"""Few-shot multiple-choice eval with prefix sharing, on the embedded default model (SmolLM2-135M-Instruct, CPU).

    python examples/fewshot_eval.py [--num-shots 4] [--choices-method token_length_normalized]

The first questions of examples/data/questions.jsonl, answered, form a few-shot header; every other question is
one program: header + question, then `select` over its choices. All programs start with the same header, so the
engine computes it once and each program adds only its question. Prints accuracy, throughput (programs/s) and
the prefix-cache hit rate (cached / prompt tokens over all the selects' engine requests).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import deepinfer_lang as sgl

DATA = Path(__file__).parent / "data" / "questions.jsonl"
METHODS = {"token_length_normalized": sgl.token_length_normalized,
           "greedy_token_selection": sgl.greedy_token_selection,
           "unconditional_likelihood_normalized": sgl.unconditional_likelihood_normalized}


def format_question(row: dict) -> str:
    # The choices are not listed in the prompt: a model this small tends to echo a listed one, while scoring each
    # choice as the continuation of "Answer:" asks it which answer is plausible.
    return f"Question: {row['question']}\nAnswer:"


@sgl.function
def answer(s, header, question, choices, method):
    s += header + question
    s += sgl.select("answer", [" " + c for c in choices], choices_method=method)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-shots", type=int, default=4)
    ap.add_argument("--choices-method", choices=list(METHODS), default="token_length_normalized")
    args = ap.parse_args()

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    shots, questions = rows[: args.num_shots], rows[args.num_shots:]
    header = "The following are multiple choice questions about general knowledge.\n\n" + "".join(
        f"{format_question(row)} {row['answer']}\n\n" for row in shots)
    with sgl.Runtime(model=args.model) as runtime:
        start = time.perf_counter()
        states = answer.run_batch(
            [{"header": header, "question": format_question(row), "choices": row["choices"],
              "method": METHODS[args.choices_method]} for row in questions],
            backend=runtime, progress_bar=True)
        elapsed = time.perf_counter() - start

    failed = [st.error() for st in states if st.error() is not None]
    if failed:
        raise SystemExit(f"{len(failed)} programs failed, the first with: {failed[0]!r}")
    num_correct = sum(st["answer"].strip() == row["answer"] for st, row in zip(states, questions))
    metas = [st.get_meta_info("answer") for st in states]
    hit_rate = sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)
    print(f"accuracy   {num_correct}/{len(questions)} = {num_correct / len(questions):.1%} ({args.choices_method}, "
          f"{args.num_shots} shots)")
    print(f"throughput {len(states) / elapsed:.2f} programs/s ({elapsed:.1f} s)")
    print(f"cache hits {hit_rate:.1%} of prompt tokens")


if __name__ == "__main__":
    main()
