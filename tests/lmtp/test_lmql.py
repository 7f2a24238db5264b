"""The real LMQL 0.7.3 client, in its own environment, against Salience on the default model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web
from transformers import AutoTokenizer

from salience.core.engine.engine import Engine
from salience.core.engine.requests import SamplingOptions
from salience.core.serving.status import ServerStatus
from salience.http_app import make_app
from salience.lmtp.session import LmtpConfig
from tests.conftest import free_port
from tools.lmql_env import client_python

NAME = "SmolLM2-135M-Instruct"
SUITE = Path(__file__).parents[2] / "tools" / "lmql_suite.py"  # runs in LMQL's environment only


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[tuple[Engine, str]]:
    engine = default_engine
    status = ServerStatus(NAME)
    status.ready(engine)
    runner = web.AppRunner(make_app(status, LmtpConfig()))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield engine, f"127.0.0.1:{port}"
    await runner.cleanup()


async def test_lmql_queries_and_score_agree_with_the_model(served, default_model: Path) -> None:
    engine, endpoint = served
    python = await asyncio.to_thread(client_python)
    process = await asyncio.create_subprocess_exec(
        str(python),
        str(SUITE),
        endpoint,
        NAME,
        str(default_model),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 600)
    assert process.returncode == 0, err.decode()[-3000:]
    result = {query: answer for query, (answer, _) in json.loads(out.decode().splitlines()[-1])["queries"].items()}

    # Each answer as the engine gives it, decoded the way LMQL 0.7.3's argmax decoder does: the prompt
    # after BOS, then each hole's value and each text after it tokenized on its own (its interpreter
    # rewrites the ids so), the greedy token under the hole's mask, EOS ending a hole.
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    bos = [tokenizer.bos_token_id]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, clean_up_tokenization_spaces=False)

    async def argmax(ids: list[int], max_tokens: int, allowed: tuple[int, ...] | None = None) -> list[int]:
        options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, allowed_token_ids=allowed)
        tokens = [e.token_id async for e in engine.generate(ids, options)]
        return tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_token_id else tokens

    async def stops_at(prompt: str, limits: list[int], texts_after: list[str]) -> list[str]:
        """Holes `STOPS_AT(X, "\\n") and len(TOKENS(X)) < limit` one after another, each followed by
        its text: each value is the greedy text up to its first newline."""
        ids, values = bos + encode(prompt), []
        for limit, after in zip(limits, [*texts_after, ""], strict=True):
            text = decode(await argmax(ids, limit - 1))
            values.append(text[: text.index("\n") + 1] if "\n" in text else text)
            ids += encode(values[-1]) + encode(after)
        return values

    async def choice(prompt: str, options: list[str]) -> str:
        """`X in [...]` of one-token options: the option the model scores highest."""
        context = bos + encode(prompt)
        totals = [sum(s.logprob for s in await engine.score(context, encode(o))) for o in options]
        return options[totals.index(max(totals))]

    # INT(N) and len(TOKENS(N)) < 4: the first token is one of LMQL's number tokens (a digit or a
    # space), then any token may follow; N is the digits of the tokens up to the first that is no
    # part of a number.
    legs = bos + encode("Q: How many legs does a spider have?\nA: ")
    number = tuple(i for token, i in tokenizer.get_vocab().items() if re.fullmatch(r"[Ġ1-9][0-9]*", token))
    first = await argmax(legs, 1, number)
    assert decode(first).isdigit()  # a digit, not a second space (after which LMQL masks again)
    raw = ""
    for token in first + await argmax(legs + first, 2):
        raw += decode([token])
        if not all(c.strip() in ",0123456789" for c in raw):
            break

    fruits = await stops_at("A list of three fruits:\n-", [8, 8, 8], ["-", "-"])
    person = await stops_at("Alice is thirty years old and lives in Paris.\nName:", [6, 4, 6], ["Age:", "City:"])
    assert {query: answer for query, answer in result.items() if query != "score"} == {
        "capital": (await stops_at("Q: What is the capital of France?\nA:", [10], []))[0],
        "colour": await choice("The colour of the clear sky is", [" blue", " green", " red"]),
        "fruits": [fruit.strip() for fruit in fruits],
        "legs": int("".join(c for c in raw if c.isdigit())),
        "sentiment": await choice(
            "Review: Cold soup and a rude waiter.\nSentiment:", [" positive", " negative", " neutral"]
        ),
        "poem": decode(await argmax(bos + encode("Write a short poem about the sea.\n\n"), 39)),
        "person": [value.strip() for value in person],
    }
    assert "Paris" in result["capital"]

    context = bos + encode("The colour of the clear sky is")
    for option, lmql_scores in zip([" blue", " green"], result["score"], strict=True):
        ours = await engine.score(context, encode(option))
        assert lmql_scores == pytest.approx([s.logprob for s in ours], abs=1e-4)
