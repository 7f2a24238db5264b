"""The server under load: started or attached, its process sampled, its /metrics read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from salience.tls import ClientTls
from tools.soak.options import MIB, SERVER_DEFAULT_MESSAGE_BYTES, SoakOptions, say


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
    tls: ClientTls | None = None  # how to reach a server behind TLS (--secure)

    def context(self) -> ssl.SSLContext | None:
        """The TLS context a wss:// or https:// connection to it uses (None: plain)."""
        return self.tls.context() if self.tls is not None else None

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
        tls = None
        if options.secure:
            command, tls = secure(command, options)
        if options.auth_token and not options.secure:
            command += ["--auth-token", options.auth_token]
        log = options.log or Path(tempfile.mkstemp(prefix="salience-soak-", suffix=".log")[1])
        with log.open("w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        say(f"started `{' '.join(command[1:])}` (pid {process.pid}, log {log})")
        scheme = "wss" if tls is not None else "ws"
        url = f"{scheme}://127.0.0.1:{port}/"
        return cls(url, f"127.0.0.1:{grpc_port}", process.pid, limit, frame, process, log, tls)

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
                    async with http.get(health, ssl=self.context() or True) as response:
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


def secure(command: list[str], options: SoakOptions) -> tuple[list[str], ClientTls]:
    """The serve command with TLS and a tokens file, made in a folder of their own; the run's
    token goes in `options.auth_token`."""
    import trustme

    from salience.token_file import add_client

    folder = Path(tempfile.mkdtemp(prefix="salience-soak-tls-"))
    authority = trustme.CA()
    leaf = authority.issue_cert("127.0.0.1", "localhost")
    (folder / "server.pem").write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(folder / "server.key"))
    authority.cert_pem.write_to_path(str(folder / "ca.pem"))
    options.auth_token = add_client(folder / "tokens.toml", "soak", ["admin"])
    flags = ["--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key")]
    return [*command, *flags, "--tokens", str(folder / "tokens.toml")], ClientTls(ca=folder / "ca.pem")


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
    async with aiohttp.ClientSession(headers=headers) as http, http.get(url, ssl=server.context() or True) as response:
        if response.status != 200:
            return None
        text = await response.text()
    sums: defaultdict[str, float] = defaultdict(float)
    for row in text.splitlines():
        if row and not row.startswith("#"):
            name, _, value = row.rpartition(" ")
            sums[name.partition("{")[0]] += float(value)
    return dict(sums)


async def leftovers(server: Server, token: str | None, wait: float = 30.0) -> dict[str, float] | None:
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
