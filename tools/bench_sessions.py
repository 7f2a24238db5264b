"""Sessions against statelessness: a 20-turn conversation, deltas vs the whole history each turn.

One engine, one gRPC server, one run. Each turn appends ~400 new tokens and decodes 16
(greedy). (a) A session: each Generate sends only the new tokens. (b) Stateless: each turn
opens a fresh session and sends the whole history. The two alternate turn by turn (who goes
first alternates too) on two conversations of the same shape but different tokens, so neither
warms the other's prefix cache; each still reuses its own, as vLLM's cache serves any client
that resends the same tokens. Prints time and Generate request bytes per turn, and ratios.

    .venv/bin/python tools/bench_sessions.py [--turns 20] [--turn-tokens 380] [--decode 16]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

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


def request_bytes(append: list[int], offset: int, decode: int) -> int:
    return pb.GenerateRequest(
        session_id="x" * 22, append_tokens=append, offset=offset, max_tokens=decode, top_k=1
    ).ByteSize()


async def main(args: argparse.Namespace) -> None:
    model = ensure_default_model()
    settings = EngineSettings(model=model, served_model_name=DEFAULT_MODEL_NAME, max_model_len=8192)
    print("loading the engine ...", flush=True)
    engine = await Engine.start(settings)
    status = ServerStatus(DEFAULT_MODEL_NAME)
    status.ready(engine)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0)
    vocab = engine.vocab_size
    try:
        async with AsyncSalienceClient(f"127.0.0.1:{server.port}") as client:
            session = await client.open_session(DEFAULT_MODEL_NAME)
            history: list[int] = []  # the stateless conversation's
            rows = []
            for turn in range(args.turns):
                new = [(1009 * turn + 37 * j) % (vocab - 200) + 100 for j in range(args.turn_tokens)]
                other = [(t + 7) % (vocab - 200) + 100 for t in new]
                timings = {}
                order = ("session", "stateless") if turn % 2 == 0 else ("stateless", "session")
                for mode in order:
                    started = time.perf_counter()
                    if mode == "session":
                        result = await session.generate(new, max_tokens=args.decode, top_k=1)
                        decoded = result.token_ids
                    else:
                        fresh = await client.open_session(DEFAULT_MODEL_NAME)
                        stateless = await fresh.generate(history + other, max_tokens=args.decode, top_k=1)
                        await fresh.close()
                    timings[mode] = time.perf_counter() - started
                sizes = (
                    request_bytes(new, session.length - len(new) - len(decoded), args.decode),
                    request_bytes(history + other, 0, args.decode),
                )
                history += other + stateless.token_ids
                rows.append((timings["session"], timings["stateless"], *sizes))
                print(
                    f"turn {turn + 1:2d}/{args.turns}  history {session.length:5d} tokens  "
                    f"session {timings['session'] * 1e3:7.1f} ms {sizes[0]:7d} B   "
                    f"stateless {timings['stateless'] * 1e3:7.1f} ms {sizes[1]:7d} B",
                    flush=True,
                )
    finally:
        await server.stop(0)
        engine.shutdown()
    session_ms = statistics.mean(r[0] for r in rows) * 1e3
    stateless_ms = statistics.mean(r[1] for r in rows) * 1e3
    session_b = statistics.mean(r[2] for r in rows)
    stateless_b = statistics.mean(r[3] for r in rows)
    print(f"\nmean per turn: session {session_ms:.1f} ms, {session_b:.0f} B;", end=" ")
    print(f"stateless {stateless_ms:.1f} ms, {stateless_b:.0f} B")
    print(f"ratio stateless/session: time {stateless_ms / session_ms:.2f}x, bytes {stateless_b / session_b:.1f}x")
    last = rows[-1]
    print(f"last turn: time {last[1] / last[0]:.2f}x, bytes {last[3] / last[2]:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-tokens", type=int, default=380)
    parser.add_argument("--decode", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
