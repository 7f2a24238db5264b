"""Generate the Python stubs for salience/proto/ (`make proto`); the stale-stub test calls it too.

Protos are compiled with the repository root as include path, so the generated modules import
each other as `salience.proto...` and live inside the package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "salience" / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto under out_dir; return their paths."""
    from grpc_tools import protoc

    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main([*args, *files]) != 0:
        raise SystemExit("protoc failed")
    outputs = []
    for f in files:
        stem = Path(f).with_suffix("")
        outputs += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", out_dir / f"{stem}_pb2_grpc.py"]
    return outputs


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT), file=sys.stderr)
