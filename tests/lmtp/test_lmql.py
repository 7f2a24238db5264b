"""The real LMQL 0.7.3 client, in its own environment, against Salience on the default model."""

from __future__ import annotations

import asyncio
import json
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
    assert len(result) == 8  # the whole suite ran; the rest of its answers are compared by tools/bench_lmql.py

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    bos = [tokenizer.bos_token_id]

    # STOPS_AT / len(TOKENS) < 10 under argmax: greedy decoding until a newline, at most 9 tokens.
    prompt = bos + tokenizer("Q: What is the capital of France?\nA:")["input_ids"]
    greedy = [e.token_id async for e in engine.generate(prompt, SamplingOptions(max_tokens=9, temperature=0.0))]
    expected = tokenizer.decode(greedy).split("\n")[0]
    assert result["capital"].rstrip("\n") == expected
    assert "Paris" in result["capital"]

    # `in [...]` under argmax: the option the model scores highest.
    context = bos + tokenizer("The colour of the clear sky is")["input_ids"]
    options = [" blue", " green", " red"]
    totals = [
        sum(s.logprob for s in await engine.score(context, tokenizer(o, add_special_tokens=False)["input_ids"]))
        for o in options
    ]
    assert result["colour"] == options[totals.index(max(totals))]

    for option, lmql_scores in zip([" blue", " green"], result["score"], strict=True):
        ours = await engine.score(context, tokenizer(option, add_special_tokens=False)["input_ids"])
        assert lmql_scores == pytest.approx([s.logprob for s in ours], abs=1e-4)
