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
_CHAT_RECIPES = {"DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV41ForCausalLM": "deepseek_v41"}


class RuntimeBackend:
    """chat_template_name: render roles with that named template (deepinfer_lang.named_templates, SGLang's names)
    instead of the tokenizer's own chat template."""

    def __init__(self, engine: Engine, chat_template_name: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if chat_template_name is not None:
            from deepinfer_lang.named_templates import get_chat_template

            self.chat_template = get_chat_template(chat_template_name)
        else:
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
               method: ChoicesSamplingMethod, choices: list[str] | None = None) -> ChoicesDecision:
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
        if method.is_sglang_style:
            decision = self._sglang_style_decision(method, choices, choice_ids, conditional, unconditional)
        else:
            decision = method(conditional, unconditional)
        if decision.index is None:
            if decision.decision not in choices:
                raise ValueError(f"{method!r} decided {decision.decision!r}, which is not one of {choices}")
            decision.index = choices.index(decision.decision)
        if decision.scores is None:
            decision.scores = [sum(lps) / len(lps) for lps in conditional]
        if temperature > 0:
            decision.index = sample_index(decision.scores, temperature, self._rng)
        decision.meta_info.update(
            scores=decision.scores, normalized_prompt_logprobs=[sum(lps) / len(lps) for lps in conditional],
            input_token_logprobs=conditional, prompt_tokens=sum(o.prompt_tokens for o in outs),
            cached_tokens=sum(o.cached_tokens for o in outs))
        if unconditional is not None:
            decision.meta_info["unconditional_token_logprobs"] = unconditional
        return decision

    @staticmethod
    def _sglang_style_decision(method, choices, choice_ids, conditional, unconditional) -> ChoicesDecision:
        """Call a method written against SGLang's keyword protocol: entries are (logprob, token_id, None)."""
        def entries(lps, ids):
            return [(lp, tid, None) for lp, tid in zip(lps, ids)]

        decision = method(choices=list(choices), normalized_prompt_logprobs=[sum(l) / len(l) for l in conditional],
                          input_token_logprobs=[entries(l, ids) for l, ids in zip(conditional, choice_ids)],
                          output_token_logprobs=[[] for _ in choices],
                          unconditional_token_logprobs=None if unconditional is None else
                          [entries(l, ids) for l, ids in zip(unconditional, choice_ids)])
        if decision.meta_info is None:
            decision.meta_info = {}
        return decision

    def flush_cache(self) -> bool:
        self.engine.flush_cache()
        return True

    # ---- SGLang's backend methods ----
    def get_model_name(self) -> str:
        return str(self.engine.config.model)

    def get_chat_template(self):
        return self.chat_template

    def get_server_info(self) -> dict:
        """The model, the engine's limits and its counters (engine.stats: prefix-cache hit rate and more)."""
        return {"model_path": self.get_model_name(), "max_num_seqs": self.max_running_requests,
                "enable_prefix_cache": self.is_prefix_cache_enabled, **self.engine.stats}

    def end_program(self, state) -> None:
        pass


class Runtime(RuntimeBackend):
    """A RuntimeBackend that builds and owns its Engine: Runtime(model="smollm2-135m-instruct", dtype=...) takes
    Engine's arguments (SGLang's `model_path=` is accepted as another name for `model`). SGLang's Runtime
    launches a server; this one runs the engine in-process and answers SGLang's Runtime methods itself
    (generate/async_generate/encode in SGLang's format, cache_prefix, get_tokenizer, endpoint)."""

    def __init__(self, model: str | None = None, model_path: str | None = None, log_level: str | None = None,
                 chat_template_name: str | None = None, **engine_kwargs):
        super().__init__(Engine(model or model_path or "smollm2-135m-instruct", **engine_kwargs),
                         chat_template_name)
        self.endpoint = self  # SGLang code reaches the backend as runtime.endpoint

    def shutdown(self) -> None:
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def cache_prefix(self, prefix) -> GenerateOutput:
        """Compute a prompt (text, as SGLang's takes it, or ids) into the prefix cache."""
        ids = self.encode_prompt(prefix) if isinstance(prefix, str) else list(prefix)
        return super().cache_prefix(ids)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def generate(self, prompt, sampling_params=None, return_logprob=False, logprob_start_len=None,
                 top_logprobs_num=None, *args, **kwargs):
        """Two forms. Ours (the interpreter's): generate(ids, SamplingParams) -> list[GenerateOutput]. SGLang's
        Runtime.generate(prompt text(s), sampling_params dict, return_logprob, logprob_start_len,
        top_logprobs_num) -> the JSON string of SGLang's /generate response."""
        if isinstance(sampling_params, SamplingParams):
            return super().generate(prompt, sampling_params)
        import json

        from deepinfer_rt.server.sglang_native import GenerateBody, generate_in_process

        body = GenerateBody(text=prompt, sampling_params=sampling_params or {}, return_logprob=return_logprob,
                            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
        return json.dumps(generate_in_process(self.engine, body))

    async def async_generate(self, prompt: str, sampling_params: dict | None = None, session_id=None):
        """Text pieces of one prompt as they are generated (SGLang's Runtime.async_generate / add_request)."""
        from deepinfer_rt.server.sglang_native import sampling_params_of

        params = sampling_params_of(sampling_params or {})
        async for piece in self.engine.async_stream(input_ids=self.encode_prompt(prompt), sampling_params=params):
            yield piece

    add_request = async_generate

    def encode(self, text, is_first: bool | None = None):
        """Ours: encode(segment, is_first) -> ids of one appended segment. SGLang's Runtime.encode(prompt) -> the
        JSON string {"tokens": ids, "num_tokens": n}."""
        if is_first is not None:
            return super().encode(text, is_first)
        import json

        ids = self.encode_prompt(text)
        return json.dumps({"tokens": ids, "num_tokens": len(ids)})

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


_default_backend: RuntimeBackend | None = None  # global_config.default_backend


def set_default_backend(backend: RuntimeBackend) -> None:
    """The backend of programs run without backend= (also global_config.default_backend)."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> RuntimeBackend:
    if _default_backend is None:
        raise RuntimeError("no backend: call deepinfer_lang.set_default_backend(RuntimeBackend(engine)) (or "
                           "Runtime(model=...)) first, or pass backend= to run()")
    return _default_backend
