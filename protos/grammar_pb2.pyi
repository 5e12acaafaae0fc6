from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompileRequest(_message.Message):
    __slots__ = ("spec", "client")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.GrammarSpec
    client: str
    def __init__(self, spec: _Optional[_Union[_common_pb2.GrammarSpec, _Mapping]] = ..., client: _Optional[str] = ...) -> None: ...

class GrammarRef(_message.Message):
    __slots__ = ("key", "kind", "compile_seconds", "cached", "unenforced_keywords", "vocab_fingerprint", "serialized_bytes", "backend", "backend_reason")
    KEY_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    UNENFORCED_KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REASON_FIELD_NUMBER: _ClassVar[int]
    key: str
    kind: str
    compile_seconds: float
    cached: bool
    unenforced_keywords: _containers.RepeatedScalarFieldContainer[str]
    vocab_fingerprint: str
    serialized_bytes: int
    backend: str
    backend_reason: str
    def __init__(self, key: _Optional[str] = ..., kind: _Optional[str] = ..., compile_seconds: _Optional[float] = ..., cached: _Optional[bool] = ..., unenforced_keywords: _Optional[_Iterable[str]] = ..., vocab_fingerprint: _Optional[str] = ..., serialized_bytes: _Optional[int] = ..., backend: _Optional[str] = ..., backend_reason: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("key", "spec")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    key: str
    spec: _common_pb2.GrammarSpec
    def __init__(self, key: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.GrammarSpec, _Mapping]] = ...) -> None: ...

class GrammarChunk(_message.Message):
    __slots__ = ("data", "total_bytes", "vocab_fingerprint", "sha256", "backend")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    vocab_fingerprint: str
    sha256: str
    backend: str
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., sha256: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GrammarStats(_message.Message):
    __slots__ = ("entries", "bytes", "capacity_bytes", "hits", "misses", "evictions", "compiles_in_flight", "vocab_fingerprint", "xgrammar_version", "llguidance_version")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COMPILES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    XGRAMMAR_VERSION_FIELD_NUMBER: _ClassVar[int]
    LLGUIDANCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    compiles_in_flight: int
    vocab_fingerprint: str
    xgrammar_version: str
    llguidance_version: str
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., compiles_in_flight: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ..., xgrammar_version: _Optional[str] = ..., llguidance_version: _Optional[str] = ...) -> None: ...
