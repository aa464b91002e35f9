"""Grammar-driven drafts for constrained requests, with prompt lookup for what the grammar leaves open.

Under structured output much of the text is fixed by the grammar: JSON keys, quotes, colons, commas, braces.
The drafter writes the likely continuation as text, then tokenizes it:

  forced text     the grammar's jump-forward string (a key after its opening quote, `"` before a string value)
  JSON layout     where the grammar allows optional whitespace, the layout of json.dumps(indent=2) (what
                  instruction-tuned models print), and the one structural character the grammar allows
                  (`:` after a key, `,` or `}` after a value)
  copied values   inside a string value, the rest of the prompt word(s) the value has started with (matched
                  case-insensitively at a word start), up to punctuation, then the closing quote
  prompt lookup   where none of these applies (numbers, the first characters of a value), the n-gram
                  continuation of the tokens, kept while the grammar accepts it

Text is tokenized as a whole, so it splits the way the model's tokenizer splits a full JSON document (checked
against the model's own output in the tests). Drafts are proposals only: the target verifies every one.
"""
from __future__ import annotations

import weakref

from deepinfer_rt.request import Req
from deepinfer_rt.speculative.drafter import Drafter, PromptLookupDrafter, Proposal

_INDENT = "  "
_STRUCTURAL = '":,}]{['
_VALUE_CHARS = "0123456789.-eEtfn"
"""Characters that may continue or start a non-string JSON value: a structural character counts as forced only
if none of these is allowed too (after `3`, `,` is allowed but so is `4`)."""
_VALUE_END = ",.;:!?()[]{}\"\n"
"""Where a value copied from the prompt stops."""
_MAX_COPY = 48
_LAYOUT_CONFIDENCE = 0.95
_COPY_CONFIDENCE = 0.7


def scan_json(text: str) -> tuple[bool, str, int, str]:
    """(inside a string, the string's text so far, nesting depth, last character outside strings that is not
    whitespace) of a JSON document prefix."""
    in_string, escaped, start, depth, last = False, False, 0, 0, ""
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string, last = False, '"'
        elif c == '"':
            in_string, start = True, i + 1
        elif not c.isspace():
            depth += (c in "{[") - (c in "}]")
            last = c
    return in_string, text[start:] if in_string else "", depth, last


def _layout(last: str, nxt: str | None, depth: int) -> str:
    """Whitespace json.dumps(indent=2) puts between `last` and `nxt` (None: a value that is not forced)."""
    if nxt in ("}", "]"):
        return "" if last in "{[" else "\n" + _INDENT * (depth - 1)
    if last in ("{", "[", ","):
        return "\n" + _INDENT * depth
    return " " if last == ":" else ""


def copy_from_prompt(prompt: str, partial: str) -> str:
    """The rest of the latest prompt word sequence starting with `partial` (case-insensitive, at a word start),
    up to punctuation; "" if there is none."""
    if not partial:
        return ""
    low, key = prompt.lower(), partial.lower()
    pos = low.rfind(key)
    while pos > 0 and low[pos - 1].isalnum():
        pos = low.rfind(key, 0, pos + len(key) - 1)
    if pos < 0:
        return ""
    rest = prompt[pos + len(partial) : pos + len(partial) + _MAX_COPY]
    end = next((i for i, c in enumerate(rest) if c in _VALUE_END), len(rest))
    return rest[:end].rstrip()


class GrammarDrafter(Drafter):
    """Constrained JSON requests: grammar text, layout and copied values, then prompt lookup. Other requests
    (and other grammars, which get the forced text only) use prompt lookup as it is."""

    def __init__(self, tokenizer, lookup: PromptLookupDrafter):
        self.tokenizer = tokenizer
        self.lookup = lookup
        self._prompts: weakref.WeakKeyDictionary[Req, str] = weakref.WeakKeyDictionary()

    def propose(self, req: Req, k: int) -> Proposal | None:
        if req.grammar is None or req.grammar.is_terminated():
            return self.lookup.propose(req, k)
        matcher = req.grammar.fork().matcher
        tokens, confidences = [], []
        text = self.tokenizer.decode(req.output_ids)
        while len(tokens) < k:
            chunk, confidence = self._draft_text(req, text, matcher)
            if chunk:
                new = self.tokenizer.encode(chunk, add_special_tokens=False)[: k - len(tokens)]
            else:
                new = self._lookup_tokens(req.token_ids + tokens, matcher, k - len(tokens))
                confidence = self._rate(req)
            if not new:
                break
            if chunk:
                # The text was accepted as characters; its tokens must be too (and the matcher must end
                # where the tokens end, which truncation may have moved).
                matcher = req.grammar.fork().matcher
                if not all(matcher.accept_token(t) for t in tokens + new):
                    break
            tokens += new
            confidences += [confidence] * len(new)
            text = self.tokenizer.decode(req.output_ids + tokens)
        return Proposal(tokens, confidences, None, req.num_tokens) if tokens else None

    @staticmethod
    def _rate(req: Req) -> float:
        return (req.num_accepted_tokens + 1) / (req.num_draft_tokens + 2)

    def _draft_text(self, req: Req, text: str, matcher) -> tuple[str, float]:
        """Text the grammar forces from here, extended by JSON layout and copied values (JSON only)."""
        out = ""
        json_mode = req.params.json_schema is not None
        confidence = _LAYOUT_CONFIDENCE
        while len(out) < _MAX_COPY:
            forced = matcher.find_jump_forward_string()
            if forced:
                step = forced
            elif not json_mode:
                break
            else:
                in_string, partial, depth, last = scan_json(text + out)
                if in_string:
                    copied = copy_from_prompt(self._prompt(req), partial)
                    step, confidence = (copied + '"' if copied else ""), _COPY_CONFIDENCE
                else:
                    nxt = _forced_char(matcher, last)
                    if nxt is None and last != ":":
                        break
                    done = text + out
                    trailing = done[len(done.rstrip()):]
                    layout = _layout(last, nxt, depth)
                    if not layout.startswith(trailing):
                        break  # the model lays JSON out its own way here
                    step = layout[len(trailing):] + (nxt or "")
            if not step or not matcher.accept_string(step):
                break
            out += step
        return out, confidence

    def _lookup_tokens(self, context: list[int], matcher, k: int) -> list[int]:
        """Prompt-lookup tokens that the grammar accepts (advancing matcher), at most one value's worth: it stops
        where the grammar's own text takes over (after a structural character)."""
        out = []
        for token in self.lookup.continuation(context, k):
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            out.append(token)
            if any(c in _STRUCTURAL for c in self.tokenizer.decode([token])):
                break
        return out

    def _prompt(self, req: Req) -> str:
        text = self._prompts.get(req)
        if text is None:
            text = self._prompts[req] = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=True)
        return text


def _forced_char(matcher, last: str) -> str | None:
    """The one structural character the grammar allows next (after optional whitespace), or None. Value
    characters are tested only where a value may continue or start (not after a closed string or container)."""
    allowed = [c for c in _STRUCTURAL if matcher.fork().accept_string(c)]
    if len(allowed) != 1:
        return None
    if last not in '"}]' and any(matcher.fork().accept_string(c) for c in _VALUE_CHARS):
        return None
    return allowed[0]
