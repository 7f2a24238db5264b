"""What docs/openai.md says about reading the `salience` object from LangChain and pydantic-ai: its
examples run against a real server and give the summary the `openai` client gets for the same
request (litellm is checked by hand: it is no test dependency)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from tests.inprocess import Frontends, frontends

NAME = "SmolLM2-135M-Instruct"
DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
URL = "http://127.0.0.1:8080/v1"  # as the examples write it
PROMPT = "Écris une phrase en français."


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


def examples() -> list[str]:
    """The section's Python blocks: LangChain's, pydantic-ai's, litellm's."""
    section = DOC.read_text().split("### Reading it from client libraries", 1)[1].split("\n## ", 1)[0]
    blocks = [block.removeprefix("python\n") for block in section.split("```")[1::2] if block.startswith("python\n")]
    assert len(blocks) == 3
    return blocks


def run(code: str, served: Frontends) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(code.replace(URL, f"{served.http}/v1"), str(DOC), "exec"), namespace)
    return namespace


def summary_by_openai(served: Frontends) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": PROMPT}],
        temperature=0,
        max_tokens=16,
        extra_body={"salience": {"readouts": {"format": "raw"}}},
    )
    return reply.choices[0].model_extra["salience"]["summary"]


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys() and "french" in got
    for concept, read in want.items():
        assert got[concept]["running"] == pytest.approx(read["running"], abs=1e-5)
        assert got[concept]["max_at"] == read["max_at"]


async def test_langchain_keeps_it_through_the_documented_subclass(served: Frontends) -> None:
    namespace = await asyncio.to_thread(run, examples()[0], served)
    reply = namespace["reply"]
    assert_same(reply.response_metadata["salience"]["summary"], await asyncio.to_thread(summary_by_openai, served))
    # Without the subclass, LangChain drops it: the table's "no".
    llm = namespace["ChatOpenAI"](
        base_url=f"{served.http}/v1",
        api_key="unused",
        model=NAME,
        max_tokens=8,
        extra_body={"salience": {"readouts": {}}},
    )
    plain = await asyncio.to_thread(llm.invoke, PROMPT)
    assert "salience" not in plain.response_metadata and "salience" not in plain.additional_kwargs


async def test_pydantic_ai_keeps_it_when_asked(served: Frontends) -> None:
    namespace = await asyncio.to_thread(run, examples()[1], served)
    assert_same(namespace["salience"]["summary"], await asyncio.to_thread(summary_by_openai, served))
    details = namespace["result"].response.provider_details["unmapped"]
    assert details["response"]["salience"]["concepts"]  # the layout
