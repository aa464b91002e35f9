"""SGLang's own frontend (the real `sglang` 0.5.23 package, scripts/install_sglang_frontend.sh) runs programs
against `deepinfer serve` through its RuntimeEndpoint (base URL + "/sglang"): gen, select, fork, run_batch.
Greedy text equals what the same program gives through deepinfer_lang on the in-process engine (programs
without roles: the two frontends render chat roles with their own templates)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import deepinfer_lang as dsl

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = Path(os.environ.get("DEEPINFER_SGLANG_FRONTEND", ROOT / ".sglang-frontend"))

PROGRAM = r'''
import json, sys
import sglang as sgl

@sgl.function
def qa(s, question):
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=12, temperature=0)

@sgl.function
def pick(s):
    s += "The sky is " + sgl.select("color", choices=["blue", "green"])

@sgl.function
def two(s):
    s += "Count: "
    forks = s.fork(2)
    for i in range(2):
        forks[i] += str(i) + sgl.gen("n", max_tokens=4, temperature=0)
    forks.join()
    s["first"] = forks[0]["n"]

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
batch = qa.run_batch([{"question": f"What is {i} plus {i}?"} for i in range(3)])
print(json.dumps({"answer": qa.run(question="What is the capital of France?")["answer"],
                  "color": pick.run()["color"], "first": two.run()["first"],
                  "batch": [s["answer"] for s in batch], "sglang": sgl.__file__}))
'''


def test_sglang_programs_run_against_the_server(server_url, smollm2_engine, tmp_path):
    assert (FRONTEND / "sglang" / "__init__.py").exists(), \
        f"SGLang's frontend is not installed in {FRONTEND}: run scripts/install_sglang_frontend.sh"
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(FRONTEND))
    run = subprocess.run([sys.executable, str(script), f"{server_url}/sglang"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["sglang"].startswith(str(FRONTEND))  # the real package, not ours

    # The same programs through deepinfer_lang on the in-process engine (same model, greedy).
    backend = dsl.RuntimeBackend(smollm2_engine)

    @dsl.function
    def qa(s, question):
        s += "Question: " + question + "\nAnswer:" + dsl.gen("answer", max_tokens=12, temperature=0)

    @dsl.function
    def pick(s):
        s += "The sky is " + dsl.select("color", choices=["blue", "green"])

    assert got["answer"] == qa.run(question="What is the capital of France?", backend=backend)["answer"]
    assert got["color"] == pick.run(backend=backend)["color"]
    assert got["batch"] == [s["answer"] for s in qa.run_batch(
        [{"question": f"What is {i} plus {i}?"} for i in range(3)], backend=backend)]
    assert isinstance(got["first"], str) and got["first"]
