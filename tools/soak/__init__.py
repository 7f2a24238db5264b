"""Soak: hold a Salience server under mixed load with faults injected, and count what is lost.

    .venv/bin/python -m tools.soak [MODEL_DIR] [--seconds 600] [--connections 4] [--streams 4]
    .venv/bin/python -m tools.soak --url ws://127.0.0.1:8080/ --grpc 127.0.0.1:50051 --pid PID

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
its way (then the server must tell that CANCEL the stream is not running), within
CANCEL_SECONDS of the CANCEL going out. Each bad input must get its specific error, with a
request_id, on the channel the protocol names (a TOKEN error for its stream, or a MSG error),
and the connection must live on. Beside them --sessions workers drive gRPC sessions through
the thick client (turns with offset checks, a busy session, a cancelled turn, Fork, Dump,
Close, and their error codes), and one worker opens connections of its own: it drops them
while their streams run, or sends a frame past the frame limit (the server must close with
1009).

A stream with no terminal payload within --stream-timeout, a wrong count, an error on a valid
stream, or a connection the server closed counts as LOST; a bad input answered by another error,
or none, as WRONG. After the load /metrics must show nothing still running or held (streams,
connections, sessions, engine requests). Exit status 1 if anything was lost, wrong or held.

Modules: options (SoakOptions), tally (what is counted), server (start, attach, sample,
/metrics), connection (an LMTP client that routes every payload), state (the model and the
run's shared state), streams (valid streams and CANCEL), faults (bad inputs and dropped
connections), grpc_sessions (gRPC session workflows), run (scheduling and the run), report,
cli.
"""

from tools.soak.cli import main
from tools.soak.faults import BAD_INPUTS
from tools.soak.options import SoakOptions
from tools.soak.report import SoakReport
from tools.soak.run import run_soak
from tools.soak.streams import CANCEL_MOMENTS

__all__ = ["BAD_INPUTS", "CANCEL_MOMENTS", "SoakOptions", "SoakReport", "main", "run_soak"]
