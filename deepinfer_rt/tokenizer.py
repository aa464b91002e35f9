"""Tokenizer loading and incremental, UTF-8-safe detokenization with stop strings."""
from __future__ import annotations

import threading
from pathlib import Path

# Prompt tokens fed to the detokenizer before the output, so a first output token's leading space survives
# tokenizers that strip it at the start of a decode.
_PROMPT_CONTEXT = 4


_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""tokenizer_config.json classes that are transformers' plain wrapper of tokenizer.json (the same class in 5.x)."""


def load_tokenizer(path: Path):
    """The checkpoint's transformers tokenizer. A folder whose tokenizer_config.json names the plain tokenizer.json
    wrapper is loaded by that class directly: AutoTokenizer reads the model config first, and importing a model's
    configuration module pulls in transformers' model-loading stack (about a second of start-up on two cores),
    for the class the file already names."""
    import json

    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and (Path(path) / "tokenizer.json").is_file():
        if json.loads(config.read_text()).get("tokenizer_class") in _BACKEND_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _rust_tokenizer(tokenizer):
    """The Rust tokenizer under a transformers one where decoding through it directly gives the same text (no
    clean-up pass), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else backend


def ids_decoder(tokenizer):
    """`ids -> tokenizer.decode(ids, skip_special_tokens=True)`, calling the Rust tokenizer directly where
    that is the same: the transformers wrapper costs about twice the decode of the few ids a detokenizer step
    reads, twice per token of every running request."""
    backend = _rust_tokenizer(tokenizer)
    if backend is None:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


def batch_decoder(tokenizer):
    """`[ids, ...] -> [text, ...]`, as ids_decoder on each, in one tokenizer call (the Rust tokenizer decodes
    the batch in parallel): a decode step's detokenizer windows of every request at once."""
    backend = _rust_tokenizer(tokenizer)
    if backend is None:
        return lambda batch: tokenizer.batch_decode(batch, skip_special_tokens=True)
    return lambda batch: backend.decode_batch(batch, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text of the output so far, grown one token at a time.

    Decodes the window ids[prefix_offset:] and emits only what goes beyond the decode of
    ids[prefix_offset:read_offset]; a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until the
    bytes that complete it arrive. Stop strings end the text before their first occurrence.

    Without stop strings (`is_lazy`) nothing needs the text while the request runs but a stream reader: tokens
    are queued (`queue`) and decoded when the text is read (`catch_up`: by `take_delta`, `flush` and a request's
    finish), all those queued in one window, instead of two decodes per token per step.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop_strings: list[str]):
        self.tokenizer = tokenizer
        self._decode = ids_decoder(tokenizer)
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop_strings = stop_strings
        self.max_stop_len = max((len(s) for s in stop_strings), default=0)
        self.num_emitted = 0
        self.is_lazy = not stop_strings
        self._reading = threading.Lock()

    def queue(self, token_id: int) -> None:
        """Append a token whose text is decoded later (`catch_up`); lazy detokenizers only. The engine's loop
        queues while a stream reader on another thread may catch up: the list only grows, and a catch-up
        decodes up to the length it saw."""
        self.ids.append(token_id)

    def catch_up(self) -> None:
        """Decode the tokens queued since the last read into `text`: the same text as one `add` each. As one
        window (its delta is the decode of its bytes past the prefix) unless the window ends inside a
        character; then token by token, so that the text before that character shows as `add` would show it.
        One reader at a time (a stream reader, the request's finish on the loop's thread)."""
        with self._reading:
            end = len(self.ids)
            if self.read_offset >= end:
                return
            whole = self._decode(self.ids[self.prefix_offset : end])
            if not whole.endswith("\ufffd"):
                prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
                self.commit(prefix, whole, check_stop=False, end=end)
                return
            for stop in range(self.read_offset + 1, end + 1):
                self.commit(self._decode(self.ids[self.prefix_offset : self.read_offset]),
                            self._decode(self.ids[self.prefix_offset : stop]), check_stop=False, end=stop)

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append a token; True when a stop string completed (text is then cut before it)."""
        prefix_ids, window_ids = self.push(token_id)
        return self.commit(self._decode(prefix_ids), self._decode(window_ids), check_stop)

    def push(self, token_id: int) -> tuple[list[int], list[int]]:
        """First half of `add`: append the token; returns the two id windows to decode (prefix, whole), so
        that a caller can decode many detokenizers' windows in one batched call before `commit`."""
        self.ids.append(token_id)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def commit(self, prefix_text: str, new_text: str, check_stop: bool = True, end: int | None = None) -> bool:
        """Second half of `add`, given the decodes of `push`'s windows (`end`: where the decoded window ended,
        by default the end of the ids)."""
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids) if end is None else end
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not check_stop:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]  # the earliest stop string in the text, whatever its list order
            return True
        return False

    def flush(self) -> None:
        """At finish: decode whatever an incomplete UTF-8 tail still holds (shown as U+FFFD)."""
        self.catch_up()
        with self._reading:
            if self.read_offset < len(self.ids):
                prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
                self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
                self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; while running, hold back a tail that might begin a stop string."""
        self.catch_up()
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - max(self.max_stop_len - 1, 0))
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta
