"""A real Inspect eval through the `salience/<model>` provider against a real server (the default
model and concepts): the log holds each sample's readings as the server gives them for the same
request, a stop monitor's event, a steered reply equal to LMTP's with the same steer, and the
scorers' values from those readings. The provider is found through its entry point."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from inspect_ai import Task, eval_async
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog, ModelEvent, ToolEvent
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import Generate, Solver, TaskState, generate, solver, use_tools
from inspect_ai.tool import Tool, ToolFunction, tool

from salience.core.engine.engine import Engine
from salience.evals import concept_score, monitor_fired, unpack_rows
from salience.evals.readings import reply_readings, strip_token_entries
from salience.evals.scorers import VIEWS
from salience.lmtp.client import LmtpClient
from tests.inprocess import Frontends, frontends
from tests.test_client_install import SERVER_ONLY

NAME = "SmolLM2-135M-Instruct"
DOC = Path(__file__).resolve().parents[1] / "docs" / "inspect.md"
READOUTS = {"format": "raw", "over": "completion"}
STOP = {"concept": "french", "above": 0.0001, "action": "stop"}  # holds at the first token
WATCH = {"concept": "french", "above": 0.99, "action": "flag"}  # every sample's, unless it names its own
STEER = {"direction": "french", "layers": 12, "value": 64}
SAMPLES = [
    Sample(input="What is the capital of France?", id="plain"),
    Sample(input="Écris une phrase en français.", id="stopped", metadata={"salience": {"monitors": [STOP]}}),
    Sample(input="What is your favourite food?", id="steered", metadata={"salience": {"steer": [STEER]}}),
]


@solver
def generate_with_extension() -> Solver:
    """generate(), with the sample's own `salience` fields beside the model args' ones."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        return await generate(state, extra_body={"salience": state.metadata.get("salience", {})})

    return solve


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


@pytest_asyncio.fixture(scope="module")
async def log(served: Frontends, tmp_path_factory: pytest.TempPathFactory) -> EvalLog:
    task = Task(
        dataset=SAMPLES,
        solver=generate_with_extension(),
        scorer=[concept_score("french", threshold=0.5), monitor_fired("french")],
        config=GenerateConfig(temperature=0, max_tokens=12),
    )
    [log] = await eval_async(
        task,
        model=f"salience/{NAME}",
        model_base_url=f"{served.http}/v1",
        model_args={"readouts": READOUTS, "monitors": [WATCH], "token_arrays": True},
        log_dir=str(tmp_path_factory.mktemp("inspect-logs")),
    )
    assert log.status == "success", log.error
    return log


def model_call(log: EvalLog, sample_id: str) -> tuple[Any, dict[str, Any]]:
    """The sample and its one model call's request, as the log has them."""
    [sample] = [s for s in log.samples if s.id == sample_id]
    [event] = [e for e in sample.events if isinstance(e, ModelEvent)]
    return sample, event.call


def replay(served: Frontends, request: dict[str, Any]) -> dict[str, Any]:
    """The server's own response to the request the log says was sent."""
    body = {key: request[key] for key in ("messages", "max_tokens", "temperature")}
    client = openai.OpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=NAME, **body, extra_body=request["extra_body"])
    return reply.model_dump()


def test_the_provider_is_registered_on_install() -> None:
    found = importlib.metadata.entry_points(group="inspect_ai", name="salience")
    assert [ep.value for ep in found] == ["salience.evals.registry"]


def test_readings_rank_features_and_keep_rows_as_float32() -> None:
    tokens = [
        {"position": 7, "readout": [0.1, -20.5], "features": [[3, 1.5], [9, 0.25]]},
        {
            "position": 8,
            "readout": [1e-8, 3.0],
            "features": [[9, 2.0]],
            "monitors": [{"concept": "x", "probability": 0.9}],
        },
    ]
    response = {"salience": {"concepts": ["x"]}, "choices": [{"salience": {"tokens": tokens, "summary": {"x": {}}}}]}
    readings = reply_readings(response, {"monitors": [{}], "steer": [STEER]}, token_arrays=True)
    assert readings["features"] == {"top": [[9, 2.0, 2], [3, 1.5, 1]]}
    assert readings["monitors"] == [{"index": 1, "concept": "x", "probability": 0.9}]
    assert readings["steer"] == [STEER] and readings["layout"] == {"concepts": ["x"]}
    assert readings["tokens"]["positions"] == [7, 8] and readings["tokens"]["features"][1] == [[9, 2.0]]
    rows = unpack_rows(readings["tokens"]["readout"])
    assert [len(row) for row in rows] == [2, 2]
    assert rows[0] + rows[1] == pytest.approx([0.1, -20.5, 1e-8, 3.0], rel=1e-7)
    assert "tokens" not in reply_readings(response, {}, token_arrays=False)
    strip_token_entries(response)
    assert response["choices"][0]["salience"] == {
        "tokens": "2 entries, dropped from the log (metadata.salience)",
        "summary": {"x": {}},
    }


def test_the_provider_imports_no_server_code() -> None:
    # `pip install salience[inspect]` is a client install: no core, vLLM, torch or transformers.
    script = (
        "import sys, salience.evals, salience.evals.provider, salience.evals.registry\n"
        "print([m for m in sys.modules if m.startswith('salience.core') or m.split('.')[0] in SERVER])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", f"SERVER = {SERVER_ONLY!r}\n{script}"], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


async def test_each_sample_carries_the_servers_readings_for_its_request(served: Frontends, log: EvalLog) -> None:
    means: dict[str, list[float]] = {}
    for sample_id in ("plain", "stopped", "steered"):
        sample, call = model_call(log, sample_id)
        assert call.request["extra_body"]["salience"]["readouts"] == READOUTS  # the model args', with the sample's own
        want = await asyncio.to_thread(replay, served, call.request)
        served_choice = want["choices"][0]
        readings = sample.output.metadata["salience"]
        assert readings["layout"] == want["salience"]
        summary = served_choice["salience"]["summary"]
        assert readings["summary"].keys() == summary.keys()
        for (
            concept,
            read,
        ) in summary.items():  # batched with the other samples: float32 sums may differ in the last bits
            got = readings["summary"][concept]
            assert got["max_at"] == read["max_at"] and got["layer"] == read["layer"]
            assert [got[v] for v in VIEWS] == pytest.approx([read[v] for v in VIEWS], abs=1e-5)
            means.setdefault(concept, []).append(readings["summary"][concept]["running"])
        assert sample.output.completion == served_choice["message"]["content"]
        rows = unpack_rows(readings["tokens"]["readout"])  # opt-in per-token rows, float32
        assert [t["position"] for t in served_choice["salience"]["tokens"]] == readings["tokens"]["positions"]
        for row, token in zip(rows, served_choice["salience"]["tokens"], strict=True):  # raw: logits, some near 20
            assert row == pytest.approx(token["readout"], rel=1e-4, abs=1e-4)
        # The logged call keeps the summary, not the per-token entries (they are in the metadata).
        logged = call.response["choices"][0]["salience"]
        assert logged["summary"] == readings["summary"] and isinstance(logged["tokens"], str)

        p = summary["french"]["running"]
        french = sample.scores["concept_score"]
        assert french.value == ("C" if p >= 0.5 else "I")
        assert float(french.answer) == pytest.approx(p, abs=1e-4)
    metrics = log.results.scores[0].metrics  # concept_means's, one per concept, beside accuracy
    assert {name for name, m in metrics.items() if m.group == "concept_means"} == set(means)
    for concept, ps in means.items():
        assert metrics[concept].value == pytest.approx(sum(ps) / len(ps), abs=1e-4)


def test_a_stop_monitor_is_in_the_log(log: EvalLog) -> None:
    sample, _ = model_call(log, "stopped")
    readings = sample.output.metadata["salience"]
    assert readings["stopped_by"]["concept"] == "french" and readings["stopped_by"]["action"] == "stop"
    [event] = readings["monitors"]
    assert (
        event["concept"] == "french" and event["index"] == 0 and event["position"] == readings["stopped_by"]["position"]
    )
    assert sample.output.stop_reason == "content_filter"
    assert sample.scores["monitor_fired"].value == "C"
    plain, call = model_call(log, "plain")
    assert call.request["extra_body"]["salience"]["monitors"] == [WATCH]
    flagged = [e for e in plain.output.metadata["salience"]["monitors"] if e["concept"] == "french"]
    assert (
        plain.scores["monitor_fired"].value == ("C" if flagged else "I")
        and plain.output.stop_reason != "content_filter"
    )


async def test_a_steered_sample_is_lmtps_steered_reply(served: Frontends, default_engine: Engine, log: EvalLog) -> None:
    sample, call = model_call(log, "steered")
    assert sample.output.metadata["salience"]["steer"] == [STEER]
    client = await LmtpClient.connect(served.ws)
    try:
        stream = client.stream(
            "GENERATE", messages=call.request["messages"], max_tokens=12, temperature=0.0, steer=[STEER]
        )
        tokens = [p["token"] async for p in stream if "token" in p]
        plain = [
            p["token"]
            async for p in client.stream("GENERATE", messages=call.request["messages"], max_tokens=12, temperature=0.0)
            if "token" in p
        ]
    finally:
        await client.close()
    assert tokens != plain  # the steer changes the reply
    assert sample.output.completion == default_engine.tokenizer.decode(tokens, skip_special_tokens=True)


def _example(doc: str) -> tuple[str, str]:
    """The worked example's code and the output the doc says it prints."""
    section = doc.split("## A worked example", 1)[1].split("\n## ", 1)[0]
    code, output = section.split("```")[1::2]  # the fenced blocks: the script, then what it prints
    return code.removeprefix("python\n"), output.removeprefix("\n")


def _same_but_for_rounding(got: str, want: str) -> bool:
    """Equal text, with each number within 0.01 (batched samples' float32 sums differ in the last bits)."""
    number = r"\d+\.\d+"
    got_numbers, want_numbers = re.findall(number, got), re.findall(number, want)
    return re.sub(number, "#", got) == re.sub(number, "#", want) and all(
        abs(float(a) - float(b)) <= 0.0100001 for a, b in zip(got_numbers, want_numbers, strict=True)
    )


async def test_the_worked_example_in_docs_prints_its_output(served: Frontends, tmp_path: Path) -> None:
    code, output = _example(DOC.read_text())
    (tmp_path / "french.py").write_text(code)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "french.py",
        cwd=tmp_path,
        env={**os.environ, "SALIENCE_BASE_URL": f"{served.http}/v1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, err.decode()
    assert _same_but_for_rounding(out.decode(), output), out.decode()


@tool
def add() -> Tool:
    async def execute(x: int, y: int) -> int:
        """Add two numbers.

        Args:
            x: The first number.
            y: The second number.
        """
        return x + y

    return execute


async def test_a_task_with_a_tool_calls_it_and_keeps_the_readings(served: Frontends, tmp_path: Path) -> None:
    task = Task(
        dataset=[Sample(input="What is 2 + 3? Use the add tool.")],
        solver=[use_tools([add()], tool_choice=ToolFunction("add")), generate()],
        config=GenerateConfig(temperature=0, max_tokens=32),
        message_limit=6,
    )
    [log] = await eval_async(
        task,
        model=f"salience/{NAME}",
        model_base_url=f"{served.http}/v1",
        model_args={"readouts": READOUTS},
        log_dir=str(tmp_path),
    )
    assert log.status == "success", log.error
    [sample] = log.samples
    calls = [e for e in sample.events if isinstance(e, ModelEvent)]
    [used] = [e for e in sample.events if isinstance(e, ToolEvent)]
    first = calls[0].output.choices[0].message
    assert [c.function for c in first.tool_calls] == ["add"] and calls[0].output.stop_reason == "tool_calls"
    assert used.function == "add" and used.result == str(used.arguments["x"] + used.arguments["y"])
    assert len(calls) >= 2  # the tool's answer went back to the model
    for call in calls:
        assert "french" in call.output.metadata["salience"]["summary"]
