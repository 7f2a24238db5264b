"""A minute of the soak (tools/soak/) against the tiny model in a `salience serve` process.

Mixed valid streams (LMTP and gRPC sessions) beside every kind of bad input and CANCEL, and
clients that drop their connections mid-stream: nothing may be lost, every bad input must get
its specific error, and afterwards the server must hold nothing (streams, connections,
sessions, engine requests). Slow: skip it with `-m "not slow"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from salience.core.probes.concepts import ConceptSet
from tools.soak import BAD_INPUTS, CANCEL_MOMENTS, SoakOptions, run_soak
from tools.soak.connection import Received
from tools.soak.streams import CANCEL_SECONDS, check_cancelled

pytestmark = pytest.mark.slow

# Beside the LMTP bad inputs: a frame past --lmtp-max-frame-bytes and the gRPC session faults.
OTHER_FAULTS = {
    "duplicate-stream-id",
    "oversized-frame",
    "grpc-offset-drift",
    "grpc-closed-session",
    "grpc-unknown-session",
    "grpc-session-busy",
}


async def test_a_minute_of_load_and_faults_loses_nothing(
    tiny_model: Path, tiny_concepts: ConceptSet, tmp_path: Path
) -> None:
    concepts = tmp_path / "concepts.safetensors"
    tiny_concepts.save(concepts)
    options = SoakOptions(
        model=tiny_model,
        seconds=60,
        connections=3,
        streams=4,
        sessions=2,
        server_args=("--concepts", str(concepts), "--kv-cache-gib", "1", "--max-model-len", "1024"),
        log=tmp_path / "server.log",
    )
    report = await run_soak(options)
    print(report.render())

    assert not report.failures(), report.render()
    # Every kind came up, so "nothing lost, nothing wrong" speaks for each of them.
    kinds = {"generate/greedy", "generate/sampled", "generate/text", "generate/readout", "generate/carrier"}
    kinds |= {"score", "grpc/session", "disconnect"} | {f"cancel/{moment}" for moment in CANCEL_MOMENTS}
    assert {kind for kind, tally in report.tally.streams.items() if tally.completed} >= kinds
    answered = {kind for kind, tally in report.tally.faults.items() if tally.specific}
    assert answered >= {*BAD_INPUTS, *OTHER_FAULTS}
    assert report.tally.ttft_idle and report.tally.ttft_loaded
    assert report.samples, "the server's RSS and fds were sampled"


def ended(finish: str, tokens: int, at: float) -> Received:
    """A stream that got `tokens` tokens, one every 10 ms from t=0, and its end at `at`."""
    arrivals = [i / 100 for i in range(tokens)]
    return Received(tokens=[{"token": 1}] * tokens, arrivals=arrivals, finish=finish, finished_at=at)


def test_the_cancel_judge_goes_by_the_servers_answer_and_time_not_token_arrivals() -> None:
    # Forty tokens read after the CANCEL went out at t=0.1: a slow reader, not a fault.
    assert check_cancelled(ended("cancelled", 50, 0.5), 64, sent_at=0.1) is None
    assert check_cancelled(ended("length", 64, 0.7), 64, sent_at=0.1) is None  # then "not running"
    late = check_cancelled(ended("cancelled", 50, 0.2 + CANCEL_SECONDS), 64, sent_at=0.1)
    assert late is not None and "s after the CANCEL went out" in late
    assert check_cancelled(ended("length", 20, 0.3), 64, sent_at=0.1) is not None
    assert check_cancelled(ended("stop", 64, 0.3), 64, sent_at=0.1) is not None
    assert check_cancelled(ended("cancelled", 5, 0.3), 64, sent_at=None) is not None
