"""Client side of GrammarService.Fetch: reassemble and check a streamed compiled grammar."""

from __future__ import annotations

import hashlib

from protos import common_pb2, grammar_pb2, grammar_pb2_grpc
from protos.rpc import FailedPrecondition


def fetch_grammar(stub: grammar_pb2_grpc.GrammarServiceStub, key: str, *,
                  spec: common_pb2.GrammarSpec | None = None,
                  expected_fingerprint: str | None = None,
                  timeout: float | None = None) -> tuple[str, bytes]:
    """(backend, payload): the serialized compiled grammar of `key` and the backend it is for
    (for grammar_service.backends' `deserialize`).

    Passes `spec` so the service can recompile an evicted key. Raises grpc.RpcError from
    the call, and FailedPrecondition when the payload's size or sha256 does not match the
    first chunk, or its vocabulary fingerprint is not `expected_fingerprint` (when given).
    """
    request = grammar_pb2.FetchRequest(key=key)
    if spec is not None:
        request.spec.CopyFrom(spec)
    parts, first = [], None
    for chunk in stub.Fetch(request, timeout=timeout):
        first = first or chunk
        parts.append(chunk.data)
    if first is None:
        raise FailedPrecondition("empty Fetch stream", field="key")
    data = b"".join(parts)
    if len(data) != first.total_bytes or hashlib.sha256(data).hexdigest() != first.sha256:
        raise FailedPrecondition("fetched grammar does not match its size or sha256",
                                 field="key")
    if expected_fingerprint is not None and first.vocab_fingerprint != expected_fingerprint:
        raise FailedPrecondition(
            f"grammar compiled for vocabulary {first.vocab_fingerprint[:12]}, not "
            f"{expected_fingerprint[:12]}", field="key")
    return first.backend or "xgrammar", data
