"""A minute of the soak (tools/soak/) against the tiny model in a `salience serve` process.

Mixed valid streams (LMTP and gRPC sessions) beside every kind of bad input and CANCEL, and
clients that drop their connections mid-stream: nothing may be lost, every bad input must get
its specific error, and afterwards the server must hold nothing (streams, connections,
sessions, engine requests). Slow: skip it with `-m "not slow"`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from salience.core.concepts import ConceptSet
from tools.soak import BAD_INPUTS, CANCEL_MOMENTS, SoakOptions, run_soak

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
