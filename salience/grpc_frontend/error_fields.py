"""The request field a gRPC error names, read on the client from the rich error status_codes.py
sends (docs/grpc.md). Apart from status_codes, which needs the server's libraries (metrics)."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

__all__ = ["DETAILS", "field_of"]

DETAILS = "grpc-status-details-bin"  # the trailer gRPC's rich error model travels in


def field_of(error: grpc.RpcError) -> str | None:
    """The request field an error is about (`interventions[0].value`), from the BadRequest field
    violation in its DETAILS trailer; None for an error about no one field."""
    trailers = error.trailing_metadata() if isinstance(error, grpc.Call | grpc.aio.AioRpcError) else None
    raw = next((value for key, value in trailers or () if key == DETAILS), None)
    if raw is None:
        return None
    for detail in status_pb2.Status.FromString(raw).details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad) and bad.field_violations:
            return bad.field_violations[0].field
    return None
