"""Fork/join on the embedded default model (SmolLM2-135M-Instruct, CPU): expand several tips in parallel branches.

    python examples/parallel.py

s.fork(n) prefills the shared prompt once, then each branch runs on its own worker, so the branches' gens are
batched together in the engine's steps; join() gathers each branch's variable into a list in the parent.
"""
from __future__ import annotations

import time

import deepinfer_lang as sgl

TIPS = ["Drink water", "Sleep eight hours", "Walk every day"]


@sgl.function
def expand_tips(s, topic, tips):
    s += f"Here are {len(tips)} tips for {topic}: " + "; ".join(tips) + ".\n\n"
    forks = s.fork(len(tips))
    forks += lambda i: f"Tip {i + 1}, \"{tips[i]}\", explained in one paragraph:\n"
    forks += sgl.gen("detail", max_tokens=48, stop="\n\n")
    forks.join()
    for i, detail in enumerate(s["detail"]):
        s += f"Tip {i + 1}: {detail.strip()}\n"
    s += "\nIn summary," + sgl.gen("summary", max_tokens=40, stop="\n\n")


def main() -> None:
    with sgl.Runtime(model="smollm2-135m-instruct") as runtime:
        start = time.perf_counter()
        state = expand_tips.run(topic="staying healthy", tips=TIPS, temperature=0, backend=runtime)
        elapsed = time.perf_counter() - start
    print(state.text())
    cached = [meta["cached_tokens"] for meta in state.get_meta_info("detail")]
    print(f"\n{elapsed:.1f} s; each branch found {cached} prompt tokens cached (the shared prefix)")


if __name__ == "__main__":
    main()
