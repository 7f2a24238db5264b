"""The wire contract: checked-in stubs are current, and match the seed's proto exactly."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from tests.grpc.conftest import Served
from tests.grpc.seed_proto import reflow, seed_text
from tests.reference import Reference
from tools.gen_proto import ROOT, generate, proto_files


def test_checked_in_stubs_are_current(tmp_path: Path) -> None:
    for fresh in generate(tmp_path):
        checked_in = ROOT / fresh.relative_to(tmp_path)
        assert checked_in.read_bytes() == fresh.read_bytes(), f"{checked_in} is stale: run `make proto`"


def compile_seed(out: Path) -> Path:
    """The seed's proto as a file, compiled to Python stubs in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "salience.proto").write_text(reflow(seed_text()))
    args = [f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", f"--descriptor_set_out={out / 'set.pb'}"]
    assert protoc.main(["protoc", *args, str(out / "salience.proto")]) == 0
    return out


def descriptor(set_path: Path) -> descriptor_pb2.FileDescriptorProto:
    files = descriptor_pb2.FileDescriptorSet.FromString(set_path.read_bytes()).file
    (only,) = files
    only.ClearField("name")  # the file's path differs; everything on the wire must not
    only.ClearField("source_code_info")
    return only


def test_project_proto_is_the_seeds_contract(tmp_path: Path) -> None:
    seed = descriptor(compile_seed(tmp_path / "seed") / "set.pb")
    (project_proto,) = [p for p in proto_files() if p.name == "salience.proto"]
    ours_set = tmp_path / "ours.pb"
    assert protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={ours_set}", str(project_proto)]) == 0
    ours = descriptor(ours_set)
    assert ours == seed
    assert [m.name for m in seed.message_type][:3] == [
        "OpenSessionRequest",
        "OpenSessionResponse",
        "CloseSessionRequest",
    ]


async def test_client_built_from_the_seed_text_round_trips(
    served: Served, tmp_path: Path, tiny_reference: Reference
) -> None:
    stubs = compile_seed(tmp_path / "seed")
    prompt = [0, *range(300, 330)]
    script = Path(__file__).with_name("seed_client.py")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        str(stubs),
        served.target,
        json.dumps(prompt),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    got = json.loads(out)
    greedy = tiny_reference.greedy(prompt, 4)
    assert got["max_model_len"] == 1024
    assert [(t["position"], t["is_prefill"]) for t in got["tokens"]] == [
        (30, True),
        (31, False),
        (32, False),
        (33, False),
        (34, False),
    ]
    assert [t["id"] for t in got["tokens"][1:]] == greedy
    assert all(t["logprob"] is not None and len(t["alternatives"]) == 2 for t in got["tokens"])
    assert [len(t["readout"]) > 0 for t in got["tokens"]] == [True, True, False, False, False]
    assert got["done"] == [31, 4, 35, "FINISH_REASON_LENGTH"]
    assert got["dump"] == prompt + greedy and got["forked"] == prompt
    assert got["concepts"] == ["alpha", "beta", "gamma", "delta", "epsilon"]
