"""What the REPL prints that needs no server: `/help`, a finished stream's ending, `/concepts`.

Kept out of console.py so the loop there reads as commands and requests; these are pure text, tested
without a connection. Readouts and features print through readouts.py and features.py.
"""

from __future__ import annotations

import math

from salience.core.probes.calibration import calibrated
from salience.repl import constraints as repl_constraints
from salience.repl.readouts import concept_facts

__all__ = ["HELP", "concept_lines", "stream_ending", "token_line"]

HELP = f"""\
  TEXT [key=value ...]       chat mode: your turn in the conversation, the reply streams in; plain
                             completion: a prompt the model continues. Parameters may follow
                             (e.g. max_tokens=32 temperature=0 top_k=40 seed=1)
  /chat                      chat mode (the REPL starts in it where the model has a chat template)
  /raw                       plain completion (the conversation is kept for /chat)
  /system [TEXT|off]         show, set or drop the system message (sent first with every turn)
  /reset                     start the conversation over (the system message stays)
  /history                   the conversation so far
  /score PROMPT || CONT      logprob of each token of CONT after PROMPT
  /top K                     show the K most likely alternatives of each generated token (0: off)
  /readout [running|token]   show every token's concept probabilities (0.00-1.00), each concept at
                             its recommended layer (a calibrated concept set; docs/readouts.md):
                             running (the default), p that the text so far has the concept; token,
                             p that this token belongs to such a text. Position 0 is not read (-).
                             In chat mode the reply's tokens, then each concept's summary over them
  /readout raw [LAYER]       show every token's raw readouts at LAYER (default: the deepest read)
  /readout off               stop showing readouts
  /features [K] [SAE]        show every token's K most active SAE features (default 5) at the SAE's
                             layer, as #id:activation; SAE picks one where the server serves several
  /features off              stop showing features
{repl_constraints.HELP}
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
  /set key=value ...         change the defaults for every generation (max_tokens=256 in chat mode,
                             64 in plain completion; temperature=0)
  /info                      what the server serves
  /help, /quit               this text; leave (Ctrl-D works too)
  Ctrl-C stops the running generation."""


def token_line(payload: dict) -> str:
    """One generated or scored token: its id, text and logprob, then its top alternatives' probabilities."""
    alternatives = ", ".join(f"{t}:{math.exp(lp):.3f}" for t, lp in payload.get("top_logprobs", {}).items())
    line = f"{payload['token']:>7} {payload.get('text', '')!r:<16} logprob {payload['logprob']:9.4f}"
    return line + (f"  top {alternatives}" if alternatives else "")


def stream_ending(kind: str, payloads: list[dict], top: int) -> list[str]:
    """What follows a GENERATE or SCORE (`kind`) once it ends: each token's line for SCORE or under
    `/top`, SCORE's total logprob, the finish reason, then each monitor event."""
    scored = [p for p in payloads if "token" in p and not p.get("prompt")]
    lines = [token_line(payload) for payload in scored] if kind == "SCORE" or top else []
    if kind == "SCORE":
        lines.append(f"total logprob {sum(p['logprob'] for p in scored):.4f}")
    lines.append(f"\n[{payloads[-1]['finish_reason']}]")
    lines.extend(
        f"[monitor {event['monitor']} {event['action']}: {event['concept']} at layer {event['layer']}, "
        f"position {event['position']}: p={event['probability']:.3f}]"
        for event in (e for p in payloads for e in p.get("monitors", ()))
    )
    return lines


def concept_lines(manifest: dict | None) -> list[str]:
    """`/concepts`: the concept set's version and layers, then each concept, live or loaded, with its
    validation (MODEL_INFO's readout manifest; None: the server has none)."""
    if not manifest:
        return ["the server has no concept set"]
    lines = [
        f"concepts version {manifest['version']}, read at layers {manifest['layers'][0]}..{manifest['layers'][-1]}"
    ]
    for name, info in zip(manifest["concepts"], manifest["concept_info"], strict=True):
        kind = "live" if name in manifest["live"] else "loaded"
        facts = concept_facts(info) if calibrated(info) else "not validated (raw readouts only)"
        lines.append(f"  {name:<24} {kind:<7} {facts}")
    return lines
