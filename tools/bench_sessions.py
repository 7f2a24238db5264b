"""Sessions against statelessness: a 20-turn conversation, deltas vs the whole history each turn.

One engine, one gRPC server, one run. Each turn appends ~400 new tokens and decodes 16
(greedy). (a) A session: each Generate sends only the new tokens. (b) Stateless: each turn
opens a fresh session and sends the whole history. The two alternate turn by turn (who goes
first alternates too) on two conversations of the same shape but different tokens, so neither
warms the other's prefix cache; each still reuses its own, as vLLM's cache serves any client
that resends the same tokens. Prints the mean time and Generate request bytes per turn, the last
turn's, and their ratios.

    .venv/bin/python -m tools.bench_sessions [--turns 20] [--turn-tokens 380] [--decode 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as `python tools/bench_sessions.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from salience.logs import setup_logging

configure_environment()
setup_logging()  # before vLLM is imported: its processes log quietly too

from salience.core.engine.engine import Engine  # noqa: E402
from salience.core.engine.settings import EngineSettings  # noqa: E402
from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from salience.core.serving.sessions import SessionStore  # noqa: E402
from salience.core.serving.status import ServerStatus  # noqa: E402
from salience.grpc_frontend.client import AsyncSalienceClient  # noqa: E402
from salience.grpc_frontend.server import start_grpc_server  # noqa: E402
from salience.proto.salience.v1 import salience_pb2 as pb  # noqa: E402
from tools.harness import Report, arguments, rotations, run_main, say  # noqa: E402

MODES = ("session", "stateless")


def request_bytes(append: list[int], offset: int, decode: int) -> int:
    return pb.GenerateRequest(
        session_id="x" * 22, append_tokens=append, offset=offset, max_tokens=decode, top_k=1
    ).ByteSize()


async def main(args: argparse.Namespace) -> None:
    model = ensure_default_model()
    settings = EngineSettings(model=model, served_model_name=DEFAULT_MODEL_NAME, max_model_len=8192)
    say("loading the engine ...")
    engine = await Engine.start(settings)
    status = ServerStatus(DEFAULT_MODEL_NAME)
    status.ready(engine)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0)
    vocab = engine.vocab_size
    report = Report("bench_sessions", args)
    samples = report.samples
    try:
        async with AsyncSalienceClient(f"127.0.0.1:{server.port}") as client:
            session = await client.open_session(DEFAULT_MODEL_NAME)
            history: list[int] = []  # the stateless conversation's

            async def turn_of(mode: str, turn: int) -> tuple[float, int]:
                """One turn of `mode`: its seconds, and the bytes of its Generate request."""
                nonlocal history
                new = [(1009 * turn + 37 * j) % (vocab - 200) + 100 for j in range(args.turn_tokens)]
                if mode == "session":
                    started = time.perf_counter()
                    decoded = (await session.generate(new, max_tokens=args.decode, top_k=1)).token_ids
                    seconds = time.perf_counter() - started
                    return seconds, request_bytes(new, session.length - len(new) - len(decoded), args.decode)
                sent = history + [(t + 7) % (vocab - 200) + 100 for t in new]
                started = time.perf_counter()
                fresh = await client.open_session(DEFAULT_MODEL_NAME)
                reply = await fresh.generate(sent, max_tokens=args.decode, top_k=1)
                await fresh.close()
                seconds = time.perf_counter() - started
                history = sent + reply.token_ids
                return seconds, request_bytes(sent, 0, args.decode)

            for turn, mode in rotations(MODES, args.turns):  # who goes first alternates turn by turn
                seconds, size = await turn_of(mode, turn)
                samples.add(
                    f"{mode:9} {seconds * 1e3:7.1f} ms {size:7d} B, history {session.length:5d} tokens",
                    {f"{mode} ms": seconds * 1e3, f"{mode} bytes": size},
                )
    finally:
        await server.stop(0)
        engine.shutdown()
    table = report.table(
        f"{DEFAULT_MODEL_NAME}, {args.turns} turns of {args.turn_tokens} new tokens, {args.decode} decoded each",
        ("", ""),
        ("session", "{:.1f}"),
        ("stateless", "{:.1f}"),
        ("stateless / session", "{:.2f}x"),
    )
    for what, unit in (("mean time per turn, ms", "ms"), ("mean Generate request, bytes", "bytes")):
        session_mean, stateless_mean = (samples.mean(f"{mode} {unit}") for mode in MODES)
        table.add(what, session_mean, stateless_mean, stateless_mean / session_mean)
    for what, unit in (("last turn time, ms", "ms"), ("last turn Generate request, bytes", "bytes")):
        session_last, stateless_last = (samples.series[f"{mode} {unit}"][-1] for mode in MODES)
        table.add(what, session_last, stateless_last, stateless_last / session_last)
    report.emit()


if __name__ == "__main__":
    parser = arguments(__doc__, repeats=None)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=380)
    parser.add_argument("--decode", type=int, default=16)
    run_main(main(parser.parse_args()))
