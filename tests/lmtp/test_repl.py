"""`salience repl` driven through a real pseudo-terminal against the tiny model's server (no chat
template: plain completion), and against the default model's (chat mode)."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.requests import SamplingOptions
from salience.core.probes.concepts import ConceptSet
from salience.lmtp.client import LmtpClient
from salience.repl.chat import ChatMode, Conversation, Reply, Turn
from salience.repl.console import Repl
from salience.repl.constraints import constraint_field
from salience.repl.display import stream_ending
from salience.repl.features import choose_features
from salience.repl.parsing import parse_line, parse_monitor, parse_steer
from salience.repl.readouts import ReadoutView, choose_readout, readout_summary, readout_table
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, start_engine
from tests.inprocess import frontends
from tests.lmtp.conftest import LmtpServer

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


async def leave(terminal: Terminal) -> None:
    """`/quit` ends the REPL with exit code 0."""
    terminal.send("/quit\r")
    await asyncio.to_thread(terminal.process.wait, 30)
    assert terminal.process.returncode == 0


def test_parse_line_reads_trailing_parameters_as_lmql_does() -> None:
    assert parse_line("Hello there max_tokens=5 temperature=1.2") == (
        "Hello there",
        {"max_tokens": 5, "temperature": 1.2},
    )
    assert parse_line("a=b is not a parameter here") == ("a=b is not a parameter here", {})
    assert parse_line("x stop=abc") == ("x", {"stop": "abc"})


async def test_repl_generates_scores_cancels_and_survives_errors(lmtp_server: LmtpServer) -> None:
    url = lmtp_server.url.replace("http://", "ws://")
    engine = lmtp_server.engine

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)  # as the REPL's TOKENIZE does

    prompt = encode("def hello")
    terminal = Terminal([SALIENCE, "repl", url])
    try:
        await terminal.expect(r"connected to .*tiny.*\n.*>>> ")
        line = "def hello(x): max_tokens=6 ignore_eos=true"
        terminal.send(line + "\r")
        out = await terminal.expect(r"\n\[length\]")
        # The REPL prints the engine's greedy text (temperature 0 is its default): all six tokens.
        options = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
        greedy = [e.token_id async for e in engine.generate(encode("def hello(x):"), options)]
        assert len(greedy) == 6 and _shown_reply(out, line) == engine.tokenizer.decode(greedy)
        await terminal.expect(">>> ")

        terminal.send("def f max_tokens=2000 ignore_eos=true\r")
        await terminal.expect(r"def f.*\n.+", timeout=30)  # tokens are streaming
        terminal.send("\x03")
        await terminal.expect(r"\[cancelled\]")
        await terminal.expect(">>> ")
        assert engine.num_unfinished_requests() == 0

        terminal.send("/score def || hello\r")
        out = await terminal.expect(r"total logprob -?\d+\.\d{4}")
        # Each token of "hello" and its logprob after "def", then their sum: the engine's own score.
        scored = await engine.score(encode("def"), encode("hello"))
        printed = re.findall(r"^ *(\d+) .* logprob +(-?\d+\.\d{4})", out, re.M)
        assert [int(token) for token, _ in printed] == encode("hello")
        assert [float(logprob) for _, logprob in printed] == pytest.approx([s.logprob for s in scored], abs=1e-4)
        total = float(re.search(r"total logprob (-?\d+\.\d{4})", out)[1])
        assert total == pytest.approx(sum(s.logprob for s in scored), abs=1e-4)

        terminal.send("/readout two\r")
        await terminal.expect(
            r"\[error\] /readout takes nothing, 'running', 'token', 'raw \[LAYER\]' or 'off', not 'two'"
        )
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
        expected = await engine.readout(prompt, [(0, len(prompt))])
        layer = TINY_LAYERS.index(2)
        for position in range(len(prompt)):
            shown = [float(v) for v in rows[position][-len(TINY_CONCEPTS) :]]
            values = expected[position][layer * len(TINY_CONCEPTS) : (layer + 1) * len(TINY_CONCEPTS)]
            assert shown == pytest.approx(values, rel=1e-3, abs=1e-6)
        await terminal.expect(">>> ")
        terminal.send("/readout off\r")

        terminal.send("oops temperature=-3\r")
        await terminal.expect(r"\[error\] temperature must be >= 0")
        await leave(terminal)
    finally:
        terminal.close()


def test_a_streams_ending_shows_tokens_for_score_or_top_then_the_finish_and_monitor_events() -> None:
    monitor = {"monitor": 0, "action": "flag", "concept": "joy", "layer": 2, "position": 4, "probability": 0.91}
    payloads = [
        {"stream_id": 1, "prompt_ids": [1, 2]},  # no token: not a line
        {"stream_id": 1, "token": 9, "text": "x", "logprob": -3.0, "prompt": True},  # a prompt token: not shown
        {"stream_id": 1, "token": 5, "text": "a", "logprob": -1.0, "top_logprobs": {"5": -1.0, "7": -2.0}},
        {"stream_id": 1, "token": 6, "text": "b", "logprob": -0.5, "finish_reason": "length", "monitors": [monitor]},
    ]
    tokens = [
        "      5 'a'              logprob   -1.0000  top 5:0.368, 7:0.135",
        "      6 'b'              logprob   -0.5000",
    ]
    ending = ["\n[length]", "[monitor 0 flag: joy at layer 2, position 4: p=0.910]"]
    assert stream_ending("SCORE", payloads, top=0) == [*tokens, "total logprob -1.5000", *ending]
    assert stream_ending("GENERATE", payloads, top=0) == ending  # its text was printed as it came
    assert stream_ending("GENERATE", payloads, top=2) == [*tokens, *ending]


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
        await leave(terminal)
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
        await leave(terminal)
    finally:
        terminal.close()


@pytest_asyncio.fixture(scope="module")
async def sae_url(sae_engine: Engine) -> AsyncIterator[str]:
    """A second server, serving SAEs: a topk one at layer 2 (served first), a standard one at layer 1
    and a JumpReLU one at layer 3."""
    async with frontends(sae_engine) as served:
        yield served.ws


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
        await leave(terminal)
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
    rows = [p for p in payloads if "features" in p]
    assert [p["position"] for p in rows] == list(range(len(prompt) + 3))  # every position asked for
    return [[f"#{i}:{a:.2f}" for i, a in p["features"]] for p in rows]


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
        await terminal.expect(r"\[error\] unknown SAE 'deep'; this server serves top, plain, jump")
        terminal.send("/features off\r")
        terminal.send("def max_tokens=1\r")
        out = await terminal.expect(r"\[\w+\]\s*\n.*>>> ")
        assert "features of SAE" not in out
        await leave(terminal)
    finally:
        terminal.close()


def test_a_conversation_sends_every_turn_and_prints_its_history() -> None:
    conversation = Conversation()
    assert conversation.messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert conversation.history() == ["(no conversation yet)"]
    conversation.system = "Be brief."
    conversation.turns.append(Turn("Capital of France?", "Paris.\nA city."))
    assert conversation.messages("And Italy?") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.\nA city."},
        {"role": "user", "content": "And Italy?"},
    ]
    assert conversation.history() == [
        "system: Be brief.",
        "user: Capital of France?",
        "assistant: Paris.\n           A city.",  # a later line under the first
    ]


def _chat_payloads(finish: str, texts: tuple[str, ...] = ("Paris", ".")) -> list[dict]:
    """A chat GENERATE's payloads as the server sends them: the rendered ids, a prompt readout row,
    the reply's tokens, and (finish "stop") the end-of-turn token."""
    payloads: list[dict] = [
        {"stream_id": 1, "prompt_ids": [1, 2, 3, 4]},
        {"stream_id": 1, "token": 4, "position": 3, "prompt": True, "finish_reason": None, "readout": [0.5]},
    ]
    for i, text in enumerate(texts):
        payloads.append({"stream_id": 1, "token": 10 + i, "position": 4 + i, "text": text, "finish_reason": None})
    if finish == "stop":
        payloads.append({"stream_id": 1, "token": 2, "position": 4 + len(texts), "text": "<|im_end|>"})
    payloads[-1]["finish_reason"] = finish
    return payloads


def test_a_reply_ends_before_the_end_of_turn_token() -> None:
    reply = Reply.of(_chat_payloads("stop"))
    assert (reply.start, reply.text, reply.finish, reply.kept) == (4, "Paris.", "stop", True)
    assert [p["token"] for p in reply.tokens] == [10, 11]
    assert Reply.of(_chat_payloads("length")).text == "Paris."  # cut short: every token is the reply's
    monitor = Reply.of(_chat_payloads("monitor:code"))  # a monitor's stop token is the reply's too
    assert monitor.text == "Paris." and monitor.kept
    cancelled = Reply.of(_chat_payloads("cancelled"))
    assert cancelled.kept and cancelled.text == "Paris."  # what was said stays
    silent = Reply.of([{"stream_id": 1, "prompt_ids": [1, 2]}, {"stream_id": 1, "finish_reason": "cancelled"}])
    assert (silent.start, silent.text, silent.kept) == (2, "", False)  # nothing said: the turn goes
    assert Reply.of([{"stream_id": 1, "finish_reason": "cancelled"}]).start == 0  # cancelled before rendering


def test_chat_mode_commands() -> None:
    chat = ChatMode()
    assert not chat.learn("<unavailable>") and chat.template is None  # the model is loading
    assert chat.command("/chat", "") == "[error] the model is still loading"
    assert chat.learn({"model": "m", "chat_template": True}) and chat.on and chat.max_tokens == 256
    assert not chat.learn({"model": "m", "chat_template": False})  # learnt once
    assert chat.describe().startswith("chat mode: each line is your turn")
    assert chat.command("/raw", "").startswith("plain completion: each line is a prompt") and not chat.on
    assert chat.max_tokens == 64
    assert chat.command("/chat", "").startswith("chat mode") and chat.on
    assert chat.command("/system", "") == "no system message (a chat template may add its own)"
    assert chat.command("/system", "Be brief.") == "system: Be brief."
    assert chat.command("/system", "") == "system: Be brief."
    assert chat.add("Hi", Reply.of(_chat_payloads("stop"))) is None
    assert chat.add("More", Reply.of(_chat_payloads("cancelled"))) == "[the partial reply stays in the conversation]"
    assert chat.command("/history", "").splitlines() == [
        "system: Be brief.",
        "user: Hi",
        "assistant: Paris.",
        "user: More",
        "assistant: Paris.",
    ]
    silent = Reply.of([{"stream_id": 1, "prompt_ids": [1]}, {"stream_id": 1, "finish_reason": "cancelled"}])
    assert chat.add("Again", silent) == "[the turn is dropped]" and len(chat.conversation.turns) == 2
    assert chat.command("/reset", "") == "conversation cleared (the system message stays)"
    assert chat.conversation.turns == [] and chat.conversation.system == "Be brief."
    assert chat.command("/system", "off") == "no system message (a chat template may add its own)"
    assert chat.command("/reset", "") == "conversation cleared"

    plain = ChatMode()
    assert plain.learn({"model": "tiny"}) and not plain.on  # no chat_template field: an older server
    assert plain.describe() == "plain completion: the model has no chat template"
    assert plain.command("/chat", "").startswith("[error] the model has no chat template, so each line stays")
    assert not plain.on


# Two concepts read at layers 0 and 2: a row is [a@0, b@0, a@2, b@2].
MANIFEST = {
    "concepts": ["alpha", "beta"],
    "layers": [0, 2],
    "concept_info": [{"name": "alpha", "recommended_layer": 2}, {"name": "beta", "recommended_layer": 0}],
}


def test_the_first_token_is_shown_as_not_read_and_says_why() -> None:
    nan = float("nan")
    rows = [{"position": 0, "readout": [nan] * 4}, {"position": 1, "readout": [0.0, 0.3, 0.8, 0.9]}]
    table = readout_table(choose_readout("", MANIFEST), MANIFEST, rows, ["<s>", "The"])
    assert table[1].split() == ["0", "'<s>'", "-", "-"] and table[2].split() == ["1", "'The'", "0.80", "0.30"]
    assert table[-1].startswith("-: position 0 is not read as a probability (the first token holds")
    raw = [{"position": 0, "readout": [1.5, 2.5, 3.5, 4.5]}]
    assert "position 0" not in readout_table(choose_readout("raw", MANIFEST), MANIFEST, raw, ["<s>"])[-1]


def test_a_reply_summary_has_each_concepts_mean_and_max() -> None:
    rows = [
        {"position": 7, "readout": [0.0, 0.1, 0.2, 0.9]},
        {"position": 8, "readout": [0.0, 0.7, 0.6, 0.9]},
        {"position": 9, "readout": [0.0, 0.7, 0.4, 0.9]},
    ]
    texts = ["The", " capital", " is"]
    view = choose_readout("token", MANIFEST)
    assert view == ReadoutView("token") and view.columns(MANIFEST) == [2, 1]
    assert readout_table(view, MANIFEST, rows, texts)[1].split() == ["7", "'The'", "0.20", "0.10"]
    assert readout_summary(view, MANIFEST, rows, texts) == [
        "the reply's 3 tokens (positions 7-9), each concept's mean and largest token probability:",
        "  alpha  mean 0.40  max 0.60 at ' capital' (position 8)",
        "  beta   mean 0.50  max 0.70 at ' capital' (position 8)",  # the first of equal maxima
    ]
    # The default is the running view: its summary is the value at the reply's last token.
    running = choose_readout("", MANIFEST)
    assert running == ReadoutView("running") == choose_readout("running", MANIFEST)
    assert readout_summary(running, MANIFEST, rows, texts)[1:] == [
        "  alpha  last 0.40  max 0.60 at ' capital' (position 8)",
        "  beta   last 0.70  max 0.70 at ' capital' (position 8)",
    ]
    raw = choose_readout("raw", MANIFEST)
    assert raw == ReadoutView("raw", 2) and raw.columns(MANIFEST) == [2, 3]
    assert readout_summary(raw, MANIFEST, rows, texts)[0].endswith("mean and largest raw value at layer 2:")
    assert readout_summary(view, MANIFEST, [], []) == ["no reply tokens were read out"]
    for arg, manifest, message in (
        ("two", MANIFEST, "/readout takes nothing, 'running', 'token', 'raw [LAYER]' or 'off', not 'two'"),
        ("token 2", MANIFEST, "not 'token 2'"),
        ("raw 1", MANIFEST, "layer 1 is not read out; the concept set reads layers [0, 2]"),
        ("raw x", MANIFEST, "not 'raw x'"),
        ("", MANIFEST | {"concept_info": None}, "the concept set has no calibration"),
        ("", None, "the server has no concept set"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            choose_readout(arg, manifest)


class ScriptedClient:
    """In place of LmtpClient: answers as a server on a model with a chat template and MANIFEST's
    concepts would, each stream with the next scripted payloads, and keeps what it was sent."""

    def __init__(self, streams: list[list[dict]]) -> None:
        self.streams = streams
        self.sent: list[dict] = []
        self._ids = itertools.count(1)

    def next_stream_id(self) -> int:
        return next(self._ids)

    async def request(self, kind: str, **fields) -> dict:
        if kind == "MODEL_INFO":
            return {"model_info": {"model": "m", "chat_template": True, "readout_manifest": MANIFEST}}
        if kind == "TOKENIZE":
            return {"tokens": [5, 6]}
        assert kind == "DETOKENIZE"
        return {"text": f"<{fields['tokens'][0]}>"}

    async def stream(self, kind: str, *, stream_id: int, **fields) -> AsyncIterator[dict]:
        self.sent.append(fields)
        for payload in self.streams.pop(0):
            yield payload

    async def cancel(self, stream_id: int) -> None:
        raise AssertionError("nothing is cancelled here")


def test_chat_mode_sends_the_conversation_and_shows_the_replys_readouts(capsys: pytest.CaptureFixture) -> None:
    with_readouts = _chat_payloads("stop")
    for payload, row in zip(
        with_readouts[1:], ([0.1] * 4, [0.0, 0.3, 0.8, 0.0], [0.0, 0.5, 0.4, 0.0], [0.9] * 4), strict=True
    ):
        payload["readout"] = row  # the prompt's last position, the reply's two tokens, the end of turn
    client = ScriptedClient([_chat_payloads("stop"), with_readouts, _chat_payloads("length")])
    loop = asyncio.new_event_loop()
    try:
        repl = Repl(client, loop)  # type: ignore[arg-type]
        repl.learn_template()
        assert repl.chat.on and capsys.readouterr().out.startswith("chat mode")
        repl.handle("Capital of France? max_tokens=8")
        assert capsys.readouterr().out == "Paris.\n[stop]\n"  # no <|im_end|>
        assert client.sent[0]["messages"] == [{"role": "user", "content": "Capital of France?"}]
        assert client.sent[0]["max_tokens"] == 8 and "prompt" not in client.sent[0]
        repl.handle("/readout")
        repl.handle("And Italy?")
        assert client.sent[1]["max_tokens"] == 256 and client.sent[1]["readout_format"] == "running"
        assert client.sent[1]["messages"][1:] == [
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"},
        ]
        out = capsys.readouterr().out.splitlines()
        table = out.index(next(line for line in out if line.lstrip().startswith("pos")))
        assert [line.split()[:2] for line in out[table + 1 :]] == [
            ["4", "'<10>'"],  # the reply's tokens only: not the prompt's, not the end of turn
            ["5", "'<11>'"],
            ["the", "reply's"],
            ["alpha", "last"],  # the running view's summary: the text so far, at the reply's last token
            ["beta", "last"],
        ]
        assert out[-2:] == [
            "  alpha  last 0.40  max 0.80 at '<10>' (position 4)",
            "  beta   last 0.50  max 0.50 at '<11>' (position 5)",
        ]
        repl.handle("/readout off")
        repl.handle("/raw")
        repl.handle("Once upon a time")
        assert client.sent[2]["prompt"] == [5, 6] and "messages" not in client.sent[2]
        assert client.sent[2]["max_tokens"] == 64
        assert capsys.readouterr().out.endswith("Paris.\n[length]\n")
        assert len(repl.chat.conversation.turns) == 2  # a prompt is not a turn
    finally:
        loop.close()


async def test_repl_without_a_chat_template_stays_plain(lmtp_server: LmtpServer) -> None:
    terminal = Terminal([SALIENCE, "repl", lmtp_server.url.replace("http://", "ws://")])
    try:
        await terminal.expect(r"connected to .*\(tiny\); plain completion: the model has no chat template; /help")
        await terminal.expect(">>> ")
        terminal.send("/chat\r")
        await terminal.expect(
            r"\[error\] the model has no chat template, so each line stays a plain prompt "
            r"\(start the server with --chat-template FILE to chat\)"
        )
        terminal.send("/set\r")
        await terminal.expect(r"max_tokens=64 temperature=0\.0")
        terminal.send("def hello max_tokens=3 ignore_eos=true\r")
        await terminal.expect(r"\[length\]")
        terminal.send("/history\r")
        await terminal.expect(r"\(no conversation yet\)")  # a prompt is not a turn
        await leave(terminal)
    finally:
        terminal.close()


def test_constraint_commands_read_their_argument_or_file(tmp_path: Path) -> None:
    schema = tmp_path / "pet.json"
    schema.write_text('{"type": "object"}')
    assert constraint_field("/json", f"@{schema}") == {"json": '{"type": "object"}'}
    assert constraint_field("/json", "") == {"json_object": True}
    assert constraint_field("/choice", "a|b c") == {"choice": ["a", "b c"]}
    assert constraint_field("/free", "") is None
    for command, arg, message in (
        ("/regex", "", "usage: /regex R"),
        ("/grammar", f"@{tmp_path / 'none'}", "cannot read"),
        ("/json", "{", "structured_outputs.json is not valid JSON"),
        ("/choice", "x" * 70_000, "at most 65536"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            constraint_field(command, arg)


async def test_repl_constrains_every_later_reply_until_free(lmtp_server: LmtpServer, tmp_path: Path) -> None:
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= ("yes" | "no") ", " [0-9] [0-9]')
    choices = ["alpha", "beta gamma", "delta"]
    eos = lmtp_server.engine.tokenizer.eos_token or ""  # plain completion prints the stop token's text
    terminal = Terminal([SALIENCE, "repl", lmtp_server.url.replace("http://", "ws://")])

    async def reply(line: str, end: str = r"\n\[stop\]") -> str:
        """What the terminal shows up to `end` (a generation's: its text, without the stop token's)."""
        await terminal.expect(">>> ")  # typed before readline reads it, a line would be echoed twice
        terminal.send(line + "\r")
        out = await terminal.expect(end)
        return _shown_reply(out, line).removesuffix(eos) if line.startswith("def ") else out

    try:
        await reply(
            "/choice " + "|".join(choices), re.escape('structured_outputs {"choice": ["alpha", "beta gamma", "delta"]}')
        )
        for seed in range(3):
            assert await reply(f"def hello max_tokens=12 temperature=1 seed={seed}") in choices
        await reply(f"/grammar @{grammar}", re.escape('structured_outputs {"grammar": "root ::= ('))
        assert re.fullmatch(r"(yes|no), \d\d", await reply("def hello max_tokens=12"))
        await reply("/regex [0-9", re.escape('structured_outputs {"regex": "[0-9"}'))  # the server refuses it
        await reply("def hello max_tokens=4", r"\[error\] structured_outputs\.regex: Grammar error")
        await reply("/free", "no constraint")
        await reply("def hello max_tokens=3 ignore_eos=true", r"\[length\]")
        await leave(terminal)
    finally:
        terminal.close()


@pytest_asyncio.fixture(scope="module")
async def chat_url(default_engine: Engine, default_model: Path) -> AsyncIterator[str]:
    """The default model (SmolLM2, with its chat template) and its calibrated concept set."""
    async with frontends(default_engine, default_model.name) as served:
        yield served.ws


@dataclass(frozen=True)
class DirectReply:
    start: int  # len(prompt_ids): the reply's first position
    text: str  # without the end-of-turn token's
    tokens: int  # the reply's tokens, the end-of-turn token not counted


async def _direct_chat(url: str, messages: list[dict], max_tokens: int) -> DirectReply:
    """The REPL's chat request made directly over LMTP, read without the REPL's code."""
    client = await LmtpClient.connect(url)
    try:
        fields = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "text": True}
        payloads = [p async for p in client.stream("GENERATE", **fields)]
    finally:
        await client.close()
    assert "prompt_ids" in payloads[0]
    tokens = [p for p in payloads if "token" in p]
    if tokens[-1]["finish_reason"] == "stop":
        assert tokens[-1]["text"] == "<|im_end|>"  # the default model's EOS ends the turn
        tokens.pop()
    return DirectReply(len(payloads[0]["prompt_ids"]), "".join(p["text"] for p in tokens), len(tokens))


def _shown_reply(out: str, line: str) -> str:
    """The reply as the terminal shows it: after the echoed line, up to the `[finish]` line."""
    body = out.replace("\r\n", "\n").replace("\r", "")
    body = body[body.index(line) + len(line) :]
    return body.removeprefix("\n").rsplit("\n[", 1)[0]


async def test_repl_chats_on_a_model_with_a_template(chat_url: str, default_engine: Engine) -> None:
    assert default_engine.readouts is not None
    concepts = list(default_engine.readouts.manifest.concepts)
    question, follow_up = "What is the capital of France?", "And of Italy?"
    terminal = Terminal([SALIENCE, "repl", chat_url])
    try:
        await terminal.expect(r"connected to .*; chat mode: each line is your turn .*/help for commands")
        await terminal.expect(">>> ")
        line = f"{question} max_tokens=48"
        terminal.send(line + "\r")
        out = await terminal.expect(r"\n\[(stop|length)\]")
        first = await _direct_chat(chat_url, [{"role": "user", "content": question}], 48)
        assert first.text.strip() and "<|im_end|>" not in out  # answered, and the end of turn not printed
        assert _shown_reply(out, line) == first.text
        await terminal.expect(">>> ")

        terminal.send("/history\r")
        out = (await terminal.expect(r"assistant: .*\n")).replace("\r", "")
        assert f"user: {question}\nassistant: {first.text.splitlines()[0]}" in out

        terminal.send("/readout\r")
        await terminal.expect(r"concept probabilities \(running: p that the text so far has the concept\), each at ")
        terminal.send(f"{follow_up} max_tokens=24\r")
        summary = r"each concept's last and largest running probability:\s*\n" + r"(?:.*\n)" * len(concepts)
        out = (await terminal.expect(r"\n\[(stop|length)\]\s*\n(?:.*\n)*?.*" + summary)).replace("\r", "")
        turns = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": follow_up},
        ]
        second = await _direct_chat(chat_url, turns, 24)  # the whole conversation was sent
        lines = out.splitlines()
        table = lines.index(next(line for line in lines if re.match(r"\s+pos\s+token\s", line)))
        rows = [line.split() for line in lines[table + 1 : table + 1 + second.tokens]]
        assert [int(row[0]) for row in rows] == list(range(second.start, second.start + second.tokens))
        assert lines[table + 1 + second.tokens].startswith(f"the reply's {second.tokens} tokens (positions ")
        for k, concept in enumerate(concepts):
            shown = [row[len(row) - len(concepts) + k] for row in rows]
            match = re.search(
                rf"\n  {re.escape(concept)}\s+last (\d\.\d\d)  max (\d\.\d\d) at .* \(position (\d+)\)\n", out
            )
            assert match, f"no summary line for {concept}:\n{out}"
            last, top, position = match[1], match[2], int(match[3])
            assert last == shown[-1]  # the text so far, at the reply's last token
            assert top == max(shown, key=float) == shown[position - second.start]
        await terminal.expect(">>> ")

        terminal.send("/readout off\r")
        await terminal.expect(">>> ")  # typed before readline reads it, the story would be echoed twice
        story = "Tell me a long story."
        terminal.send(f"{story} max_tokens=1500 ignore_eos=true\r")
        await terminal.expect(re.escape(story) + r".*\n.+", timeout=30)  # the reply is streaming
        terminal.send("\x03")
        await terminal.expect(r"\[cancelled\]\s*\n\[the partial reply stays in the conversation\]")
        await terminal.expect(">>> ")
        for _ in range(50):  # the abort may take a step to land
            if default_engine.num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.1)
        assert default_engine.num_unfinished_requests() == 0
        terminal.send("/history\r")
        out = (await terminal.expect(rf"user: {re.escape(story)}\r?\nassistant: .*\n")).replace("\r", "")
        assert re.findall(r"^user: (.*)$", out, re.M) == [question, follow_up, story]

        terminal.send("/system Answer in one word.\r")
        await terminal.expect(r"system: Answer in one word\.")
        terminal.send("/reset\r")
        await terminal.expect(r"conversation cleared \(the system message stays\)")
        terminal.send("/history\r")
        out = await terminal.expect(r"system: Answer in one word\.\s*\n.*>>> ")
        assert "user:" not in out

        terminal.send("/raw\r")
        await terminal.expect(r"plain completion: each line is a prompt the model continues")
        terminal.send("/set\r")
        await terminal.expect(r"max_tokens=64 temperature=0\.0")
        terminal.send("The capital of France is max_tokens=4 ignore_eos=true\r")
        await terminal.expect(r"\[length\]")
        terminal.send("/history\r")  # a prompt is not a turn
        out = await terminal.expect(r"system: Answer in one word\.\s*\n.*>>> ")
        assert "user:" not in out
        terminal.send("/chat\r")
        await terminal.expect(r"chat mode: each line is your turn")
        await leave(terminal)
    finally:
        terminal.close()
