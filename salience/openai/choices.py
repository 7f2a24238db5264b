"""One choice of a completion, sans I/O: the engine's TokenEvents in, what each adds to the choice out.

Theory of operation. Each token's text comes from the incremental detokenizer
(core/engine/detokenizer.py), which never splits a character; special tokens add none unless
`skip_special_tokens` is false. The token that ends a choice on a stop token (EOS) adds no text,
as in OpenAI's API and vLLM's server (unless `include_stop_str_in_output`, vLLM's extra).

Stop strings are matched here, on the text: the core stops on token ids only, and vLLM refuses
`stop` without its own detokenization, which the core turns off. While stop strings are set,
the last `len(longest stop) - 1` characters are held back, so a stop string split across tokens
never reaches the client in part. When one matches, the text before it is released, the choice
ends with finish_reason "stop", and the caller closes the generation (which aborts the request
in vLLM); the token that completed the stop string is the choice's last, counted and reported in
logprobs like any other, while its text is cut at the stop string (as vLLM does; after it with
`include_stop_str_in_output`). As in vLLM, the first `min_tokens` tokens' text is not searched
(it is still held back, so a stop string that starts there and ends later is found).

A token's logprob entry and extension entry always go out with the token itself, even while its
text is held back.

A reply that may call tools (tool_calls.py) passes its released text through `Calls`: in a
stream, what a chunk carries becomes content and delta tool calls; at the end, the reply's calls
(`Step.reply`) end the choice with finish_reason "tool_calls", and the readings report each
call's arguments per JSON path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from salience.core.engine.detokenizer import TextStream
from salience.core.engine.requests import FinishReason, TokenEvent
from salience.errors import Unavailable
from salience.openai.readings import Readings
from salience.openai.tool_calls import Calls, Reply

__all__ = ["Choice", "Step"]

# OpenAI's finish reasons. A monitor's `stop` is "content_filter": in OpenAI's words, content
# "omitted due to a flag from our content filters", and a value every client already knows.
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.MONITOR: "content_filter"}


@dataclass(slots=True)
class Step:
    """What one token adds to its choice: the text it releases (maybe none), the token (for
    logprobs), its extension entry (and on the first, the prompt's), and on the choice's last
    token the finish reason and the extension's end (summary, JSON fields, stopping monitor)."""

    text: str
    event: TokenEvent | None  # None: a step that only ends the choice
    entry: dict | None = None
    prompt: list[dict] | None = None
    finish: str | None = None
    end: dict | None = None
    calls: list[dict] | None = None  # OpenAI's delta tool calls, in a stream
    reply: Reply | None = None  # on the last step of a reply that may call tools: its content and calls


class _StopStrings:
    """Text released only once it cannot be the start of a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = stops
        self._hold = max(map(len, stops)) - 1
        self._pending = ""

    def feed(self, text: str, final: bool, search: bool = True, keep: bool = False) -> tuple[str, bool]:
        """What may go out now, and whether a stop string matched (the text before it goes out, or
        up to its end with `keep`); `search` false only holds the text back."""
        pending = self._pending + text
        best = None  # (end, start) of the stop string that completes first
        for stop in self._stops if search else ():
            start = pending.find(stop)
            if start >= 0 and (best is None or start + len(stop) < best[0]):
                best = (start + len(stop), start)
        if best is not None:
            self._pending = ""
            return pending[: best[0] if keep else best[1]], True
        cut = len(pending) if final else max(len(pending) - self._hold, 0)
        self._pending = pending[cut:]
        return pending[:cut], False


class Choice:
    """One choice's text, token count and end."""

    def __init__(
        self,
        index: int,
        tokenizer: object,
        prompt: Sequence[int],
        stop: Sequence[str] = (),
        readings: Readings | None = None,
        *,
        min_tokens: int = 0,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        calls: Calls | None = None,
    ) -> None:
        self.index = index
        self.tokens = 0  # completion tokens so far
        self.finish: str | None = None
        self.readings = readings
        self._text = TextStream(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        self._stops = _StopStrings(stop) if stop else None
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._calls = calls

    def push(self, event: TokenEvent) -> Step:
        """The next token; the Step says whether the choice ends with it."""
        index, self.tokens = self.tokens, self.tokens + 1
        reason = event.finish_reason
        stop_token = reason is FinishReason.STOP and not self._include_stop
        text = "" if stop_token else self._text.push(event.token_id)
        if reason is not None:
            text += self._text.flush()
        added = text  # the token's own text, before stop strings hold any back
        stopped = False
        if self._stops is not None:
            text, stopped = self._stops.feed(text, reason is not None, index >= self._min_tokens, self._include_stop)
        step = self._step(text, event)
        if self.readings is not None and self.readings.per_token:
            step.entry = self.readings.token(event, index, added)
        if stopped:
            self._finish(step, "stop")
        elif reason is not None:
            self._finish(step, self.finish_reason(reason))
            monitor = event.stopped_by
            if reason is FinishReason.MONITOR and self.readings is not None and monitor is not None:
                stopped_by = self.readings.stopped_by(monitor, index, event.token_id)
                step.end = {**(step.end or {}), "stopped_by": stopped_by}
        return step

    def end(self, reason: FinishReason | None) -> Step:
        """The choice's end when the generation ended after its last token went out (the engine
        said why only then)."""
        text = self._text.flush()
        if self._stops is not None:
            text, _ = self._stops.feed(text, True, self.tokens > self._min_tokens, self._include_stop)
        step = self._step(text, None)
        self._finish(step, self.finish_reason(reason))
        return step

    def _step(self, text: str, event: TokenEvent | None) -> Step:
        if self._calls is None:
            return Step(text, event)
        content, deltas = self._calls.feed(text, () if event is None else (event.token_id,))
        return Step(content, event, calls=deltas or None)

    @staticmethod
    def finish_reason(reason: FinishReason | None) -> str:
        """OpenAI's finish reason; a generation cancelled by the server (shutting down, or a drain
        cut short) is an error for the client, since OpenAI's API has no such reason."""
        if reason is None or reason is FinishReason.CANCELLED:
            raise Unavailable("the server is shutting down; the request was cancelled")
        return _FINISH[reason]

    def _finish(self, step: Step, reason: str) -> None:
        spans = None
        if self._calls is not None:
            step.reply, content, deltas = self._calls.end()
            step.text += content
            step.calls = (step.calls or []) + deltas or None
            spans = step.reply.spans
            if step.reply.calls and reason == "stop":
                reason = "tool_calls"
        self.finish = step.finish = reason
        if self.readings is not None and (end := self.readings.end(spans)) is not None:
            step.end = end
