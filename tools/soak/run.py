"""Scheduling (a deck of jobs, connections shared by workers) and the run from start to report."""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time

from salience.lmtp.client import LmtpClient
from tools.soak.connection import Connection
from tools.soak.faults import BAD_INPUTS, bad_input_job, disconnect_job, duplicate_stream_id, oversized_frame_job
from tools.soak.grpc_sessions import describe, grpc_worker
from tools.soak.options import MIB, SERVER_DEFAULT_MESSAGE_BYTES, SoakOptions, say
from tools.soak.report import SoakReport
from tools.soak.server import Monitor, Sample, Server, leftovers
from tools.soak.state import Job, Model, Soak
from tools.soak.streams import CANCEL_MOMENTS, cancel_job, valid_generate, valid_score
from tools.soak.tally import Tally


def jobs(model: Model, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, Job]]:
    """Every LMTP job with its share of a deck."""
    table: dict[str, tuple[int, Job]] = {
        "generate/greedy": (4, lambda s, c, r: valid_generate(s, c, r, "generate/greedy")),
        "generate/sampled": (4, lambda s, c, r: valid_generate(s, c, r, "generate/sampled")),
        "generate/text": (2, lambda s, c, r: valid_generate(s, c, r, "generate/text")),
        "score": (3, valid_score),
        "duplicate-stream-id": (1, duplicate_stream_id),
    }
    if model.readout_width:
        table["generate/readout"] = (2, lambda s, c, r: valid_generate(s, c, r, "generate/readout"))
    for moment in CANCEL_MOMENTS:
        table[f"cancel/{moment}"] = (1, lambda s, c, r, m=moment: cancel_job(s, c, r, m))
    for kind in BAD_INPUTS:
        table[kind] = (1, lambda s, c, r, k=kind: bad_input_job(s, c, r, k))
    return {kind: job for kind, job in table.items() if kind not in skip}


class Deck:
    """Jobs in shuffled rounds: every kind comes up each round, in proportion to its share."""

    def __init__(self, table: dict[str, tuple[int, Job]], rng: random.Random) -> None:
        self._table = table
        self._rng = rng
        self._cards: list[str] = []

    def draw(self) -> Job:
        if not self._cards:
            self._cards = [name for name, (share, _) in self._table.items() for _ in range(share)]
            self._rng.shuffle(self._cards)
        return self._table[self._cards.pop()][1]


class Slot:
    """One LMTP connection shared by several workers; reopened if the server drops it."""

    def __init__(self, soak: Soak) -> None:
        self._soak = soak
        self._lock = asyncio.Lock()
        self.conn: Connection | None = None

    async def connection(self) -> Connection:
        async with self._lock:
            if self.conn is not None and self.conn.dropped is not None:
                self._soak.tally.dropped_connections += 1
                self._soak.tally.problem(f"LOST connection: {self.conn.dropped}")
                await self.close()
            if self.conn is None:
                soak = self._soak
                self.conn = await Connection.open(soak.server.url, soak.options.auth_token, soak.server.context())
            return self.conn

    async def close(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self._soak.tally.strays += len(conn.strays)
            for kind, payload, _ in conn.strays[:5]:
                self._soak.tally.problem(f"STRAY {kind} payload for no running stream: {str(payload)[:120]}")
            await conn.close()


async def lmtp_worker(soak: Soak, slot: Slot, deck: Deck, rng: random.Random) -> None:
    while soak.running():
        with tool_errors(soak):
            conn = await slot.connection()
            await deck.draw()(soak, conn, rng)


async def disconnect_worker(soak: Soak, rng: random.Random) -> None:
    """Connections of their own: dropped by this side mid-stream, or sent a frame too large to read
    (the first one always, so that a short soak has one)."""
    first = True
    while soak.running():
        await asyncio.sleep(rng.uniform(1.0, 4.0))
        with tool_errors(soak):
            oversized = first or rng.random() < 0.25
            first = False
            if soak.server.max_frame_bytes and "oversized-frame" not in soak.options.skip and oversized:
                await oversized_frame_job(soak)
            else:
                await disconnect_job(soak, rng)


@contextlib.contextmanager
def tool_errors(soak: Soak):
    """A job that fails in this tool (or cannot connect) is noted and the worker goes on."""
    try:
        yield
    except (Exception, TimeoutError) as error:
        soak.tally.tool_errors += 1
        soak.tally.problem(f"ERROR in a job: {describe(error)}")


async def progress(soak: Soak, monitor: Monitor) -> None:
    while True:
        await asyncio.sleep(soak.options.progress_every)
        say(progress_line(soak, monitor.samples[-1] if monitor.samples else None))


def progress_line(soak: Soak, sample: Sample | None) -> str:
    streams, tally = soak.tally.streams.values(), soak.tally
    elapsed = time.monotonic() - soak.started_at
    text = (
        f"[{elapsed:4.0f} s] streams {sum(t.started for t in streams)} started "
        f"{sum(t.completed for t in streams)} completed {tally.lost} lost | "
        f"tokens {sum(t.tokens for t in streams)} | bad inputs {sum(t.sent for t in tally.faults.values())} "
        f"({tally.wrong} wrong)"
    )
    if tally.ttft_loaded:
        text += f" | ttft p50 {statistics.median(tally.ttft_loaded[-200:]):.3f} s"
    if sample is not None:
        text += f" | rss {sample.rss / MIB:.0f} MiB fds {sample.fds}"
    return text


async def model_and_idle_ttft(server: Server, options: SoakOptions, tally: Tally) -> Model:
    """MODEL_INFO, then a few single greedy streams one after another: time to first token, idle."""
    headers = {"Authorization": f"Bearer {options.auth_token}"} if options.auth_token else None
    client = await LmtpClient.connect(server.url, headers=headers, tls=server.context())
    try:
        model = Model.from_info((await client.request("MODEL_INFO"))["model_info"])
        rng = random.Random(options.seed - 1)
        for _ in range(options.idle_streams + 1):  # the first warms up and is not counted
            started = time.perf_counter()
            fields = {"prompt": model.prompt(rng), "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            stream = aiter(client.stream("GENERATE", **fields))
            await anext(stream)
            tally.ttft_idle.append(time.perf_counter() - started)
            async for _ in stream:
                pass
        del tally.ttft_idle[0]
        return model
    finally:
        await client.close()


async def run_soak(options: SoakOptions) -> SoakReport:
    if options.url is None:
        server = Server.start(options)
    else:
        limit = options.max_message_bytes or SERVER_DEFAULT_MESSAGE_BYTES
        grpc_target = options.grpc or "127.0.0.1:50051"
        server = Server(options.url, grpc_target, options.pid, limit, options.max_frame_bytes)
    try:
        await server.wait_ready(options.start_timeout)
        tally = Tally()
        model = await model_and_idle_ttft(server, options, tally)
        soak = Soak(options, server, model, tally)
        monitor = Monitor(server.pid)
        seconds = await load(soak, monitor)
        report = SoakReport(options, server, model, tally, monitor.samples, seconds, server_died=not server.alive())
        if server.alive():
            report.leftovers = await leftovers(server, options.auth_token)
    finally:
        exit_code, exit_seconds = await asyncio.to_thread(server.stop)
    report.server_exit, report.exit_seconds = exit_code, exit_seconds
    return report


async def load(soak: Soak, monitor: Monitor) -> float:
    """Run every worker until the deadline, let their last jobs end, close every connection."""
    options = soak.options
    monitor.sample()
    soak.started_at = time.monotonic()
    soak.deadline = soak.started_at + options.seconds
    rng = random.Random(options.seed)
    deck = Deck(jobs(soak.model, options.skip), rng)
    slots = [Slot(soak) for _ in range(options.connections)]
    workers = [
        lmtp_worker(soak, slot, deck, random.Random(rng.random())) for slot in slots for _ in range(options.streams)
    ]
    workers += [grpc_worker(soak, random.Random(rng.random())) for _ in range(options.sessions)]
    workers.append(disconnect_worker(soak, random.Random(rng.random())))
    background = [asyncio.create_task(monitor.run(options.sample_every)), asyncio.create_task(progress(soak, monitor))]
    try:
        await asyncio.gather(*workers)
    finally:
        for slot in slots:
            await slot.close()
        for task in background:
            task.cancel()
    seconds = time.monotonic() - soak.started_at
    await asyncio.sleep(2)  # closed connections' descriptors go
    monitor.sample()
    return seconds
