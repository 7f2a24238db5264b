"""Three-turn conversations over `/v1/responses`, for tools/bench_openai.py's Responses rows.

Salience keeps each conversation (`store`, `previous_response_id`): a turn sends only its new user
message, and the server reads the earlier turns from its prefix cache. `vllm serve` is sent the whole
history each turn, as items, which is what a client of a server without a store does (vLLM's own
store is off unless VLLM_ENABLE_RESPONSES_API_STORE is set, and it is in-memory only). Greedy, so
both servers write the same replies; turns end at EOS or `max_output_tokens`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from tools.harness import Report, Samples, percentile, rotations

SETTLE_SECONDS = 3.0  # as tools/bench_openai.py's: vLLM's threads stay busy a while after its last request

FOLLOW_UPS = ("Tell me more about that.", "Now say it in one sentence.")


@dataclass(frozen=True)
class Conversation:
    """What one three-turn conversation measured."""

    turn_seconds: tuple[float, ...]
    output_tokens: int
    input_tokens: int  # over its turns, as each turn's usage counts them
    cached_tokens: int


async def converse(
    http: aiohttp.ClientSession, url: str, model: str, question: str, tokens: int, stored: bool
) -> Conversation:
    history: list[dict] = []  # the items resent each turn, when the server keeps nothing
    previous, seconds, output, prompt, cached = None, [], 0, 0, 0
    for text in (question, *FOLLOW_UPS):
        item = {"role": "user", "content": text}
        body: dict = {"model": model, "max_output_tokens": tokens, "temperature": 0.0, "store": stored}
        if stored:
            body["input"] = [item]
            if previous is not None:
                body["previous_response_id"] = previous
        else:
            history.append(item)
            body["input"] = history
        began = time.perf_counter()
        async with http.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as reply:
            if reply.status != 200:
                raise RuntimeError(f"{url}: {reply.status} {await reply.text()}")
            response = orjson.loads(await reply.read())
        seconds.append(time.perf_counter() - began)
        previous = response["id"]
        usage = response["usage"]
        output += usage["output_tokens"]
        prompt += usage["input_tokens"]
        cached += (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
        history.append({"role": "assistant", "content": _text(response)})
    return Conversation(tuple(seconds), output, prompt, cached)


def _text(response: dict) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


async def conversations(
    http: aiohttp.ClientSession, url: str, model: str, questions: Sequence[str], tokens: int, stored: bool
) -> tuple[float, list[Conversation]]:
    """Wall seconds for one conversation per question, all at once, and each one's figures."""
    began = time.perf_counter()
    done = await asyncio.gather(*(converse(http, url, model, q, tokens, stored) for q in questions))
    return time.perf_counter() - began, done


async def measure_conversations(
    http: aiohttp.ClientSession,
    ways: Sequence[tuple[str, str, str, bool]],
    model: str,
    questions: Sequence[str],
    counts: Sequence[int],
    tokens: int,
    repeats: int,
    samples: Samples,
) -> None:
    """N conversations at once on each way (key, name, url, stored), ways in rotating order, after
    one unmeasured conversation per way (lazy initialisation)."""
    for _, _, url, stored in ways:
        await conversations(http, url, model, questions[:1], tokens, stored)
    for n in counts:
        asked = [questions[i % len(questions)] for i in range(n)]
        for _, (key, name, url, stored) in rotations(list(ways), repeats):
            await asyncio.sleep(SETTLE_SECONDS)
            seconds, done = await conversations(http, url, model, asked, tokens, stored)
            produced = sum(c.output_tokens for c in done)
            turns = [s for c in done for s in c.turn_seconds]
            samples.add(
                f"N={n:<3} {name:28} {produced / seconds:7.1f} tok/s, turn p50 {percentile(turns, 0.5) * 1e3:5.0f} ms",
                {
                    f"N={n} {key} tok/s": produced / seconds,
                    f"N={n} {key} turn p50 s": percentile(turns, 0.5),
                    f"N={n} {key} input tokens": sum(c.input_tokens for c in done) / n,
                    f"N={n} {key} cached tokens": sum(c.cached_tokens for c in done) / n,
                },
            )


def tabulate_conversations(
    report: Report, ways: Sequence[tuple[str, str, str, bool]], counts: Sequence[int], tokens: int, repeats: int
) -> None:
    samples = report.samples
    resent = next((key for key, _, _, stored in ways if not stored), None)
    table = report.table(
        f"/v1/responses, N three-turn conversations at once (a question, then {' and '.join(map(repr, FOLLOW_UPS))}), "
        f"greedy, at most {tokens} tokens a turn, median of {repeats}; stored: previous_response_id on Salience's "
        "sessions; resent: the whole history as input items each turn",
        ("conversations", "{}"),
        ("server", ""),
        ("tok/s", "{:.1f}"),
        ("turn p50 ms", "{:.0f}"),
        ("input tokens / conversation", "{:.0f}"),
        ("of them cached", "{:.0f}"),
        ("ratio vs resent", "{:.2f}"),
    )
    for n in counts:
        for key, name, _, stored in ways:
            table.add(
                n,
                name,
                samples.median(f"N={n} {key} tok/s"),
                samples.median(f"N={n} {key} turn p50 s") * 1e3,
                samples.median(f"N={n} {key} input tokens"),
                samples.median(f"N={n} {key} cached tokens"),
                samples.paired(f"N={n} {key} tok/s", f"N={n} {resent} tok/s") if stored and resent else None,
            )
