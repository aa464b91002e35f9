"""An SGLang frontend program run unmodified on deepinfer_lang: alias the module, then the program's own
`import sglang as sgl` and `from sglang.lang...` imports resolve to ours.

    python examples/sglang_unmodified.py
"""
import sys

import deepinfer_lang

sys.modules["sglang"] = deepinfer_lang

# ---- from here on, code as written for SGLang ----
import sglang as sgl  # noqa: E402
from sglang.lang.choices import greedy_token_selection  # noqa: E402


@sgl.function
def tip_suggestion(s, topic):
    s += sgl.system("You give short, practical tips.")
    s += sgl.user(f"Give two tips about {topic}.")
    forks = s.fork(2)
    for i in range(2):
        forks[i] += sgl.assistant(f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=24, stop="\n"))
    forks.join()
    with s.var_scope("summary"):
        s += sgl.user("Which tip matters more, the first or the second?")
        s += sgl.assistant(sgl.select("pick", choices=["first", "second"], choices_method=greedy_token_selection))


if __name__ == "__main__":
    runtime = sgl.Runtime(model_path="smollm2-135m-instruct")
    sgl.set_default_backend(runtime)
    states = tip_suggestion.run_batch([{"topic": "sleep"}, {"topic": "studying"}], temperature=0,
                                      progress_bar=True)
    for state in states:
        print(state["tip"], "->", state["pick"])
    print(sgl.get_server_info()["hit_rate"])
    runtime.shutdown()
