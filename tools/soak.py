"""Soak: hold a Salience server under mixed load with faults injected, and count what is lost.

    .venv/bin/python tools/soak.py [MODEL_DIR] [--seconds 600] [--connections 4] [--streams 4]
    .venv/bin/python tools/soak.py --url ws://127.0.0.1:8080/ --grpc 127.0.0.1:50051 --pid PID

Without --url it starts `salience serve` on free ports (the embedded model unless MODEL_DIR is
given) with LMTP messages limited to 1 MiB and frames to 2 MiB, so oversized ones are cheap to
send, and stops it with SIGTERM at the end; with --url it attaches to a running server (--pid
for its memory and file descriptors).

Theory of operation. --connections LMTP WebSockets each carry --streams workers. A worker draws
its next job from one shared deck that holds, per round, mostly valid streams (GENERATE greedy,
sampled, in text mode, with readouts when the server has a concept set; SCORE), a CANCEL at
each moment of a stream's life, and one of each bad input. Valid streams use ignore_eos and a
fixed max_tokens, so each must end with exactly that many tokens, finish_reason "length" and
its request_id. A cancelled stream must end "cancelled", or "length" if its end was already on
its way, with at most CANCEL_SLACK tokens arriving after the CANCEL went out. Each bad input
must get its specific error, with a request_id, on the channel the protocol names (a TOKEN error
for its stream, or a MSG error), and the connection must live on. Beside them --sessions workers
drive gRPC sessions through the thick client (turns with offset checks, a busy session, a
cancelled turn, Fork, Dump, Close, and their error codes), and one worker opens connections of
its own: it drops them while their streams run, or sends a frame past the frame limit (the
server must close with 1009).

A stream with no terminal payload within --stream-timeout, a wrong count, an error on a valid
stream, or a connection the server closed counts as LOST; a bad input answered by another error,
or none, as WRONG. After the load /metrics must show nothing still running or held (streams,
connections, sessions, engine requests). Exit status 1 if anything was lost, wrong or held.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import orjson
import psutil

from salience.grpc_frontend.client import AsyncSalienceClient, AsyncSession, GenerateResult
from salience.lmtp.client import LmtpClient
from salience.lmtp.codec import parse_server_line
from salience.proto.salience.v1 import salience_pb2 as pb

__all__ = ["SoakOptions", "SoakReport", "main", "run_soak"]

MIB = 1024 * 1024
SERVER_DEFAULT_MESSAGE_BYTES = 16 * MIB  # a server without --lmtp-max-message-bytes


@dataclass(kw_only=True)
class SoakOptions:
    model: Path | None = None  # None: the embedded default model
    url: str | None = None  # attach to this LMTP WebSocket instead of starting a server
    grpc: str | None = None  # host:port of the attached server's gRPC service
    pid: int | None = None  # the attached server's process, for RSS and fds
    server_args: tuple[str, ...] = ()  # more `salience serve` flags for a started server
    auth_token: str | None = None
    seconds: float = 60.0
    connections: int = 4
    streams: int = 4  # concurrent workers per connection
    sessions: int = 2  # gRPC session workers
    tokens: int = 16  # max_tokens of a valid stream; cancels and carriers run 4x as long
    max_message_bytes: int | None = None  # started server: 1 MiB; attached: what it was given
    max_frame_bytes: int | None = None  # started server: twice the message limit; attached: unknown
    stream_timeout: float = 120.0
    start_timeout: float = 900.0
    idle_streams: int = 5
    sample_every: float = 5.0
    progress_every: float = 10.0
    seed: int = 0
    skip: tuple[str, ...] = ()  # LMTP job kinds left out (e.g. "oversized")
    log: Path | None = None  # a started server's log (default: a temporary file)


# ---- tallies -------------------------------------------------------------------------------


@dataclass
class StreamTally:
    started: int = 0
    completed: int = 0
    lost: int = 0
    tokens: int = 0


@dataclass
class FaultTally:
    sent: int = 0
    specific: int = 0  # the error the input calls for, where the protocol puts it
    wrong: int = 0  # another error, no error, or the right one on the wrong channel
    unanswered: int = 0  # nothing within the timeout, or the connection dropped


@dataclass
class Tally:
    streams: defaultdict[str, StreamTally] = field(default_factory=lambda: defaultdict(StreamTally))
    faults: defaultdict[str, FaultTally] = field(default_factory=lambda: defaultdict(FaultTally))
    unexpected: Counter[str] = field(default_factory=Counter)  # errors on valid streams, by message
    problems: dict[str, list] = field(default_factory=dict)  # shape (digits masked) -> [count, first example]
    ttft_idle: list[float] = field(default_factory=list)
    ttft_loaded: list[float] = field(default_factory=list)
    dropped_connections: int = 0
    strays: int = 0
    tool_errors: int = 0  # jobs that raised: a connection refused, or a bug here

    def problem(self, text: str) -> None:
        """Note what went wrong; problems that differ only in their numbers are counted together."""
        self.problems.setdefault(re.sub(r"\d+", "N", text)[:90], [0, text])[0] += 1

    def start(self, kind: str) -> None:
        self.streams[kind].started += 1

    def complete(self, kind: str, tokens: int) -> None:
        self.streams[kind].completed += 1
        self.streams[kind].tokens += tokens

    def lose(self, kind: str, why: str, tokens: int = 0) -> None:
        self.streams[kind].lost += 1
        self.streams[kind].tokens += tokens
        self.problem(f"LOST {kind}: {why}")

    def fault(self, kind: str, verdict: str, detail: str = "") -> None:
        tally = self.faults[kind]
        tally.sent += 1
        setattr(tally, verdict, getattr(tally, verdict) + 1)
        if verdict != "specific":
            self.problem(f"WRONG {kind}: {verdict}: {detail}")

    @property
    def lost(self) -> int:
        return sum(t.lost for t in self.streams.values())

    @property
    def wrong(self) -> int:
        return sum(t.wrong + t.unanswered for t in self.faults.values())


# ---- the server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command() -> list[str]:
    return [sys.executable, "-m", "salience", "serve"]


def server_flags() -> str:
    return subprocess.run([*serve_command(), "--help"], capture_output=True, text=True, timeout=120).stdout


@dataclass
class Server:
    """Where the server listens, and its process when this tool started it."""

    url: str
    grpc: str
    pid: int | None
    max_message_bytes: int
    max_frame_bytes: int | None = None  # None: unknown, no oversized frames are sent
    process: subprocess.Popen | None = None
    log: Path | None = None

    @classmethod
    def start(cls, options: SoakOptions) -> Server:
        port, grpc_port = free_port(), free_port()
        command = [*serve_command(), "--lmtp-port", str(port), "--grpc-port", str(grpc_port)]
        if options.model is not None:
            command += ["--model", str(options.model)]
        flags = server_flags()
        limit = options.max_message_bytes or MIB
        if "--lmtp-max-message-bytes" in flags:
            command += ["--lmtp-max-message-bytes", str(limit)]
        else:
            say(f"no --lmtp-max-message-bytes: oversized messages go past the {SERVER_DEFAULT_MESSAGE_BYTES} bytes")
            limit = SERVER_DEFAULT_MESSAGE_BYTES
        frame = None
        if "--lmtp-max-frame-bytes" in flags:
            frame = options.max_frame_bytes or 2 * limit
            command += ["--lmtp-max-frame-bytes", str(frame)]
        command += list(options.server_args)
        if options.auth_token:
            command += ["--auth-token", options.auth_token]
        log = options.log or Path(tempfile.mkstemp(prefix="salience-soak-", suffix=".log")[1])
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        say(f"started `{' '.join(command[1:])}` (pid {process.pid}, log {log})")
        return cls(f"ws://127.0.0.1:{port}/", f"127.0.0.1:{grpc_port}", process.pid, limit, frame, process, log)

    def http_url(self, path: str) -> str:
        """`path` on the LMTP port, over HTTP (ws:// -> http://, wss:// -> https://)."""
        return self.url.replace("ws", "http", 1).rstrip("/") + path

    async def wait_ready(self, timeout: float) -> None:
        health = self.http_url("/health")
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with http.get(health) as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise TimeoutError(f"the server was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self, timeout: float = 90.0) -> tuple[int | None, float]:
        """SIGTERM a started server: its exit code (None: it had to be killed) and how long it took."""
        started = time.monotonic()
        if self.process is None:
            return 0, 0.0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                return None, time.monotonic() - started
        return self.process.returncode, time.monotonic() - started

    def log_tail(self, lines: int = 30) -> str:
        if self.log is None:
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True)
class Sample:
    at: float
    rss: int  # bytes, the server and its children
    fds: int


class Monitor:
    """RSS and open file descriptors of the server process tree, sampled every few seconds."""

    def __init__(self, pid: int | None) -> None:
        self._process = psutil.Process(pid) if pid else None
        self.samples: list[Sample] = []

    def sample(self) -> Sample | None:
        if self._process is None:
            return None
        rss = fds = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [self._process, *self._process.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    rss += process.memory_info().rss
                    fds += process.num_fds()
        taken = Sample(time.monotonic(), rss, fds)
        self.samples.append(taken)
        return taken

    async def run(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            self.sample()


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of value over time, per minute."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


# ---- an LMTP connection --------------------------------------------------------------------

Item = tuple[str, dict, float]  # frame type, payload, arrival (loop time)


class Connection:
    """One WebSocket; payloads routed to their stream_id's queue, MSG errors without one to
    `anonymous`, anything for an unrouted id kept as a stray. A close this side did not ask
    for is recorded in `dropped`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, http: aiohttp.ClientSession) -> None:
        self._ws = ws
        self._http = http
        self._ids = itertools.count(1)
        self._routes: dict[int, asyncio.Queue[Item | None]] = {}
        self._send_lock = asyncio.Lock()
        self.anonymous: asyncio.Queue[Item | None] = asyncio.Queue()
        self.anonymous_lock = asyncio.Lock()  # one bad input awaiting an anonymous error at a time
        self.late_cancel_errors: set[int] = set()  # a CANCEL raced the stream's end: its error may come
        self.strays: list[Item] = []
        self.closing = False
        self.dropped: str | None = None
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, token: str | None) -> Connection:
        http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"} if token else None)
        try:
            ws = await http.ws_connect(url, max_msg_size=0)
        except BaseException:
            await http.close()
            raise
        return cls(ws, http)

    @property
    def closed(self) -> bool:
        return self._reader.done()

    @property
    def close_code(self) -> int | None:
        return self._ws.close_code

    async def wait_closed(self, timeout: float) -> bool:
        """Until the server closes the connection; False if it is still open after `timeout` s."""
        done, _ = await asyncio.wait({self._reader}, timeout=timeout)
        return bool(done)

    def new_id(self) -> int:
        return next(self._ids)

    def route(self, stream_id: int) -> asyncio.Queue[Item | None]:
        queue: asyncio.Queue[Item | None] = asyncio.Queue()
        if self.closed:
            queue.put_nowait(None)
        self._routes[stream_id] = queue
        return queue

    def unroute(self, stream_id: int) -> None:
        """Stop routing `stream_id`; what arrived for it after its end is kept as a stray."""
        queue = self._routes.pop(stream_id, None)
        while queue is not None and not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                self._stray(item)

    def _stray(self, item: Item) -> None:
        """A payload for no running stream: kept, unless it is the error a CANCEL that raced its
        stream's end may earn."""
        stream_id, error = item[1].get("stream_id"), str(item[1].get("error"))
        if not (stream_id in self.late_cancel_errors and "not running" in error):
            self.strays.append(item)

    async def send(self, *lines: str) -> None:
        """The lines in one frame. A connection that has gone shows in `dropped` and in every
        route's queue, so a send that fails is left to them."""
        async with self._send_lock:
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await self._ws.send_str("\n".join(lines))

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for message in self._ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                kind, payloads = parse_server_line(message.data)
                for payload in payloads:
                    item = (kind, payload, loop.time())
                    stream_id = payload.get("stream_id")
                    if stream_id is None and kind == "MSG":
                        self.anonymous.put_nowait(item)
                    elif stream_id in self._routes:
                        self._routes[stream_id].put_nowait(item)
                    else:
                        self._stray(item)
        finally:
            if not self.closing:
                self.dropped = (
                    f"closed by the server (code {self._ws.close_code}, {self._ws.exception() or 'no error'})"
                )
            for queue in [*self._routes.values(), self.anonymous]:
                queue.put_nowait(None)

    async def close(self) -> None:
        self.closing = True
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._http.close()


def line(kind: str, payload: dict) -> str:
    return kind + " " + orjson.dumps(payload).decode()


@dataclass
class Received:
    """What arrived for one stream, up to its terminal payload."""

    tokens: list[dict] = field(default_factory=list)  # payloads with a token, prompt positions aside
    prompt: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # of each token payload, loop time
    errors: list[tuple[str, str]] = field(default_factory=list)  # (frame type, message)
    finish: str | None = None
    request_id: str | None = None  # the terminal payload's
    unnamed_errors: int = 0  # error payloads without the request_id every error must carry
    ended: str = "finished"  # finished | error | timeout | dropped

    @property
    def first_token(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    def trouble(self, timeout: float) -> str | None:
        match self.ended:
            case "timeout":
                return f"no terminal payload within {timeout:.0f} s ({len(self.tokens)} tokens)"
            case "dropped":
                return f"connection dropped after {len(self.tokens)} tokens"
            case "error":
                return f"error: {self.errors[-1][1]}"
        return None


async def receive(
    queue: asyncio.Queue[Item | None],
    timeout: float,
    *,
    on_token: Callable[[int], Awaitable[None]] | None = None,
    tolerate: Callable[[str], bool] = lambda error: False,
) -> Received:
    """Read one stream until its terminal payload, an error (unless tolerated), a drop or the timeout."""
    got = Received()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0))
        except TimeoutError:
            got.ended = "timeout"
            return got
        if item is None:
            queue.put_nowait(None)  # for the next reader of a shared queue
            got.ended = "dropped"
            return got
        kind, payload, at = item
        if payload.get("error") is not None:
            got.errors.append((kind, str(payload["error"])))
            got.unnamed_errors += not payload.get("request_id")
            if not tolerate(str(payload["error"])):
                got.ended = "error"
                return got
            continue
        if payload.get("prompt"):
            got.prompt.append(payload)
        elif "token" in payload:
            got.tokens.append(payload)
            got.arrivals.append(at)
            if on_token is not None:
                await on_token(len(got.tokens))
        if payload.get("finish_reason") is not None:
            got.finish, got.request_id = payload["finish_reason"], payload.get("request_id")
            return got


# ---- the model, as MODEL_INFO describes it ---------------------------------------------------


@dataclass(frozen=True)
class Model:
    name: str
    vocab_size: int
    max_model_len: int
    readout_width: int  # floats per readout; 0 without a concept set

    @classmethod
    def from_info(cls, info: dict) -> Model:
        manifest = info.get("readout_manifest")
        width = len(manifest["concepts"]) * len(manifest["layers"]) if manifest else 0
        return cls(info["model"], info["vocab_size"], info["max_model_len"], width)

    def prompt(self, rng: random.Random, low: int = 4, high: int = 48) -> list[int]:
        floor = min(100, self.vocab_size // 4)
        return [rng.randrange(floor, self.vocab_size) for _ in range(rng.randint(low, high))]


# ---- the run's shared state -------------------------------------------------------------------


@dataclass
class Soak:
    options: SoakOptions
    server: Server
    model: Model
    tally: Tally = field(default_factory=Tally)
    deadline: float = 0.0
    started_at: float = 0.0

    @property
    def tokens(self) -> int:
        return self.options.tokens

    @property
    def long_tokens(self) -> int:
        return 4 * self.options.tokens

    @property
    def timeout(self) -> float:
        return self.options.stream_timeout

    def running(self) -> bool:
        return time.monotonic() < self.deadline and self.server.alive()


Job = Callable[[Soak, Connection, random.Random], Awaitable[None]]


# ---- valid LMTP streams ------------------------------------------------------------------------


def generate_fields(soak: Soak, rng: random.Random, prompt: list[int], max_tokens: int, *, sampled: bool) -> dict:
    fields: dict = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    fields["top_logprobs"] = rng.choice([0, 1, 5])
    if sampled:
        fields |= {"temperature": 0.9, "top_p": rng.choice([0.9, 1.0]), "top_k": rng.choice([0, 40])}
        if rng.random() < 0.5:
            fields["seed"] = rng.randrange(2**31)
    else:
        fields["temperature"] = 0.0
    if rng.random() < 0.5:
        fields["model"] = soak.model.name
    if rng.random() < 0.5:
        fields["request_id"] = f"soak-{secrets.token_hex(6)}"
    return fields


async def valid_generate(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> None:
    prompt = soak.model.prompt(rng)
    sampled = kind == "generate/sampled" or (kind != "generate/greedy" and rng.random() < 0.5)
    fields = generate_fields(soak, rng, prompt, soak.tokens, sampled=sampled)
    text = kind == "generate/text"
    readout = kind == "generate/readout"
    if text:
        fields["text"] = True
    if readout:
        fields["readout"] = [[0, len(prompt) + soak.tokens]]
    stream_id = conn.new_id()
    queue = conn.route(stream_id)
    soak.tally.start(kind)
    sent = asyncio.get_running_loop().time()
    try:
        await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout)
    finally:
        conn.unroute(stream_id)
    why = got.trouble(soak.timeout) or check_generated(got, soak.tokens) or check_request_id(got, fields)
    if why is None and readout:
        why = check_readouts(got, len(prompt), soak.model.readout_width)
    if why is None and text and not all(isinstance(p.get("text"), str) for p in got.tokens):
        why = "a text-mode payload without text"
    settle(soak, kind, got, why)
    if why is None and not readout and got.first_token is not None:
        soak.tally.ttft_loaded.append(got.first_token - sent)


def check_request_id(got: Received, fields: dict) -> str | None:
    """The terminal payload names the stream's request id: the one the request gave, if any."""
    if not got.request_id or got.request_id != fields.get("request_id", got.request_id):
        return f"terminal payload with request_id {got.request_id!r}, expected {fields.get('request_id', 'one')!r}"
    return None


def check_generated(got: Received, max_tokens: int) -> str | None:
    if got.finish != "length":
        return f"finish_reason {got.finish!r} after {len(got.tokens)} tokens, expected 'length'"
    if len(got.tokens) != max_tokens:
        return f"{len(got.tokens)} tokens, expected {max_tokens}"
    return None


def check_readouts(got: Received, prompt_len: int, width: int) -> str | None:
    if len(got.prompt) != prompt_len:
        return f"{len(got.prompt)} prompt payloads, expected {prompt_len}"
    bad = [p for p in got.prompt + got.tokens if len(p.get("readout") or ()) != width]
    return f"{len(bad)} payloads without a {width}-float readout" if bad else None


def settle(soak: Soak, kind: str, got: Received, why: str | None) -> None:
    if why is None:
        soak.tally.complete(kind, len(got.tokens))
        return
    soak.tally.lose(kind, why, len(got.tokens))
    if got.ended == "error":
        soak.tally.unexpected[got.errors[-1][1][:70]] += 1


async def valid_score(soak: Soak, conn: Connection, rng: random.Random) -> None:
    prompt, scored = soak.model.prompt(rng), soak.model.prompt(rng, 1, 16)
    fields: dict = {"prompt": prompt, "scored": scored, "top_logprobs": rng.choice([0, 0, 3])}
    readout = soak.model.readout_width and rng.random() < 0.3
    if readout:
        fields["readout"] = [[0, len(prompt) + len(scored)]]
    stream_id = conn.new_id()
    queue = conn.route(stream_id)
    soak.tally.start("score")
    try:
        await conn.send(line("SCORE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout)
    finally:
        conn.unroute(stream_id)
    why = got.trouble(soak.timeout) or check_request_id(got, fields)
    if why is None and [p["token"] for p in got.tokens] != scored:
        why = f"scored tokens {[p['token'] for p in got.tokens][:8]}..., expected {scored[:8]}..."
    if why is None and got.finish != "length":
        why = f"finish_reason {got.finish!r}, expected 'length'"
    if why is None and not all(p["logprob"] <= 1e-4 for p in got.tokens):
        why = "a logprob above 0"
    if why is None and readout:
        why = check_readouts(got, len(prompt), soak.model.readout_width)
    settle(soak, "score", got, why)


# ---- CANCEL at every moment ---------------------------------------------------------------------


# Tokens that may still arrive after a CANCEL went out: those the server sent before it read
# the CANCEL (a step or two of every stream). More, and the CANCEL was not acted on.
CANCEL_SLACK = 8


async def cancel_job(soak: Soak, conn: Connection, rng: random.Random, moment: str) -> None:
    """A long stream and a CANCEL in the same frame, the next frame, mid-stream, or after its end."""
    kind = f"cancel/{moment}"
    max_tokens = soak.tokens if moment == "after-end" else soak.long_tokens
    fields = generate_fields(soak, rng, soak.model.prompt(rng), max_tokens, sampled=rng.random() < 0.3)
    stream_id = conn.new_id()
    generate, cancel = line("GENERATE", {"stream_id": stream_id, **fields}), line("CANCEL", {"stream_id": stream_id})
    queue = conn.route(stream_id)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []  # when the CANCEL went out
    at = rng.randint(1, max(1, max_tokens // 4))

    async def cancel_mid(count: int) -> None:
        if count == at and not sent_at:
            await conn.send(cancel)
            sent_at.append(loop.time())

    soak.tally.start(kind)
    try:
        await (conn.send(generate, cancel) if moment == "same-frame" else conn.send(generate))
        if moment == "next-frame":
            await conn.send(cancel)
        if moment in ("same-frame", "next-frame"):
            sent_at.append(loop.time())
        got = await receive(queue, soak.timeout, on_token=cancel_mid if moment == "mid-stream" else None)
        why = got.trouble(soak.timeout)
        if why is None and moment == "after-end":
            why = check_generated(got, max_tokens) or await cancel_after_end(soak, conn, queue, cancel)
        elif why is None:
            why = check_cancelled(got, max_tokens, sent_at[0] if sent_at else None)
            if got.finish != "cancelled":  # the CANCEL met an ended stream: its error may still come
                conn.late_cancel_errors.add(stream_id)
    finally:
        conn.unroute(stream_id)
    settle(soak, kind, got, why)


def check_cancelled(got: Received, max_tokens: int, sent_at: float | None) -> str | None:
    """Ended "cancelled" within CANCEL_SLACK tokens of the CANCEL, or, when the end was already
    on its way, "length" with max_tokens; never run on past the CANCEL."""
    if sent_at is None:
        return f"no CANCEL was sent: the stream ended {got.finish!r} after {len(got.tokens)} tokens"
    after = sum(1 for arrived in got.arrivals if arrived > sent_at)
    ended_in_time = got.finish == "cancelled" or (got.finish == "length" and len(got.tokens) == max_tokens)
    if ended_in_time and after <= CANCEL_SLACK:
        return None
    return (
        f"the stream ended {got.finish!r} after {len(got.tokens)} of {max_tokens} tokens, "
        f"{after} of them arriving after the CANCEL went out"
    )


async def cancel_after_end(soak: Soak, conn: Connection, queue: asyncio.Queue, cancel: str) -> str | None:
    """A CANCEL for a stream that has ended: the error that it is not running, and nothing else."""
    await conn.send(cancel)
    late = await receive(queue, soak.timeout)
    if late.ended == "error" and "is not running" in late.errors[-1][1]:
        return None
    return f"CANCEL after the end: {late.trouble(soak.timeout) or f'a payload ending {late.finish!r}'}"


# ---- bad inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadInput:
    """A line (or a whole frame) and the error it must get."""

    lines: tuple[str, ...]
    expect: tuple[str, ...]  # substrings the error must hold
    stream_id: int | None  # None: a MSG error without a stream_id
    channels: tuple[str, ...] = ("TOKEN",)  # frame types the error may come in


def bad_input(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> BadInput:
    sid = conn.new_id()
    vocab, prompt = soak.model.vocab_size, soak.model.prompt(rng, 2, 8)
    match kind:
        case "not-json":
            return BadInput((f'GENERATE {{"stream_id": {sid}, "prompt": [1, 2',), ("body is not valid JSON",), sid)
        case "garbage-line":
            return BadInput(("HELLO-THERE",), ("expected 'TYPE <json>'",), None, ("MSG",))
        case "unknown-type":
            return BadInput(
                (line("FROBNICATE", {"stream_id": sid}),), ("unknown message type 'FROBNICATE'",), None, ("MSG",)
            )
        case "bad-field-type":
            field_name, value, expect = rng.choice(
                [
                    ("prompt", "hello", "prompt must be a list of token ids"),
                    ("max_tokens", "16", "max_tokens must be an integer"),
                    ("temperature", "hot", "temperature must be a number"),
                    ("ignore_eos", 1, "ignore_eos must be true or false"),
                ]
            )
            fields = {"stream_id": sid, "prompt": prompt, field_name: value}
            return BadInput((line("GENERATE", fields),), (expect,), sid)
        case "bad-stream-id":
            fields = {"stream_id": "seven", "prompt": prompt}
            return BadInput((line("GENERATE", fields),), ("stream_id must be an integer",), None, ("MSG",))
        case "unknown-field":
            fields = {"stream_id": sid, "prompt": prompt, "max_token": 4}
            return BadInput((line("GENERATE", fields),), ("unknown field 'max_token'",), sid)
        case "unknown-model":
            fields = {"stream_id": sid, "prompt": prompt, "model": "no-such-model"}
            return BadInput((line("GENERATE", fields),), ("'no-such-model' is not served here",), sid)
        case "cancel-unknown-stream":
            return BadInput(
                (line("CANCEL", {"stream_id": sid}),), (f"stream {sid} is not running",), sid, ("TOKEN", "MSG")
            )
        case "token-out-of-range":
            bad = vocab + rng.randrange(1000)
            if rng.random() < 0.5:
                fields = {"stream_id": sid, "prompt": [*prompt, bad], "max_tokens": 2}
                return BadInput((line("GENERATE", fields),), (f"= {bad} is not a token id of this model",), sid)
            fields = {"stream_id": sid, "prompt": prompt, "scored": [bad]}
            return BadInput((line("SCORE", fields),), (f"continuation[0] = {bad} is not a token id",), sid)
        case "context-overflow":
            fields = {"stream_id": sid, "prompt": prompt, "max_tokens": soak.model.max_model_len}
            return BadInput((line("GENERATE", fields),), ("exceed the model's context",), sid)
        case "oversized":
            return BadInput((oversized_generate(sid, soak.server.max_message_bytes),), OVERSIZED, sid)
    raise ValueError(kind)


OVERSIZED = ("exceeds the limit of", "--lmtp-max-message-bytes")


def oversized_generate(stream_id: int, limit: int) -> str:
    """A GENERATE a little over the limit: a prompt of ~limit/2 token ids, stream_id first."""
    head = f'GENERATE {{"stream_id": {stream_id}, "max_tokens": 1, "prompt": [1'
    return head + ",7" * ((limit - len(head)) // 2 + 1024) + "]}"


async def bad_input_job(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> None:
    bad = bad_input(soak, conn, rng, kind)
    if bad.stream_id is None:
        async with conn.anonymous_lock:
            await conn.send(*bad.lines)
            got = await receive(conn.anonymous, soak.timeout)
    else:
        queue = conn.route(bad.stream_id)
        try:
            await conn.send(*bad.lines)
            got = await receive(queue, soak.timeout)
        finally:
            conn.unroute(bad.stream_id)
    judge_bad_input(soak, kind, bad, got)


def judge_bad_input(soak: Soak, kind: str, bad: BadInput, got: Received) -> None:
    if got.ended in ("timeout", "dropped"):
        soak.tally.fault(kind, "unanswered", got.trouble(soak.timeout) or "")
    elif got.ended != "error":
        soak.tally.fault(kind, "wrong", f"no error: the stream ended {got.finish!r} after {len(got.tokens)} tokens")
    else:
        channel, message = got.errors[-1]
        if got.unnamed_errors:
            soak.tally.fault(kind, "wrong", f"{channel} error {message!r} without a request_id")
        elif channel in bad.channels and all(part in message for part in bad.expect):
            soak.tally.fault(kind, "specific")
        else:
            soak.tally.fault(kind, "wrong", f"{channel} error {message!r}, expected {bad.channels} with {bad.expect}")


async def duplicate_stream_id(soak: Soak, conn: Connection, rng: random.Random) -> None:
    """A GENERATE reusing a running stream's id: an error for that id; the running stream carries on.

    The duplicate goes out when the carrier's first token arrives. If the carrier had ended
    before the duplicate reached the server (this side fell behind: the carrier's last token can
    be waiting unread in the socket), the id was free again and the duplicate runs as a stream
    of its own, after the carrier's end on the connection: then only that stream is checked, and
    nothing is tallied. (A server that let a duplicate run beside its carrier would mix the two
    streams, and the carrier's check fails.)"""
    kind = "duplicate-stream-id"
    fields = generate_fields(soak, rng, soak.model.prompt(rng), soak.long_tokens, sampled=False)
    stream_id = conn.new_id()
    queue = conn.route(stream_id)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    duplicate_errors: list[str] = []

    async def reuse(count: int) -> None:
        if count == 1:
            again = generate_fields(soak, rng, [5], 2, sampled=False)
            await conn.send(line("GENERATE", {"stream_id": stream_id, **again}))
            sent_at.append(loop.time())

    def duplicate_error(error: str) -> bool:
        """The one error the duplicate earns does not end the carrier."""
        if "already running" in error and not duplicate_errors:
            duplicate_errors.append(error)
            return True
        return False

    soak.tally.start("generate/carrier")
    try:
        await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout, on_token=reuse, tolerate=duplicate_error)
        raced = bool(sent_at and not duplicate_errors and got.finish is not None)
        second = await receive(queue, soak.timeout) if raced else None
    finally:
        conn.unroute(stream_id)
    # The carrier is a valid stream, whatever the duplicate got.
    settle(soak, "generate/carrier", got, got.trouble(soak.timeout) or check_generated(got, soak.long_tokens))
    if second is not None:
        if second.trouble(soak.timeout) or check_generated(second, 2):
            soak.tally.fault(
                kind, "wrong", f"sent after the carrier ended, it got {second.trouble(soak.timeout) or second.finish}"
            )
    elif not sent_at:
        soak.tally.fault(kind, "unanswered", "the carrier ended before its first token")
    elif duplicate_errors and f"stream_id {stream_id} is already running" in duplicate_errors[0]:
        soak.tally.fault(kind, "specific")
    else:
        soak.tally.fault(kind, "wrong", f"errors for the id: {[m for _, m in got.errors] or 'none'}")


# ---- connections dropped by the client mid-stream -------------------------------------------


async def disconnect_job(soak: Soak, rng: random.Random) -> None:
    """Open a connection, start streams, close the socket while they run (before or after tokens)."""
    kind = "disconnect"
    soak.tally.start(kind)
    conn = await Connection.open(soak.server.url, soak.options.auth_token)
    try:
        queues = []
        for _ in range(rng.randint(1, 4)):
            stream_id = conn.new_id()
            queues.append(conn.route(stream_id))
            fields = generate_fields(soak, rng, soak.model.prompt(rng), soak.long_tokens, sampled=rng.random() < 0.5)
            await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        if rng.random() < 0.7:  # else: close before any token
            item = await asyncio.wait_for(queues[0].get(), soak.timeout)
            if item is None or item[1].get("error") is not None:
                soak.tally.lose(kind, f"before the close: {item and item[1]} / {conn.dropped}")
                return
    except TimeoutError:
        soak.tally.lose(kind, f"no token within {soak.timeout:.0f} s")
        return
    finally:
        await conn.close()
    soak.tally.complete(kind, 0)


async def oversized_frame_job(soak: Soak) -> None:
    """A frame past --lmtp-max-frame-bytes is not read: the server closes with 1009 (message too big)."""
    conn = await Connection.open(soak.server.url, soak.options.auth_token)
    try:
        await conn.send(oversized_generate(conn.new_id(), soak.server.max_frame_bytes))
        closed = await conn.wait_closed(soak.timeout)
        if not closed:
            soak.tally.fault("oversized-frame", "unanswered", f"still open after {soak.timeout:.0f} s")
        elif conn.close_code != 1009 or conn.strays:
            got = f"close code {conn.close_code} after {[p for _, p, _ in conn.strays][:2]}"
            soak.tally.fault("oversized-frame", "wrong", f"{got}, expected 1009 and nothing before it")
        else:
            soak.tally.fault("oversized-frame", "specific")
    finally:
        await conn.close()


# ---- gRPC sessions ------------------------------------------------------------------------------


async def rpc_error(soak: Soak, call: Awaitable) -> grpc.aio.AioRpcError | str:
    """The error a call ended with, or why there was none."""
    try:
        await asyncio.wait_for(call, soak.timeout)
    except grpc.aio.AioRpcError as error:
        return error
    except TimeoutError:
        return "unanswered"
    return "succeeded"


def judge_status(soak: Soak, kind: str, error: grpc.aio.AioRpcError | str, code: grpc.StatusCode, expect: str) -> None:
    if isinstance(error, str):
        if error == "unanswered":
            soak.tally.fault(kind, "unanswered", f"no answer within {soak.timeout:.0f} s")
        else:
            soak.tally.fault(kind, "wrong", f"the call succeeded, expected {code.name}")
    elif error.code() == code and expect in (error.details() or ""):
        soak.tally.fault(kind, "specific")
    else:
        soak.tally.fault(kind, "wrong", f"{error.code().name} {error.details()!r}, expected {code.name} {expect!r}")


async def expect_status(soak: Soak, kind: str, call: Awaitable, code: grpc.StatusCode, expect: str) -> None:
    judge_status(soak, kind, await rpc_error(soak, call), code, expect)


def check_turn(result: GenerateResult, before: int, appended: int, max_tokens: int, width: int) -> str | None:
    done = result.done
    if done is None:
        return "no GenerateDone"
    if done.prompt_tokens != before + appended:
        return f"prompt_tokens {done.prompt_tokens}, expected {before + appended}"
    if done.completion_tokens != len(result.tokens):
        return f"completion_tokens {done.completion_tokens} but {len(result.tokens)} tokens streamed"
    reason = pb.GenerateDone.FinishReason.Name(done.finish_reason)
    if not (
        (reason == "FINISH_REASON_LENGTH" and len(result.tokens) == max_tokens)
        or (reason == "FINISH_REASON_EOS" and len(result.tokens) <= max_tokens)
    ):
        return f"{reason} after {len(result.tokens)} of {max_tokens} tokens"
    positions = [t.position for t in result.tokens]
    if positions != list(range(before + appended, before + appended + len(positions))):
        return f"decoded positions {positions[:4]}..., expected from {before + appended}"
    if width and any(len(t.readout) != width for t in result.tokens):
        return f"a decoded token without a {width}-float readout"
    return None


class SessionWorkflow:
    """Open, several turns with offset checks (and faults between), Fork, Dump, Close: one run."""

    kind = "grpc/session"

    def __init__(self, soak: Soak, client: AsyncSalienceClient, rng: random.Random) -> None:
        self.soak, self.client, self.rng = soak, client, rng
        self.tokens = 0  # decoded, over every turn

    async def turn(self, session: AsyncSession, expected: list[int], max_tokens: int) -> str | None:
        """One Generate; `expected` (the session's tokens as this side knows them) grows by it,
        and the offset the client tracks must come out equal to its length."""
        append = self.soak.model.prompt(self.rng, 2, 24)
        before = len(expected)
        width = self.soak.model.readout_width if self.rng.random() < 0.3 else 0
        params: dict = {"max_tokens": max_tokens, "readout_ranges": [(before + len(append), None)] if width else ()}
        params |= {"top_k": 1} if self.rng.random() < 0.5 else {"temperature": 0.9}
        result = await asyncio.wait_for(session.generate(append, **params), self.soak.timeout)
        expected += append + result.token_ids
        self.tokens += len(result.tokens)
        return check_turn(result, before, len(append), max_tokens, width) or (
            None
            if session.length == len(expected)
            else f"the client's offset is {session.length} after the turn, the session has {len(expected)} tokens"
        )

    async def busy(self, session: AsyncSession, expected: list[int]) -> str | None:
        """A second Generate while a long turn runs: ABORTED. The long turn is then cancelled by
        leaving its stream; the session keeps what was decoded, which DumpSession must show.
        Under load the long turn can finish before the intruder reaches the server; the session
        is then idle and the right answer is the offset mismatch, so neither answer is judged
        until DumpSession tells which state the server was in."""
        append = self.soak.model.prompt(self.rng, 2, 8)
        room = self.soak.model.max_model_len - len(expected) - len(append) - 128  # later turns need some
        if room < 64:
            return None
        max_tokens = min(room, 512)
        received: list[int] = []
        error: grpc.aio.AioRpcError | str = "unanswered"
        stream = session.stream(append, max_tokens=max_tokens, top_k=1)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                if event.HasField("done"):
                    return f"a {max_tokens}-token turn ended before the intruder got its answer"
                if not event.token.is_prefill:
                    received.append(event.token.id)
                    intruder = AsyncSession(self.client, session.id, session.length)
                    error = await rpc_error(self.soak, intruder.generate([1], max_tokens=1, top_k=1))
                    break
        if not received:
            return "the long turn's stream ended without a decoded token"
        self.tokens += len(received)
        dumped = await asyncio.wait_for(session.dump(), self.soak.timeout)
        sent = expected + append + received
        if dumped[: len(sent)] != sent:
            return f"after a cancelled turn DumpSession does not start with the {len(sent)} tokens sent and received"
        if len(dumped) < len(expected) + len(append) + max_tokens:
            judge_status(self.soak, "grpc-session-busy", error, grpc.StatusCode.ABORTED, "already generating")
        else:  # the turn had run to its end: the server was right to judge the offset instead
            judge_status(self.soak, "grpc-offset-drift", error, grpc.StatusCode.FAILED_PRECONDITION, "does not match")
        expected[:] = dumped
        return None

    async def run(self) -> None:
        soak, rng = self.soak, self.rng
        soak.tally.start(self.kind)
        session = await asyncio.wait_for(self.client.open_session(soak.model.name), soak.timeout)
        expected: list[int] = []
        try:
            why = None
            for _ in range(rng.randint(2, 4)):
                why = why or await self.turn(session, expected, soak.tokens)
                if rng.random() < 0.3:  # an offset the server does not have: nothing changes
                    drift = session.generate([7], truncate_to=session.length + rng.randint(1, 5), max_tokens=1)
                    await expect_status(
                        soak, "grpc-offset-drift", drift, grpc.StatusCode.FAILED_PRECONDITION, "does not match"
                    )
            if rng.random() < 0.3:
                why = why or await self.busy(session, expected)
            dumped = await asyncio.wait_for(session.dump(), soak.timeout)
            why = why or (
                None if dumped == expected else f"DumpSession has {len(dumped)} tokens, expected {len(expected)}"
            )
            why = why or await self.fork(session, expected)
        finally:
            await asyncio.wait_for(session.close(), soak.timeout)
        await expect_status(soak, "grpc-closed-session", session.dump(), grpc.StatusCode.NOT_FOUND, "no session")
        if why is None:
            soak.tally.complete(self.kind, self.tokens)
        else:
            soak.tally.lose(self.kind, why, self.tokens)

    async def fork(self, session: AsyncSession, expected: list[int]) -> str | None:
        at = self.rng.randint(1, len(expected))
        branch = await asyncio.wait_for(session.fork(at), self.soak.timeout)
        try:
            dumped = await asyncio.wait_for(branch.dump(), self.soak.timeout)
            if dumped != expected[:at]:
                return f"the fork at {at} holds {len(dumped)} tokens, expected the first {at}"
            return await self.turn(branch, expected[:at], self.soak.tokens)
        finally:
            await asyncio.wait_for(branch.close(), self.soak.timeout)


async def grpc_worker(soak: Soak, rng: random.Random) -> None:
    async with AsyncSalienceClient(soak.server.grpc, token=soak.options.auth_token) as client:
        while soak.running():
            try:
                await SessionWorkflow(soak, client, rng).run()
            except (grpc.aio.AioRpcError, TimeoutError) as error:
                soak.tally.lose("grpc/session", describe(error))
                if isinstance(error, grpc.aio.AioRpcError):
                    soak.tally.unexpected[f"gRPC {error.code().name}: {error.details()}"[:70]] += 1
            if rng.random() < 0.5:
                stranger = AsyncSession(client, "soak-" + secrets.token_urlsafe(8))
                await expect_status(
                    soak, "grpc-unknown-session", stranger.dump(), grpc.StatusCode.NOT_FOUND, "no session"
                )


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# ---- scheduling ---------------------------------------------------------------------------------

BAD_INPUTS = (
    "not-json",
    "garbage-line",
    "unknown-type",
    "bad-field-type",
    "bad-stream-id",
    "unknown-field",
    "unknown-model",
    "cancel-unknown-stream",
    "token-out-of-range",
    "context-overflow",
    "oversized",
)
CANCEL_MOMENTS = ("same-frame", "next-frame", "mid-stream", "after-end")


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
                self.conn = await Connection.open(self._soak.server.url, self._soak.options.auth_token)
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


def say(text: str) -> None:
    print(f"soak: {text}", file=sys.stderr, flush=True)


# ---- the run --------------------------------------------------------------------------------------

# What /metrics must show once every client of the tool is gone: nothing running, nothing held.
IDLE_METRICS = (
    "salience_streams_active",
    "salience_connections_active",
    "salience_sessions_open",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


async def scrape(server: Server, token: str | None) -> dict[str, float] | None:
    """GET /metrics summed over labels, by metric name; None if the server has no /metrics."""
    url = server.http_url("/metrics")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with aiohttp.ClientSession(headers=headers) as http, http.get(url) as response:
        if response.status != 200:
            return None
        text = await response.text()
    sums: defaultdict[str, float] = defaultdict(float)
    for row in text.splitlines():
        if row and not row.startswith("#"):
            name, _, value = row.rpartition(" ")
            sums[name.partition("{")[0]] += float(value)
    return dict(sums)


async def leftovers(server: Server, token: str | None, wait: float = 15.0) -> dict[str, float] | None:
    """The IDLE_METRICS that are not zero, after waiting up to `wait` s for them to settle."""
    deadline = time.monotonic() + wait
    while True:
        metrics = await scrape(server, token)
        if metrics is None:
            return None
        left = {name: metrics[name] for name in IDLE_METRICS if metrics.get(name)}
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(1)


async def model_and_idle_ttft(server: Server, options: SoakOptions, tally: Tally) -> Model:
    """MODEL_INFO, then a few single greedy streams one after another: time to first token, idle."""
    headers = {"Authorization": f"Bearer {options.auth_token}"} if options.auth_token else None
    client = await LmtpClient.connect(server.url, headers=headers)
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


@dataclass
class SoakReport:
    options: SoakOptions
    server: Server
    model: Model
    tally: Tally
    samples: list[Sample]
    seconds: float
    server_exit: int | None = 0
    server_died: bool = False
    exit_seconds: float = 0.0  # from SIGTERM to exit
    leftovers: dict[str, float] | None = None  # IDLE_METRICS not back to zero; None: no /metrics

    def failures(self) -> list[str]:
        tally, out = self.tally, []
        if tally.lost:
            out.append(f"{tally.lost} streams lost")
        if tally.wrong:
            out.append(f"{tally.wrong} bad inputs without their specific error")
        if tally.dropped_connections:
            out.append(f"{tally.dropped_connections} connections dropped by the server")
        if tally.strays:
            out.append(f"{tally.strays} payloads for streams that were not running")
        if tally.tool_errors:
            out.append(f"{tally.tool_errors} jobs failed with an exception")
        if self.leftovers and self.server.process is not None:  # an attached server may have other clients
            out.append(f"still held after the load: {self.leftovers}")
        if self.server_died:
            out.append("the server died during the run")
        if self.server_exit != 0:
            out.append(f"the server's exit after SIGTERM: {self.server_exit}")
        return out

    def render(self) -> str:
        o, tally = self.options, self.tally
        where = "started" if self.server.process else "attached"
        out = [
            f"soak: {self.seconds:.0f} s against {self.model.name} ({where}, pid {self.server.pid}), "
            f"{o.connections} connections x {o.streams} streams, {o.sessions} gRPC session workers, "
            f"{o.tokens} tokens a stream, messages limited to {self.server.max_message_bytes} bytes "
            f"(frames to {self.server.max_frame_bytes or 'unknown'})",
            "",
            f"{'streams':24} {'started':>8} {'completed':>10} {'lost':>6} {'tokens':>8}",
        ]
        for kind in sorted(tally.streams):
            t = tally.streams[kind]
            out.append(f"{kind:24} {t.started:>8} {t.completed:>10} {t.lost:>6} {t.tokens:>8}")
        total = StreamTally(
            *(sum(getattr(t, f) for t in tally.streams.values()) for f in ("started", "completed", "lost", "tokens"))
        )
        out.append(f"{'total':24} {total.started:>8} {total.completed:>10} {total.lost:>6} {total.tokens:>8}")
        out.append(f"{'':24} {total.tokens / self.seconds:>36.1f} tokens/s")
        out += ["", f"{'bad inputs':24} {'sent':>8} {'specific':>10} {'wrong':>6} {'no answer':>10}"]
        for kind in sorted(tally.faults):
            t = tally.faults[kind]
            out.append(f"{kind:24} {t.sent:>8} {t.specific:>10} {t.wrong:>6} {t.unanswered:>10}")
        out.append(f"errors on valid streams: {sum(tally.unexpected.values())}")
        out += [f"  {n:>5} x {message}" for message, n in tally.unexpected.most_common(10)]
        out += ["", self.ttft_line(), *self.resource_lines()]
        idle = "no /metrics" if self.leftovers is None else (self.leftovers or "all zero")
        out.append(f"after the load, /metrics {', '.join(IDLE_METRICS)}: {idle}")
        out.append(
            f"connections dropped by the server: {tally.dropped_connections}; stray payloads: {tally.strays}; "
            "server exit after SIGTERM: "
            + (f"{self.server_exit} in {self.exit_seconds:.1f} s" if self.server.process else "n/a (attached)")
        )
        if tally.problems:
            out += ["", "problems (how many of each, and the first):"]
            ranked = sorted(tally.problems.values(), key=lambda entry: -entry[0])
            out += [f"  {count:>5} x {example[:300]}" for count, example in ranked[:30]]
        failures = self.failures()
        out += ["", "result: " + ("FAIL: " + "; ".join(failures) if failures else "PASS")]
        return "\n".join(out)

    def ttft_line(self) -> str:
        idle, loaded = self.tally.ttft_idle, sorted(self.tally.ttft_loaded)
        text = f"time to first token: idle median {statistics.median(idle):.3f} s ({len(idle)} streams)"
        if loaded:
            p95 = loaded[min(len(loaded) - 1, math.ceil(0.95 * len(loaded)) - 1)]
            text += f"; loaded median {statistics.median(loaded):.3f} s, p95 {p95:.3f} s ({len(loaded)} streams)"
        return text

    def resource_lines(self) -> list[str]:
        if len(self.samples) < 2:
            return ["server rss/fds: not measured (no --pid)"]
        first, last = self.samples[0], self.samples[-1]
        half = self.samples[len(self.samples) // 2 :]

        def trend(value: Callable[[Sample], float], unit: str) -> str:
            whole = slope_per_minute([(s.at, value(s)) for s in self.samples])
            later = slope_per_minute([(s.at, value(s)) for s in half])
            text = f"trend {whole or 0:+.1f}{unit}/min"
            return text + (f" (second half {later:+.1f}{unit}/min)" if later is not None else "")

        return [
            f"server rss: {first.rss / MIB:.0f} MiB at start, {last.rss / MIB:.0f} MiB at end, "
            f"{trend(lambda s: s.rss / MIB, ' MiB')}, {len(self.samples)} samples",
            f"server open fds: {first.fds} at start, {last.fds} at end, {trend(lambda s: s.fds, '')}",
        ]


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


def parse_args(argv: list[str] | None = None) -> SoakOptions:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakOptions()
    parser.add_argument("model", nargs="?", type=Path, help="model folder to serve (default: the embedded model)")
    parser.add_argument("--url", help="attach to the LMTP WebSocket of a running server, e.g. ws://127.0.0.1:8080/")
    parser.add_argument("--grpc", help="the attached server's gRPC address (default 127.0.0.1:50051)")
    parser.add_argument("--pid", type=int, help="the attached server's pid, to sample its RSS and open fds")
    parser.add_argument("--server-arg", action="append", default=[], help="another `salience serve` flag (repeatable)")
    parser.add_argument("--auth-token", default=os.environ.get("SALIENCE_AUTH_TOKEN"))
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--connections", type=int, default=defaults.connections)
    parser.add_argument("--streams", type=int, default=defaults.streams, help="concurrent streams per connection")
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="gRPC session workers")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="max_tokens of a valid stream")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        help="--lmtp-max-message-bytes of a started server (1 MiB), or what the attached one was given (16 MiB)",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        help="--lmtp-max-frame-bytes of a started server (twice the message limit), or of the attached one",
    )
    parser.add_argument("--stream-timeout", type=float, default=defaults.stream_timeout)
    parser.add_argument("--start-timeout", type=float, default=defaults.start_timeout)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--skip", action="append", default=[], help="leave out an LMTP job kind (repeatable)")
    parser.add_argument("--log", type=Path, help="a started server's log file (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.url is None and (args.grpc or args.pid):
        parser.error("--grpc and --pid go with --url")
    return SoakOptions(
        model=args.model,
        url=args.url,
        grpc=args.grpc,
        pid=args.pid,
        server_args=tuple(args.server_arg),
        auth_token=args.auth_token,
        seconds=args.seconds,
        connections=args.connections,
        streams=args.streams,
        sessions=args.sessions,
        tokens=args.tokens,
        max_message_bytes=args.max_message_bytes,
        max_frame_bytes=args.max_frame_bytes,
        stream_timeout=args.stream_timeout,
        start_timeout=args.start_timeout,
        seed=args.seed,
        skip=tuple(args.skip),
        log=args.log,
    )


def main(argv: list[str] | None = None) -> int:
    report = asyncio.run(run_soak(parse_args(argv)))
    print(report.render())
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
