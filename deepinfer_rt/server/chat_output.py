"""A chat model's output text -> reasoning, answer content and tool calls, incrementally (streamed deltas and whole
responses go through the same parser, so they agree).

Formats (DeepSeek's, as their chat templates and PyPI deepseek-recipe write them):
- reasoning: `...</think>` when the prompt opened the thinking block (it ends with `<think>`), or a
  `<think>...</think>` block at the start of the output;
- "deepseek_v3": V3 / R1 / V3.1 tool calls, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3 and R1 write `function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```\\n`);
- "dsml": V3.2 / V4 / V4.1, `<｜DSML｜function_calls>` (V3.2), `<｜DSML｜tool_calls>` (V4) or `<｜DSML｜ calls>`
  (V4.1) around `<｜DSML｜invoke name="N">` blocks of `<｜DSML｜parameter name="P" string="true|false">V
  </｜DSML｜parameter>` (string="false": V is JSON).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ParsedCall:
    name: str
    arguments: str
    """A JSON object, as text."""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def _dsml_value(raw: str, is_string: bool):
    if is_string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # the model wrote a non-JSON value where JSON was due: kept as text


class _DeepseekV3:
    start = re.compile(re.escape("<｜tool▁calls▁begin｜>"))
    end = re.compile(re.escape("<｜tool▁calls▁end｜>"))
    call = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
    _fenced = re.compile(r"^(.*?)\n```(?:json)?\n(.*?)\n```\s*$", re.S)
    markers = ("<｜tool▁calls▁begin｜>",)

    def parse_call(self, m: re.Match) -> ParsedCall:
        left, right = m.group(1).strip(), m.group(2)
        fenced = self._fenced.match(right)
        if left == "function" and fenced:  # V3 / R1: type, then name and fenced JSON
            return ParsedCall(fenced.group(1).strip(), fenced.group(2).strip())
        return ParsedCall(left, right.strip())


class _Dsml:
    start = re.compile(r"<｜DSML｜ ?(?:function_|tool_)?calls>")
    end = re.compile(r"</｜DSML｜ ?(?:function_|tool_)?calls>")
    call = re.compile(r"<｜DSML｜ ?invoke name=\"([^\"]*)\">(.*?)</｜DSML｜ ?invoke>", re.S)
    _param = re.compile(r"<｜DSML｜ ?parameter name=\"([^\"]*)\" string=\"(true|false)\">(.*?)</｜DSML｜ ?parameter>",
                        re.S)
    markers = ("<｜DSML｜function_calls>", "<｜DSML｜tool_calls>", "<｜DSML｜ calls>")

    def parse_call(self, m: re.Match) -> ParsedCall:
        args = {p.group(1): _dsml_value(p.group(3), p.group(2) == "true") for p in self._param.finditer(m.group(2))}
        return ParsedCall(m.group(1), json.dumps(args, ensure_ascii=False))


TOOL_FORMATS = {"deepseek_v3": _DeepseekV3, "dsml": _Dsml}


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker (it may be completed later)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ChatOutputParser:
    """feed(text) -> what became certain; finish() -> the rest. One per sequence."""

    def __init__(self, tool_format: str | None, starts_in_reasoning: bool, parse_reasoning: bool = True):
        self.tools = TOOL_FORMATS[tool_format]() if tool_format else None
        self.mode = "reasoning" if starts_in_reasoning and parse_reasoning else "start"
        self.parse_reasoning = parse_reasoning
        self.buf = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buf += text
        out = ParsedDelta()
        while True:
            step = getattr(self, "_" + self.mode)(out)
            if not step:
                return out

    def finish(self) -> ParsedDelta:
        out = self.feed("")
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            out.reasoning += rest  # never closed: all of it was reasoning
        else:
            out.content += rest  # an unfinished tool-call block stays visible as text
        return out

    # Each state handler consumes what it can from buf into out; True when it changed state.
    def _start(self, out: ParsedDelta) -> bool:
        head = self.buf.lstrip()
        if self.parse_reasoning and head.startswith(THINK_START):
            self.buf = head[len(THINK_START):]
            self.mode = "reasoning"
            return True
        if not head or (self.parse_reasoning and THINK_START.startswith(head)):
            return False  # blank so far, or it might still become "<think>"
        self.mode = "content"
        return True

    def _reasoning(self, out: ParsedDelta) -> bool:
        i = self.buf.find(THINK_END)
        if i < 0:
            keep = _held_back(self.buf, (THINK_END,))
            out.reasoning += self.buf[: len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        out.reasoning += self.buf[:i]
        self.buf = self.buf[i + len(THINK_END):].lstrip("\n")
        self.mode = "after_reasoning"
        return True

    def _after_reasoning(self, out: ParsedDelta) -> bool:
        """Newlines between the reasoning and the answer are not content."""
        self.buf = self.buf.lstrip("\n")
        if not self.buf:
            return False
        self.mode = "content"
        return True

    def _content(self, out: ParsedDelta) -> bool:
        if self.tools is None:
            out.content += self.buf
            self.buf = ""
            return False
        m = self.tools.start.search(self.buf)
        if m is None:
            keep = _held_back(self.buf, self.tools.markers)
            # newlines before a call block are not content: held until what follows them is known
            keep += len(self.buf[: len(self.buf) - keep]) - len(self.buf[: len(self.buf) - keep].rstrip("\n"))
            out.content += self.buf[: len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        out.content += self.buf[: m.start()].rstrip("\n")
        self.buf = self.buf[m.end():]
        self.mode = "calls"
        return True

    def _calls(self, out: ParsedDelta) -> bool:
        while (m := self.tools.call.search(self.buf)) is not None:
            end = self.tools.end.search(self.buf)
            if end is not None and end.start() < m.start():
                break
            out.tool_calls.append(self.tools.parse_call(m))
            self.buf = self.buf[m.end():]
        end = self.tools.end.search(self.buf)
        if end is None:
            return False
        self.buf = self.buf[end.end():]
        self.mode = "content"
        return True


def parse_json_calls(text: str) -> list[ParsedCall]:
    """The output of a required / named tool choice: the JSON array its constraint allowed."""
    calls = json.loads(text)
    return [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
