"""Where a short LMTP request's time goes, stage by stage: one GENERATE and one SCORE of the
shapes LMQL sends, on `salience serve` with its default flags, run in this process.

The server is the real one (salience.cli.serve.configure and salience.server.serve, its vLLM
engine core in its own process as always); the client is an aiohttp WebSocket in the same
event loop, sending one request at a time. Clock readings (perf_counter, one clock for the
process) are taken where a request crosses a stage, by wrapping the functions it crosses:

    wire in        the client's send -> LmtpSession.receive
    parse          receive -> the line parsed (codec)
    admission      parsed -> admitted (ServerStatus.admit: limits, fair-share entry)
    to core        admitted -> Engine.generate / score_pass called (task start, prompt, checks)
    core           inside Engine.generate / score_pass until vLLM's generator is first asked
    first step     vLLM's generator asked -> its first output (queue, prefill, one step, IPC)
    decode         first output -> last output
    to outbox      last output -> the stream's last payload queued
    wire out       queued -> the client holds the last frame

Beside it, the floor: the same request straight on the same engine's AsyncLLM (vLLM's own
generate, no Salience code), measured in the same run, alternating with the LMTP requests.

    .venv/bin/python -m tools.bench_stages [--repeats 30] [--json PATH]
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson

if not __package__:  # run as `python tools/bench_stages.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.harness import HOST, Report, arguments, free_port, say

STAGES = (
    ("wire in", "send", "receive"),
    ("parse", "receive", "parsed"),
    ("admission", "parsed", "admitted"),
    ("to core", "admitted", "core"),
    ("core", "core", "submit"),
    ("first step", "submit", "first output"),
    ("decode", "first output", "last output"),
    ("to outbox", "last output", "queued"),
    ("wire out", "queued", "received"),
)
# LMQL's shapes (notes/lmtp-as-lmql-speaks-it.md): a greedy chunk with its top logprob, and a score.
PROMPT = [1, 504, 3458, 282, 4649, 314, 1977, 30, 378, 3458, 282, 4649, 314]
GENERATE = {"max_tokens": 8, "temperature": 0.0, "top_logprobs": 1, "prompt": PROMPT}
SCORE = {"prompt": PROMPT, "scored": [7042, 30]}

marks: dict[str, float] = {}  # the request in flight: stage name -> perf_counter


def mark(name: str) -> None:
    marks.setdefault(name, time.perf_counter())  # the first crossing: a stage is entered once


def after(function: Callable, name: str) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        mark(name)
        return result

    return wrapper


def before(function: Callable, name: str) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        mark(name)
        return function(*args, **kwargs)

    return wrapper


def install() -> None:
    """Wrap the functions a request crosses (module attributes, looked up at call time)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from salience.core.engine.engine import Engine
    from salience.core.serving.status import ServerStatus
    from salience.lmtp import running, session

    session.LmtpSession.receive = before(session.LmtpSession.receive, "receive")
    session.parse_client_line = after(session.parse_client_line, "parsed")
    ServerStatus.admit = after(ServerStatus.admit, "admitted")
    Engine.generate = before(Engine.generate, "core")
    Engine.score_pass = before(Engine.score_pass, "core")
    generate = AsyncLLM.generate

    @functools.wraps(generate)
    async def traced(self, *args, **kwargs) -> AsyncIterator:
        mark("submit")
        async for output in generate(self, *args, **kwargs):
            marks["last output"] = time.perf_counter()
            mark("first output")
            yield output

    AsyncLLM.generate = traced
    token = running.RunningStreams._token

    def queued(self, stream, payload: dict) -> None:
        token(self, stream, payload)
        if payload.get("finish_reason") is not None:
            mark("queued")

    running.RunningStreams._token = queued


async def lmtp(ws, kind: str, body: dict, stream_id: int, model: str) -> dict[str, float]:
    """One request over the WebSocket: its marks, once the client holds its last payload."""
    marks.clear()
    line = f"{kind} " + orjson.dumps({**body, "stream_id": stream_id, "model": model}).decode()
    marks["send"] = time.perf_counter()
    await ws.send_str(line)
    while True:
        message = await ws.receive()
        payloads = orjson.loads(message.data.split(" ", 1)[1])
        if any(p.get("stream_id") == stream_id and (p.get("finish_reason") or "error" in p) for p in payloads):
            marks["received"] = time.perf_counter()
            if any("error" in p for p in payloads):
                raise RuntimeError(f"{kind} failed: {payloads}")
            return dict(marks)


async def floor(engine, kind: str) -> float:
    """The same request on vLLM's AsyncLLM alone: seconds from the call to its last output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if kind == "GENERATE":
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, output_kind=RequestOutputKind.DELTA)
        prompt = PROMPT
    else:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompt = PROMPT + SCORE["scored"]
    began = time.perf_counter()
    async for _ in engine.llm.generate({"prompt_token_ids": prompt}, params, os.urandom(8).hex()):
        pass
    return time.perf_counter() - began


async def run(args) -> Report:
    import aiohttp

    from salience import cli
    from salience.cli.serve import configure
    from salience.core.models.home import configure_environment
    from salience.core.serving.status import ServerStatus
    from salience.logs import setup_logging
    from salience.server import serve

    port = free_port()
    configure_environment()
    setup_logging("warning")  # as `salience serve` runs: its logs quiet, vLLM's per-request lines off
    settings, options = configure(cli.parse(["serve", "--lmtp-port", str(port), "--no-grpc"]))
    ready = asyncio.Event()
    status_ready = ServerStatus.ready

    def on_ready(self, engine) -> None:
        status_ready(self, engine)
        on_ready.engine = engine
        ready.set()

    ServerStatus.ready = on_ready
    install()
    say("starting the server (compiled, as `salience serve`)")
    server = asyncio.create_task(serve(settings, options))
    await ready.wait()
    engine = on_ready.engine
    report = Report("bench_stages", args)
    samples = report.samples
    async with aiohttp.ClientSession() as client, client.ws_connect(f"ws://{HOST}:{port}/") as ws:
        stream = 0
        for _ in range(3):  # the first requests of a connection and of the engine: not timed
            for kind, body in (("GENERATE", GENERATE), ("SCORE", SCORE)):
                stream += 1
                await lmtp(ws, kind, body, stream, settings.served_model_name)
                await floor(engine, kind)
        for i in range(args.repeats):
            values = {}
            for kind, body in (("GENERATE", GENERATE), ("SCORE", SCORE)):
                stream += 1
                got = await lmtp(ws, kind, body, stream, settings.served_model_name)
                for stage, start, end in STAGES:
                    if start in got and end in got:
                        values[f"{kind} {stage}"] = 1e3 * (got[end] - got[start])
                values[f"{kind} total"] = 1e3 * (got["received"] - got["send"])
                values[f"{kind} floor"] = 1e3 * await floor(engine, kind)
            samples.add(f"{i + 1}/{args.repeats}: GENERATE {values['GENERATE total']:.1f} ms", values)
    os.kill(os.getpid(), signal.SIGINT)  # the server's own stop
    await server
    table = report.table(
        f"One request at a time, median of {args.repeats} (ms)",
        ("stage", ""),
        ("GENERATE (8 tokens, top 1)", "{:.2f}"),
        ("SCORE (2 tokens)", "{:.2f}"),
    )
    for stage, _, _ in STAGES:
        table.add(stage, *(samples.median(f"{kind} {stage}") for kind in ("GENERATE", "SCORE")))
    table.add("total, send to last frame", *(samples.median(f"{kind} total") for kind in ("GENERATE", "SCORE")))
    table.add("vLLM AsyncLLM alone (floor)", *(samples.median(f"{kind} floor") for kind in ("GENERATE", "SCORE")))
    table.add(
        "Salience / floor",
        *(samples.median(f"{kind} total") / samples.median(f"{kind} floor") for kind in ("GENERATE", "SCORE")),
    )
    return report


def main() -> None:
    args = arguments(__doc__, repeats=30).parse_args()
    asyncio.run(run(args)).emit()


if __name__ == "__main__":
    main()
