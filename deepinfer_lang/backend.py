"""RuntimeBackend: the interpreter's view of an in-process deepinfer_rt.Engine (token ids in, outputs out)."""
from __future__ import annotations

import random
from typing import Iterator

from deepinfer_lang.chat_template import ChatTemplate
from deepinfer_lang.choices import ChoicesDecision, ChoicesSamplingMethod, sample_index
from deepinfer_rt import Engine, GenerateOutput, SamplingParams

# Output ids are decoded after this many preceding ids, as the engine's detokenizer does, so a tokenizer that
# drops a leading space at the start of a decode does not make the ids look unlike the engine's text.
_DECODE_CONTEXT = 4
# Model families whose prompts are rendered by deepseek-recipe rather than a Jinja chat template.
_CHAT_RECIPES = {"DeepseekV4ForCausalLM": "deepseek_v4"}


class RuntimeBackend:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = ChatTemplate(self.tokenizer, _CHAT_RECIPES.get(engine.model_config.architecture))
        self.eos_ids = frozenset(engine.eos_ids)
        self.bos_ids = _bos_ids(self.tokenizer)
        # unconditional_likelihood_normalized scores each choice after this neutral context instead of the prompt:
        # the tokenizer's BOS (if it adds one) and a single "\n". The newline says nothing about the answer, and as
        # a token before the choice it gives the choice's first token a logprob too (an empty context would not).
        self.unconditional_context_ids = self.bos_ids + self.tokenizer.encode("\n", add_special_tokens=False)
        self._rng = random.Random(0)

    @property
    def is_prefix_cache_enabled(self) -> bool:
        return self.engine.config.cache.enable_prefix_cache

    @property
    def max_running_requests(self) -> int:
        return self.engine.config.scheduler.max_num_seqs

    # ---- tokens ----
    def encode(self, text: str, is_first: bool) -> list[int]:
        """Ids of one appended text segment; the program's first segment starts with the BOS the tokenizer adds
        (unless the text spells it out, as chat templates that render the BOS do). Byte-level BPE tokenizers
        (SmolLM2, Llama 3, DeepSeek) encode a segment as it reads; SentencePiece ones that mark a word start at
        the beginning of every encode put that mark on each segment."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if is_first and self.bos_ids and ids[: len(self.bos_ids)] != self.bos_ids:
            ids = self.bos_ids + ids
        return ids

    def output_ids(self, prompt_ids: list[int], out: GenerateOutput, params: SamplingParams) -> list[int]:
        """Ids to append for a finished gen: the model's own ids, without a final stop token, when they spell out
        the gen's text; when a stop string ended the text mid-token, the longest prefix of them that does; when
        none does, the text tokenized afresh (the prompt stays consistent with the text, at the cost of a cache
        miss after this point)."""
        ids = list(out.token_ids)
        stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else self.eos_ids)
        if out.finish_reason == "stop" and ids and ids[-1] in stop_ids:
            ids.pop()
        context = prompt_ids[-_DECODE_CONTEXT:]
        for k in range(len(ids), -1, -1):
            text = self._decode_after(context, ids[:k])
            if text == out.text:
                return ids[:k]
            if len(text) < len(out.text):
                break
        return self.encode(out.text, is_first=False)

    def _decode_after(self, context: list[int], ids: list[int]) -> str:
        head = self.tokenizer.decode(context, skip_special_tokens=True)
        full = self.tokenizer.decode(context + ids, skip_special_tokens=True)
        return full[len(head):] if full.startswith(head) else self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- model calls ----
    def generate(self, ids: list[int], params: SamplingParams) -> list[GenerateOutput]:
        """One request (params.n outputs)."""
        return self.engine.generate(input_ids=[ids], sampling_params=params)

    def stream(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        return self.engine.stream(input_ids=ids, sampling_params=params)

    def cache_prefix(self, ids: list[int]) -> GenerateOutput:
        """Compute `ids` once so that requests extending them find the KV in the prefix cache."""
        return self.engine.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=1,
                                                                                     temperature=0))[0]

    def select(self, prefix_ids: list[int], choice_ids: list[list[int]], temperature: float,
               method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score every choice after the prefix in one batched generate call: each request is prefix + choice, asking
        for the logprobs of the choice's positions only (the prefix may come from the cache). A method that needs
        unconditional logprobs gets the same choices scored after unconditional_context_ids, in the same call."""
        contexts = [prefix_ids]
        if method.requires_unconditional_logprobs:
            contexts.append(self.unconditional_context_ids)
        pairs = [(ctx, ids) for ctx in contexts for ids in choice_ids]
        params = [SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True, logprob_start_len=len(ctx))
                  for ctx, _ in pairs]
        outs = self.engine.generate(input_ids=[ctx + ids for ctx, ids in pairs], sampling_params=params)
        for out in outs:
            if out.finish_reason in ("error", "abort"):
                raise RuntimeError(f"scoring a choice failed: {out.error or out.finish_reason}")
        logprobs = [out.prompt_logprobs[len(ctx):] for (ctx, _), out in zip(pairs, outs)]
        conditional, unconditional = logprobs[: len(choice_ids)], logprobs[len(choice_ids):] or None
        decision = method(conditional, unconditional)
        if temperature > 0:
            decision.index = sample_index(decision.scores, temperature, self._rng)
        decision.meta_info.update(
            scores=decision.scores, normalized_prompt_logprobs=[sum(lps) / len(lps) for lps in conditional],
            input_token_logprobs=conditional, prompt_tokens=sum(o.prompt_tokens for o in outs),
            cached_tokens=sum(o.cached_tokens for o in outs))
        if unconditional is not None:
            decision.meta_info["unconditional_token_logprobs"] = unconditional
        return decision

    def flush_cache(self) -> None:
        self.engine.flush_cache()


class Runtime(RuntimeBackend):
    """A RuntimeBackend that builds and owns its Engine: Runtime(model="smollm2-135m-instruct", dtype=...) takes
    Engine's arguments (SGLang's `model_path=` is accepted as another name for `model`)."""

    def __init__(self, model: str | None = None, model_path: str | None = None, **engine_kwargs):
        super().__init__(Engine(model or model_path or "smollm2-135m-instruct", **engine_kwargs))

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _bos_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text when it adds special tokens (its BOS), found by comparison."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


_default_backend: RuntimeBackend | None = None


def set_default_backend(backend: RuntimeBackend) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> RuntimeBackend:
    if _default_backend is None:
        raise RuntimeError("no backend: call deepinfer_lang.set_default_backend(RuntimeBackend(engine)) (or "
                           "Runtime(model=...)) first, or pass backend= to run()")
    return _default_backend
