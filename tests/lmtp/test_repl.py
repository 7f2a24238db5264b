"""`salience repl` driven through a real pseudo-terminal against the tiny model's server."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.features.sae import load_sae
from salience.core.probes.concepts import ConceptSet
from salience.lmtp.client import LmtpClient
from salience.lmtp.repl_features import choose_features
from salience.lmtp.repl_parsing import parse_line, parse_monitor, parse_steer
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, start_engine
from tests.inprocess import frontends
from tests.lmtp.conftest import LmtpServer
from tests.random_sae import random_sae

SALIENCE = str(Path(sys.executable).with_name("salience"))


@pytest_asyncio.fixture(scope="module")
async def tiny_engine(tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    """This module's server reads concepts out, for /readout."""
    engine = await start_engine(tiny_model, max_model_len=2048, max_logprobs=20, concepts=tiny_concepts)
    yield engine
    engine.shutdown()


class Terminal:
    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            env=os.environ | {"TERM": "dumb"},
        )
        os.close(slave)
        self.output = ""
        self.cursor = 0

    def _read_until(self, pattern: str, timeout: float) -> str:
        """Output from the last match up to the end of the next match of pattern."""
        deadline = time.monotonic() + timeout
        start = self.cursor
        while not (match := re.search(pattern, self.output[start:])):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not seen; output so far:\n{self.output}")
            if not select.select([self.master], [], [], 0.2)[0]:
                continue
            try:
                self.output += os.read(self.master, 65536).decode(errors="replace")
            except OSError:
                raise AssertionError(f"terminal closed; output:\n{self.output}") from None
        self.cursor = start + match.end()
        return self.output[start : self.cursor]

    async def expect(self, pattern: str, timeout: float = 60) -> str:
        return await asyncio.to_thread(self._read_until, pattern, timeout)

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)


def test_parse_line_reads_trailing_parameters_as_lmql_does() -> None:
    assert parse_line("Hello there max_tokens=5 temperature=1.2") == (
        "Hello there",
        {"max_tokens": 5, "temperature": 1.2},
    )
    assert parse_line("a=b is not a parameter here") == ("a=b is not a parameter here", {})
    assert parse_line("x stop=abc") == ("x", {"stop": "abc"})


async def test_repl_generates_scores_cancels_and_survives_errors(lmtp_server: LmtpServer) -> None:
    url = lmtp_server.url.replace("http://", "ws://")
    prompt = lmtp_server.engine.tokenizer.encode("def hello", add_special_tokens=False)
    terminal = Terminal([SALIENCE, "repl", url])
    try:
        await terminal.expect(r"connected to .*tiny.*\n.*>>> ")
        terminal.send("def hello(x): max_tokens=6 ignore_eos=true\r")
        out = await terminal.expect(r"\[length\]")
        assert "[length]" in out
        await terminal.expect(">>> ")

        terminal.send("def f max_tokens=2000 ignore_eos=true\r")
        await terminal.expect(r"def f.*\n.+", timeout=30)  # tokens are streaming
        terminal.send("\x03")
        await terminal.expect(r"\[cancelled\]")
        await terminal.expect(">>> ")
        assert lmtp_server.engine.num_unfinished_requests() == 0

        terminal.send("/score def || hello\r")
        out = await terminal.expect(r"total logprob (-?\d+\.\d+)")
        assert "logprob" in out

        terminal.send("/readout two\r")
        await terminal.expect(r"\[error\] /readout takes nothing, 'raw \[LAYER\]' or 'off', not 'two'")
        terminal.send("/readout\r")  # this set was made by hand: no calibration, so no probabilities
        await terminal.expect(r"\[error\] the concept set has no calibration: use /readout raw \[LAYER\]")
        terminal.send("/readout raw 1\r")
        await terminal.expect(r"\[error\] layer 1 is not read out; the concept set reads layers \[0, 2, 3\]")
        terminal.send("/monitor alpha >0.9 stop\r")
        await terminal.expect(r'\{"concept": "alpha", "above": 0.9, "action": "stop"\}')
        terminal.send("hi max_tokens=2\r")
        await terminal.expect(r"\[error\] the concept set has no calibration for alpha, beta")
        terminal.send("/monitor off\r")
        await terminal.expect("no monitors")
        terminal.send("/readout raw 2\r")
        await terminal.expect(r"raw readouts at layer 2 of alpha, beta")
        terminal.send("def hello max_tokens=3 ignore_eos=true\r")
        n = len(prompt) + 3  # a row per prompt position and per generated token
        out = await terminal.expect(r"\[length\]\s*\n.*pos\s+token\s+alpha.*\n(?:.*\n){" + str(n) + "}")
        rows = [line.split() for line in out.strip().splitlines()[-n:]]
        assert [int(row[0]) for row in rows] == list(range(n))
        expected = await lmtp_server.engine.readout(prompt, [(0, len(prompt))])
        layer = TINY_LAYERS.index(2)
        for position in range(len(prompt)):
            shown = [float(v) for v in rows[position][-len(TINY_CONCEPTS) :]]
            values = expected[position][layer * len(TINY_CONCEPTS) : (layer + 1) * len(TINY_CONCEPTS)]
            assert shown == pytest.approx(values, rel=1e-3, abs=1e-6)
        await terminal.expect(">>> ")
        terminal.send("/readout off\r")

        terminal.send("oops temperature=-3\r")
        await terminal.expect(r"\[error\] temperature must be >= 0")
        terminal.send("/quit\r")
        await asyncio.to_thread(terminal.process.wait, 30)
        assert terminal.process.returncode == 0
    finally:
        terminal.close()


def test_parse_steer_reads_the_short_form() -> None:
    layers = {"french": list(range(30)), "code": [4, 8]}
    assert parse_steer("french +8", layers) == {
        "direction": "french",
        "positions": "all",
        "op": "add",
        "value": 8.0,
        "layers": [15],
    }
    assert parse_steer("french -2.5 10-12 @generated", layers) == {
        "direction": "french",
        "positions": "generated",
        "op": "add",
        "value": -2.5,
        "layers": [10, 11, 12],
    }
    assert parse_steer("code =3 4,8 @prompt", layers)["op"] == "set"
    assert parse_steer("code ablate", layers) == {
        "direction": "code",
        "positions": "all",
        "op": "ablate",
        "layers": [8],
    }
    for bad, message in (
        ("french", "usage: /steer"),
        ("spanish +1", "unknown direction 'spanish'"),
        ("french *2", "'*2' is not +A, -A, =V or ablate"),
        ("french +inf", "'+inf' is not"),
        ("french +1 @most", "'@most' is not @all"),
        ("french +1 a-b", "not a layer range"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_steer(bad, layers)


async def test_repl_steers(lmtp_server: LmtpServer) -> None:
    url = lmtp_server.url.replace("http://", "ws://")
    terminal = Terminal([SALIENCE, "repl", url])
    try:
        await terminal.expect(r"connected to .*\n.*>>> ")
        terminal.send("/steer beta =7.5 2\r")
        await terminal.expect(
            r'\{"direction": "beta", "positions": "all", "op": "set", "value": 7.5, "layers": \[2\]\}'
        )
        terminal.send("/steer zeta +1\r")
        await terminal.expect(r"\[error\] unknown direction 'zeta'")
        terminal.send("/readout raw 2\r")
        await terminal.expect(r"raw readouts at layer 2 of alpha, beta")
        terminal.send("def hello max_tokens=3 ignore_eos=true\r")
        n = len(lmtp_server.engine.tokenizer.encode("def hello", add_special_tokens=False)) + 3
        out = await terminal.expect(r"\[length\]\s*\n.*pos\s+token\s+alpha.*\n(?:.*\n){" + str(n) + "}")
        rows = [line.split() for line in out.strip().splitlines()[-n:]]
        beta = -len(TINY_CONCEPTS) + TINY_CONCEPTS.index("beta")
        assert [float(row[beta]) for row in rows] == pytest.approx([7.5] * n, abs=1e-3)  # set: the readout is the value
        terminal.send("/steer off\r")
        await terminal.expect("no steering")
        terminal.send("/quit\r")
        await asyncio.to_thread(terminal.process.wait, 30)
        assert terminal.process.returncode == 0
    finally:
        terminal.close()


def test_parse_monitor() -> None:
    assert parse_monitor("code >0.9 stop") == {"concept": "code", "above": 0.9, "action": "stop"}
    assert parse_monitor("french <0.2 flag 12") == {"concept": "french", "below": 0.2, "action": "flag", "layer": 12}
    for bad in ("code", "code 0.9 stop", "code >x stop", "code >0.9 stop twelve"):
        with pytest.raises(ValueError):
            parse_monitor(bad)


async def test_repl_defines_lists_steers_saves_and_deletes_a_concept(lmtp_server: LmtpServer, tmp_path: Path) -> None:
    url = lmtp_server.url.replace("http://", "ws://")
    terminal = Terminal([SALIENCE, "repl", url])
    saved = tmp_path / "saved.safetensors"
    try:
        await terminal.expect(r"connected to .*\n.*>>> ")
        terminal.send("/define kappa\r")
        await terminal.expect(r"positive examples of kappa, one per line; a blank line ends them:")
        for i in range(4):
            terminal.send(f"the cat sat on mat number {i}\r")
        terminal.send("\r")
        await terminal.expect(r"negative examples of kappa")
        for i in range(4):
            terminal.send(f"import os; x = {i} * 2\r")
        terminal.send("\r")
        out = await terminal.expect(r"defined kappa \(concepts version \d+\)", timeout=120)
        assert "layer  auroc" in out and "kappa: method" in out
        terminal.send("/concepts\r")
        out = await terminal.expect(r"kappa\s+live\s+\S+, layer \d+, held-out AUROC \d\.\d{3}")
        assert re.search(r"alpha\s+loaded\s+not validated", out)
        terminal.send("/steer kappa +3 2\r")
        await terminal.expect(
            r'\{"direction": "kappa", "positions": "all", "op": "add", "value": 3.0, "layers": \[2\]\}'
        )
        terminal.send("/readout raw 2\r")
        await terminal.expect(r"raw readouts at layer 2 of alpha, beta, gamma, delta, epsilon, kappa")
        terminal.send("def hello max_tokens=2 ignore_eos=true\r")
        await terminal.expect(r"pos\s+token\s+alpha\s+beta\s+gamma\s+delta\s+epsilon\s+kappa")
        await terminal.expect(">>> ")
        terminal.send(f"/save {saved}\r")
        await terminal.expect(r"wrote \d+ bytes to ")
        assert ConceptSet.load(saved).concepts == (*TINY_CONCEPTS, "kappa")
        terminal.send("/steer off\r")
        terminal.send("/delete kappa\r")
        await terminal.expect(r"deleted kappa")
        terminal.send("/define kappa\r")  # a define's errors are the server's, and the REPL goes on
        terminal.send("only one\r\r\r")
        await terminal.expect(r"\[error\] 1 positive examples: a concept needs 4 to 256 of each")
        terminal.send("/quit\r")
        await asyncio.to_thread(terminal.process.wait, 30)
        assert terminal.process.returncode == 0
    finally:
        terminal.close()


@pytest_asyncio.fixture(scope="module")
async def sae_url(
    tiny_model: Path, tiny_concepts: ConceptSet, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[str]:
    """A second server, with a topk SAE at layer 2 (served first) and a standard one at layer 1."""
    root = tmp_path_factory.mktemp("saes")
    saes = (
        load_sae(random_sae(root / "top", "topk", 2, 256, 1, k=8), name="top"),
        load_sae(random_sae(root / "plain", "standard", 1, 256, 2), name="plain"),
    )
    engine = await start_engine(tiny_model, max_model_len=1024, concepts=tiny_concepts, saes=saes, sae_top=16)
    try:
        async with frontends(engine) as served:
            yield served.ws
    finally:
        engine.shutdown()


def test_choose_features_reads_k_and_the_sae() -> None:
    saes = [{"name": "top", "layer": 2, "top": 4}, {"name": "plain", "layer": 1, "top": 16}]
    assert choose_features("", saes).field() == {"sae": "top", "k": 4, "ranges": [[0, 2**31]]}  # 5, but top keeps 4
    view = choose_features("12 plain", saes)
    assert (view.sae, view.layer, view.k) == ("plain", 1, 12)
    for arg, message in (
        ("5 deep", "unknown SAE 'deep'; this server serves top, plain"),
        ("9", "K must be 1 to 4 for SAE top"),
        ("0 plain", "K must be 1 to 16"),
        ("plain", "usage: /features [K] [SAE]"),
        ("1 2 3", "usage"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            choose_features(arg, saes)
    with pytest.raises(ValueError, match="the server serves no SAE"):
        choose_features("", [])


async def test_repl_features_need_an_sae(lmtp_server: LmtpServer) -> None:
    terminal = Terminal([SALIENCE, "repl", lmtp_server.url.replace("http://", "ws://")])
    try:
        await terminal.expect(r"connected to .*\n.*>>> ")
        terminal.send("/features\r")
        await terminal.expect(r"\[error\] the server serves no SAE: start it with --sae \[NAME=\]DIR")
        terminal.send("/quit\r")
        await asyncio.to_thread(terminal.process.wait, 30)
        assert terminal.process.returncode == 0
    finally:
        terminal.close()


async def _direct_features(url: str, text: str, features: dict) -> list[list[str]]:
    """The REPL's request made directly over LMTP: each token's features as the REPL prints them."""
    client = await LmtpClient.connect(url)
    try:
        prompt = (await client.request("TOKENIZE", text=text))["tokens"]
        fields = {"prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "features": features}
        payloads = [p async for p in client.stream("GENERATE", **fields)]
    finally:
        await client.close()
    return [[f"#{i}:{a:.2f}" for i, a in p["features"]] for p in payloads if "features" in p]


async def test_repl_shows_each_tokens_top_features(sae_url: str) -> None:
    terminal = Terminal([SALIENCE, "repl", sae_url])
    try:
        await terminal.expect(r"connected to .*\n.*>>> ")
        for command, header, sae, k in (
            ("/features", "top 5 features of SAE top at layer 2", "top", 5),
            ("/features 3 plain", "top 3 features of SAE plain at layer 1", "plain", 3),
        ):
            terminal.send(command + "\r")
            await terminal.expect(re.escape(header) + r"\s*\n")
            want = await _direct_features(sae_url, "def hello", {"sae": sae, "k": k, "ranges": [[0, 2**31]]})
            n = len(want)  # a line per prompt position and per generated token
            terminal.send("def hello max_tokens=3 ignore_eos=true\r")
            out = await terminal.expect(r"\[length\]\s*\n" + re.escape(header) + r":\s*\n(?:.*\n){" + str(n) + "}")
            lines = out.strip().splitlines()[-n:]
            shown = [re.findall(r"#\d+:-?\d+\.\d\d", line) for line in lines]
            assert shown == want
            assert n > 3 and any(shown) and all(len(pairs) <= k for pairs in shown)
            assert lines[0].split()[0].startswith('"')  # the token's text, quoted
            await terminal.expect(">>> ")
        terminal.send("/features 3 deep\r")
        await terminal.expect(r"\[error\] unknown SAE 'deep'; this server serves top, plain")
        terminal.send("/features off\r")
        terminal.send("def max_tokens=1\r")
        out = await terminal.expect(r"\[\w+\]\s*\n.*>>> ")
        assert "features of SAE" not in out
        terminal.send("/quit\r")
        await asyncio.to_thread(terminal.process.wait, 30)
        assert terminal.process.returncode == 0
    finally:
        terminal.close()
