"""`salience repl`: type a question (or a prompt), watch the reply stream in.

On a model with a chat template each line is the user's turn in a conversation the REPL keeps
and sends whole as GENERATE `messages` (chat.py); `/raw` makes each line a prompt the model
continues. Parameters follow the line as `key=value` pairs, as in LMQL's own client
(`Hello there max_tokens=5 temperature=1.2`); values are read as JSON where
they parse, never evaluated. The server renders messages and tokenizes prompts (TOKENIZE),
so no tokenizer is needed here. Ctrl-C stops the running stream (CANCEL) and
keeps the REPL; Ctrl-D leaves. Line editing and history come from readline.

Theory of operation: input() blocks in the main thread (so readline works);
each request runs on one persistent event loop that also owns the connection.
A Ctrl-C during a request is a loop signal handler that sends CANCEL; the
stream then finishes on its own terms ("[cancelled]").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import aiohttp

from salience.core.models.home import salience_home
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.codec import readout_values
from salience.repl import constraints as repl_constraints
from salience.repl.chat import CHAT_COMMANDS, ChatMode, Reply, is_end_of_turn
from salience.repl.display import HELP, concept_lines, stream_ending
from salience.repl.features import FeatureView, choose_features, feature_lines
from salience.repl.parsing import parse_line, parse_monitor, parse_steer
from salience.repl.readouts import ReadoutView, choose_readout, readout_summary, readout_table
from salience.tls import ClientTls

__all__ = ["run_repl"]


class Repl:
    def __init__(self, client: LmtpClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop
        # max_tokens, unless /set, is the mode's (ChatMode.max_tokens): a reply runs longer than a completion.
        self.defaults: dict[str, Any] = {"temperature": 0.0}
        self.top = 0
        self.chat = ChatMode()
        self.readout: ReadoutView | None = None  # None: readouts are not shown
        self.steer: list[dict] = []  # sent with every GENERATE and SCORE
        self.monitors: list[dict] = []  # sent with every GENERATE
        self.features: FeatureView | None = None  # asked for with every GENERATE and SCORE
        self.constraint: dict | None = None  # sent with every GENERATE as its structured_outputs
        self._manifest: dict | None = None

    def run(self, coroutine) -> Any:
        return self.loop.run_until_complete(coroutine)

    def handle(self, line: str) -> bool:
        """Act on one line; False means leave."""
        line = line.strip()
        if not line:
            return True
        command, _, rest = line.partition(" ")
        if command in ("/quit", "/exit"):
            return False
        if self.chat.template is None:  # the model was loading when the REPL started: ask again
            self.learn_template()
        if command == "/help":
            print(HELP)
        elif command in CHAT_COMMANDS:
            print(self.chat.command(command, rest.strip()))
        elif command == "/top":
            self.top = int(rest or 0)
        elif command == "/readout":
            self.set_readout(rest.strip())
        elif command == "/features":
            self.set_features(rest.strip())
        elif command == "/steer":
            self.set_steer(rest.strip())
        elif command == "/monitor":
            self.set_monitor(rest.strip())
        elif command in repl_constraints.COMMANDS:
            self.constraint = repl_constraints.constraint_field(command, rest.strip())
            print(repl_constraints.describe(self.constraint))
        elif command == "/define":
            self.define(rest.strip())
        elif command == "/delete":
            reply = self.run(self.client.request("DELETE_CONCEPT", name=rest.strip()))
            print(f"deleted {rest.strip()} (concepts version {reply['version']})")
        elif command == "/concepts":
            self.list_concepts()
        elif command == "/save":
            self.save(rest.strip())
        elif command == "/set":
            self.defaults.update(parse_line("x " + rest)[1])
            defaults = {"max_tokens": self.chat.max_tokens} | self.defaults
            print(" ".join(f"{k}={json.dumps(v)}" for k, v in defaults.items()))
        elif command == "/info":
            print(json.dumps(self.run(self.client.request("MODEL_INFO"))["model_info"], indent=2))
        elif command == "/score":
            prompt, sep, continuation = rest.partition("||")
            if not sep:
                print("usage: /score PROMPT || CONTINUATION")
            else:
                self.stream("SCORE", prompt.rstrip(), {"scored_text": continuation.strip(" ")})
        else:
            text, params = parse_line(line)
            self.stream("GENERATE", text, params, chat=self.chat.on)
        return True

    def learn_template(self) -> None:
        """Whether the model has a chat template, from MODEL_INFO; says so once it knows. Not
        knowing yet (the model loads, MODEL_INFO fails) leaves the line to run as plain completion."""
        with contextlib.suppress(LmtpStreamError):
            if self.chat.learn(self.run(self.client.request("MODEL_INFO"))["model_info"]):
                print(self.chat.describe())

    def manifest(self) -> dict | None:
        if self._manifest is None:
            self._manifest = self.run(self._read_manifest())
        return self._manifest

    async def _read_manifest(self) -> dict | None:
        info = (await self.client.request("MODEL_INFO"))["model_info"]
        return info.get("readout_manifest") if isinstance(info, dict) else None  # str: loading

    def define(self, name: str) -> None:
        if not name or " " in name:
            print("usage: /define NAME   (then the examples, one per line)")
            return
        examples = {}
        for side in ("positive", "negative"):
            print(f"{side} examples of {name}, one per line; a blank line ends them:")
            lines = []
            while line := input(f"  {side[:3]}> ").strip():
                lines.append(line)
            examples[side] = lines
        print(f"fitting {name} on the server ...")
        reply = self.run(self.client.request("DEFINE_CONCEPT", name=name, **examples))
        self._manifest = None
        print(reply["table"])
        print(f"defined {name} (concepts version {reply['version']}): /readout, /monitor and /steer {name} use it")

    def list_concepts(self) -> None:
        self._manifest = None
        print("\n".join(concept_lines(self.manifest())))

    def save(self, path: str) -> None:
        if not path:
            print("usage: /save FILE")
            return
        import base64
        from pathlib import Path

        reply = self.run(self.client.request("SAVE_CONCEPTS"))
        Path(path).expanduser().write_bytes(base64.b64decode(reply["concept_set"]))
        print(f"wrote {reply['bytes']} bytes to {path}")

    def set_readout(self, arg: str) -> None:
        if arg == "off":
            self.readout = None
            return
        manifest = self.manifest()
        self.readout = choose_readout(arg, manifest)
        print(self.readout.header(manifest))

    def set_features(self, arg: str) -> None:
        if arg == "off":
            self.features = None
            return
        info = self.run(self.client.request("MODEL_INFO"))["model_info"]
        self.features = choose_features(arg, (info.get("saes") if isinstance(info, dict) else None) or [])
        print(self.features.header())

    def set_monitor(self, arg: str) -> None:
        if arg == "off":
            self.monitors = []
        elif arg:
            self.monitors.append(parse_monitor(arg))
        if not self.monitors:
            print("no monitors")
        for monitor in self.monitors:
            print(json.dumps(monitor))

    def set_steer(self, arg: str) -> None:
        if arg == "off":
            self.steer = []
        elif arg:
            info = self.run(self.client.request("MODEL_INFO"))["model_info"]
            steering = info.get("steering") if isinstance(info, dict) else None
            if not steering:
                print("[error] the server does not steer (no concept or steering set, or --no-steering)")
                return
            self.steer.append(parse_steer(arg, steering["directions"]))
        if not self.steer:
            print("no steering")
        for intervention in self.steer:
            print(json.dumps(intervention))

    def stream(self, kind: str, prompt: str, params: dict[str, Any], *, chat: bool = False) -> None:
        """Run one GENERATE or SCORE to its end; `chat`: `prompt` is the user's turn."""
        stream_id = self.client.next_stream_id()
        task = self.loop.create_task(self._stream(kind, stream_id, prompt, params, chat))
        # Ctrl-C as a loop callback, not a KeyboardInterrupt: raised inside whichever task
        # happened to run (the connection's reader, say), it would kill that task.
        cancels: set[asyncio.Task] = set()
        self.loop.add_signal_handler(
            signal.SIGINT, lambda: cancels.add(self.loop.create_task(self.client.cancel(stream_id)))
        )
        try:
            self.run(task)
        except LmtpStreamError as exc:
            print(f"\n[error] {exc}")
        finally:
            self.loop.remove_signal_handler(signal.SIGINT)

    async def _tokens(self, text: str) -> list[int]:
        return (await self.client.request("TOKENIZE", text=text))["tokens"]

    async def _stream(self, kind: str, stream_id: int, prompt: str, params: dict[str, Any], chat: bool) -> None:
        fields: dict[str, Any] = {"text": True}
        if chat:  # the server renders the conversation and sends its ids first (prompt_ids)
            fields["messages"] = self.chat.conversation.messages(prompt)
        else:
            fields["prompt"] = await self._tokens(prompt)
        if kind == "SCORE":
            fields["scored"] = await self._tokens(params["scored_text"])
            fields["top_logprobs"] = self.top
        else:
            fields |= {"max_tokens": self.chat.max_tokens} | self.defaults | params
            fields.setdefault("top_logprobs", self.top)
        if self.readout is not None:
            self._manifest = await self._read_manifest()  # the concepts this stream will read
            fields["readout"] = [[0, 2**31]]  # every position: the prompt's and the generated ones
            fields["readout_encoding"] = "f32"  # a fifth of JSON's bytes, and nothing to parse
            if self.readout.probability:
                fields["readout_format"] = self.readout.mode
        if self.steer:
            fields["steer"] = self.steer
        if self.monitors and kind == "GENERATE":
            fields["monitors"] = self.monitors
        if self.constraint is not None and kind == "GENERATE":
            fields.setdefault("structured_outputs", self.constraint)  # a line's own key=value wins
        if self.features is not None:
            fields["features"] = self.features.field()
        payloads = []
        async for payload in self.client.stream(kind, stream_id=stream_id, **fields):
            if "readout" in payload:
                payload["readout"] = readout_values(payload["readout"])
            payloads.append(payload)
            if kind == "GENERATE" and not self.top and not (chat and is_end_of_turn(payload)):
                print(payload.get("text", ""), end="", flush=True)
        print("\n".join(stream_ending(kind, payloads, self.top)))
        reply = Reply.of(payloads) if chat else None
        if reply is not None and (note := self.chat.add(prompt, reply)):
            print(note)
        # In chat mode the per-token views cover the reply: the rendered conversation before it is
        # the template's and the earlier turns', and the end-of-turn token is not the reply's.
        start = reply.start if reply is not None else 0
        shown = [p for p in payloads if p.get("position", 0) >= start and not (chat and is_end_of_turn(p))]
        if self.readout is not None:
            await self._print_readouts([p for p in shown if "readout" in p], summary=chat)
        if self.features is not None:
            rows = [p for p in shown if "features" in p]
            texts = await asyncio.gather(*(self.client.request("DETOKENIZE", tokens=[p["token"]]) for p in rows))
            print(self.features.header() + ":")
            print("\n".join(feature_lines(rows, [t["text"] for t in texts])))

    async def _print_readouts(self, rows: list[dict], *, summary: bool) -> None:
        """One line per position: its token and each concept's value, at the chosen layer (raw) or
        at each concept's recommended layer (probabilities); `summary`: then a line per concept."""
        manifest = self.manifest()
        assert manifest is not None and self.readout is not None
        replies = await asyncio.gather(*(self.client.request("DETOKENIZE", tokens=[p["token"]]) for p in rows))
        texts = [reply["text"] for reply in replies]
        print("\n".join(readout_table(self.readout, manifest, rows, texts)))
        if summary:
            print("\n".join(readout_summary(self.readout, manifest, rows, texts)))


def _setup_readline() -> None:
    try:
        import readline
    except ImportError:  # no line editing on this platform
        return
    import atexit

    history = salience_home() / "repl_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(history)
    readline.set_history_length(1000)
    atexit.register(lambda: history.parent.mkdir(parents=True, exist_ok=True) or readline.write_history_file(history))


def run_repl(url: str, *, tls: ClientTls | None = None, token: str | None = None) -> int:
    loop = asyncio.new_event_loop()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        context = tls.context() if tls is not None and url.startswith("wss:") else None
        client = loop.run_until_complete(LmtpClient.connect(url, headers, tls=context))
    except (OSError, aiohttp.ClientError) as exc:
        print(f"salience: error: cannot connect to {url}: {exc}", file=sys.stderr)
        return 2
    repl = Repl(client, loop)
    try:
        info = repl.run(client.request("MODEL_INFO"))["model_info"]
    except LmtpStreamError as exc:
        info = f"<{exc}>"
    mode = f"{repl.chat.describe()}; " if repl.chat.learn(info) else ""
    print(f"connected to {url} ({info['model'] if isinstance(info, dict) else info}); {mode}/help for commands")
    _setup_readline()
    try:
        while True:
            try:
                line = input(">>> ")
            except KeyboardInterrupt:
                print()
                continue
            except EOFError:
                print()
                return 0
            try:
                if not repl.handle(line):
                    return 0
            except (LmtpStreamError, ValueError) as exc:
                print(f"[error] {exc}")
            except ConnectionError as exc:
                print(f"[connection lost] {exc}")
                return 1
    finally:
        loop.run_until_complete(client.close())
        loop.close()
