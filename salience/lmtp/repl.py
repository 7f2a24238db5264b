"""`salience repl`: type a prompt, watch the text stream in.

Parameters follow the prompt as `key=value` pairs, as in LMQL's own client
(`Hello there max_tokens=5 temperature=1.2`); values are read as JSON where
they parse, never evaluated. The prompt is tokenized by the server (TOKENIZE),
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
import math
import signal
import sys
from typing import Any

from salience.core.models.home import salience_home
from salience.core.probes.calibration import calibrated
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.repl_features import FeatureView, choose_features, feature_lines
from salience.lmtp.repl_parsing import parse_line, parse_monitor, parse_steer

__all__ = ["run_repl"]

HELP = """\
  PROMPT [key=value ...]     generate from PROMPT (e.g. max_tokens=32 temperature=0 top_k=40 seed=1)
  /score PROMPT || CONT      logprob of each token of CONT after PROMPT
  /top K                     show the K most likely alternatives of each generated token (0: off)
  /readout                   show every token's concept probabilities (0.00-1.00), each concept at
                             its recommended layer (a calibrated concept set; docs/readouts.md)
  /readout raw [LAYER]       show every token's raw readouts at LAYER (default: the deepest read)
  /readout off               stop showing readouts
  /features [K] [SAE]        show every token's K most active SAE features (default 5) at the SAE's
                             layer, as #id:activation; SAE picks one where the server serves several
  /features off              stop showing features
  /monitor NAME >P|<P stop|flag [LAYER]
                             watch concept NAME on every generated token: stop the generation, or
                             flag each token, where its probability goes above (below) P
  /monitor [off]             list the monitors in force; drop them all
  /steer NAME +A|-A|=V|ablate [LAYERS] [@all|@prompt|@generated]
                             steer every request along a concept: add A, set to V, or ablate, at
                             LAYERS (15, 10-14 or 3,7; default: the middle of its layers), at every
                             position (@all, the default), the prompt's or the generated ones
  /steer [off]               list the interventions in force; drop them all
  /define NAME               define concept NAME on the server from examples: type positive examples,
                             one per line, a blank line ends them; then negative ones. Prints its
                             held-out validation; /readout, /monitor and /steer NAME then work on it
  /delete NAME               delete live concept NAME
  /concepts                  every concept the server reads, live or loaded, with its validation
  /save FILE                 write the served concepts, live ones included, as a concept-set file
                             (salience serve --concepts FILE serves them again)
  /set key=value ...         change the defaults for every generation
  /info                      what the server serves
  /help, /quit               this text; leave (Ctrl-D works too)
  Ctrl-C stops the running generation."""


class Repl:
    def __init__(self, client: LmtpClient, loop: asyncio.AbstractEventLoop) -> None:
        self.client = client
        self.loop = loop
        self.defaults: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}
        self.top = 0
        # What readouts are shown: None (off), ("probability", None), or ("raw", the layer shown).
        self.readout: tuple[str, int | None] | None = None
        self.steer: list[dict] = []  # sent with every GENERATE and SCORE
        self.monitors: list[dict] = []  # sent with every GENERATE
        self.features: FeatureView | None = None  # asked for with every GENERATE and SCORE
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
        if command == "/help":
            print(HELP)
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
            print(" ".join(f"{k}={json.dumps(v)}" for k, v in self.defaults.items()))
        elif command == "/info":
            print(json.dumps(self.run(self.client.request("MODEL_INFO"))["model_info"], indent=2))
        elif command == "/score":
            prompt, sep, continuation = rest.partition("||")
            if not sep:
                print("usage: /score PROMPT || CONTINUATION")
            else:
                self.stream("SCORE", prompt.rstrip(), {"scored_text": continuation.strip(" ")})
        else:
            prompt, params = parse_line(line)
            self.stream("GENERATE", prompt, params)
        return True

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
        manifest = self.manifest()
        if not manifest:
            print("the server has no concept set")
            return
        print(
            f"concepts version {manifest['version']}, read at layers {manifest['layers'][0]}..{manifest['layers'][-1]}"
        )
        for name, info in zip(manifest["concepts"], manifest["concept_info"], strict=True):
            kind = "live" if name in manifest["live"] else "loaded"
            if calibrated(info):
                best = next(fit for fit in info["layers"] if fit["layer"] == info["recommended_layer"])
                facts = f"{info['method']}, layer {info['recommended_layer']}, held-out AUROC {best['auroc']:.3f}"
            else:
                facts = "not validated (raw readouts only)"
            print(f"  {name:<24} {kind:<7} {facts}")

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
        if not manifest:
            print("[error] the server has no concept set: it reads nothing out")
            return
        mode, _, layer_arg = arg.partition(" ")
        if mode == "":
            if not all(manifest.get("concept_info") or [None]):
                print("[error] the concept set has no calibration: use /readout raw [LAYER]")
                return
            self.readout = ("probability", None)
            layers = ", ".join(f"{i['name']}@{i['recommended_layer']}" for i in manifest["concept_info"])
            print(f"concept probabilities, each at its recommended layer: {layers}")
            return
        if mode != "raw" or (layer_arg and not layer_arg.strip().isdigit()):
            print(f"[error] /readout takes nothing, 'raw [LAYER]' or 'off', not {arg!r}")
            return
        layers = manifest["layers"]
        layer = int(layer_arg) if layer_arg.strip() else layers[-1]
        if layer not in layers:
            print(f"[error] layer {layer} is not read out; the concept set reads layers {layers}")
            return
        self.readout = ("raw", layer)
        print(f"raw readouts at layer {layer} of {', '.join(manifest['concepts'])}")

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

    def stream(self, kind: str, prompt: str, params: dict[str, Any]) -> None:
        stream_id = self.client.next_stream_id()
        task = self.loop.create_task(self._stream(kind, stream_id, prompt, params))
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

    async def _stream(self, kind: str, stream_id: int, prompt: str, params: dict[str, Any]) -> None:
        fields: dict[str, Any] = {"prompt": await self._tokens(prompt), "text": True}
        if kind == "SCORE":
            fields["scored"] = await self._tokens(params["scored_text"])
            fields["top_logprobs"] = self.top
        else:
            fields |= self.defaults | params
            fields.setdefault("top_logprobs", self.top)
        if self.readout is not None:
            self._manifest = await self._read_manifest()  # the concepts this stream will read
            fields["readout"] = [[0, 2**31]]  # every position: the prompt's and the generated ones
            if self.readout[0] == "probability":
                fields["readout_format"] = "probability"
        if self.steer:
            fields["steer"] = self.steer
        if self.monitors and kind == "GENERATE":
            fields["monitors"] = self.monitors
        if self.features is not None:
            fields["features"] = self.features.field()
        payloads = []
        async for payload in self.client.stream(kind, stream_id=stream_id, **fields):
            payloads.append(payload)
            if kind == "GENERATE" and not self.top:
                print(payload.get("text", ""), end="", flush=True)
        scored = [p for p in payloads if "token" in p and not p.get("prompt")]
        if kind == "SCORE" or self.top:
            for payload in scored:
                print(_describe(payload))
        if kind == "SCORE":
            print(f"total logprob {sum(p['logprob'] for p in scored):.4f}")
        print(f"\n[{payloads[-1]['finish_reason']}]")
        for event in (e for p in payloads for e in p.get("monitors", ())):
            print(
                f"[monitor {event['monitor']} {event['action']}: {event['concept']} at layer {event['layer']}, "
                f"position {event['position']}: p={event['probability']:.3f}]"
            )
        if self.readout is not None:
            await self._print_readouts([p for p in payloads if "readout" in p])
        if self.features is not None:
            rows = [p for p in payloads if "features" in p]
            texts = await asyncio.gather(*(self.client.request("DETOKENIZE", tokens=[p["token"]]) for p in rows))
            print(self.features.header() + ":")
            print("\n".join(feature_lines(rows, [t["text"] for t in texts])))

    async def _print_readouts(self, rows: list[dict]) -> None:
        """One line per position: its token and each concept's value, at the chosen layer (raw) or
        at each concept's recommended layer (probabilities)."""
        manifest = self.manifest()
        assert manifest is not None and self.readout is not None
        concepts, layers = manifest["concepts"], manifest["layers"]
        mode, layer = self.readout
        if mode == "probability":
            columns = [
                layers.index(i["recommended_layer"]) * len(concepts) + k for k, i in enumerate(manifest["concept_info"])
            ]
        else:
            columns = [layers.index(layer) * len(concepts) + k for k in range(len(concepts))]
        texts = await asyncio.gather(*(self.client.request("DETOKENIZE", tokens=[p["token"]]) for p in rows))
        widths = [max(10, len(c) + 2) for c in concepts]
        print(f"{'pos':>5}  {'token':<14}" + "".join(f"{c:>{w}}" for c, w in zip(concepts, widths, strict=True)))
        for payload, text in zip(rows, texts, strict=True):
            values = [payload["readout"][c] for c in columns]
            shape = ".2f" if mode == "probability" else ".4g"
            cells = "".join(f"{v:>{w}{shape}}" for v, w in zip(values, widths, strict=True))
            print(f"{payload['position']:>5}  {text['text']!r:<14}" + cells)


def _describe(payload: dict) -> str:
    alternatives = ", ".join(f"{t}:{math.exp(lp):.3f}" for t, lp in payload.get("top_logprobs", {}).items())
    line = f"{payload['token']:>7} {payload.get('text', '')!r:<16} logprob {payload['logprob']:9.4f}"
    return line + (f"  top {alternatives}" if alternatives else "")


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


def run_repl(url: str) -> int:
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(LmtpClient.connect(url))
    except OSError as exc:
        print(f"salience: error: cannot connect to {url}: {exc}", file=sys.stderr)
        return 2
    repl = Repl(client, loop)
    try:
        name = repl.run(client.request("MODEL_INFO"))["model_info"]
    except LmtpStreamError as exc:
        name = f"<{exc}>"
    print(f"connected to {url} ({name['model'] if isinstance(name, dict) else name}); /help for commands")
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
