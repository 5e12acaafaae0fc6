from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_FREE: _ClassVar[SlotState]
    SLOT_STATE_PENDING: _ClassVar[SlotState]
    SLOT_STATE_PREFILL: _ClassVar[SlotState]
    SLOT_STATE_DECODE: _ClassVar[SlotState]
SLOT_STATE_FREE: SlotState
SLOT_STATE_PENDING: SlotState
SLOT_STATE_PREFILL: SlotState
SLOT_STATE_DECODE: SlotState

class SessionRequest(_message.Message):
    __slots__ = ("admit", "release")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    admit: AdmitRequest
    release: ReleaseRequest
    def __init__(self, admit: _Optional[_Union[AdmitRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "slot", "prompt_token_ids", "sampling", "grammar_key", "grammar", "tag", "grammar_backend")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KEY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BACKEND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    grammar_key: str
    grammar: _common_pb2.GrammarSpec
    tag: int
    grammar_backend: str
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., grammar_key: _Optional[str] = ..., grammar: _Optional[_Union[_common_pb2.GrammarSpec, _Mapping]] = ..., tag: _Optional[int] = ..., grammar_backend: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("admitted", "step")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    admitted: AdmitResult
    step: StepUpdate
    def __init__(self, admitted: _Optional[_Union[AdmitResult, _Mapping]] = ..., step: _Optional[_Union[StepUpdate, _Mapping]] = ...) -> None: ...

class AdmitResult(_message.Message):
    __slots__ = ("tag", "code", "message", "slot", "rank")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    tag: int
    code: int
    message: str
    slot: int
    rank: int
    def __init__(self, tag: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., slot: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class StepUpdate(_message.Message):
    __slots__ = ("step", "rows")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rows: _containers.RepeatedCompositeFieldContainer[RowUpdate]
    def __init__(self, step: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowUpdate, _Mapping]]] = ...) -> None: ...

class RowUpdate(_message.Message):
    __slots__ = ("tag", "token_ids", "finished", "logprobs")
    TAG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: Finished
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, tag: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "message", "usage", "start_seconds", "first_token_seconds", "code")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    message: str
    usage: _common_pb2.Usage
    start_seconds: float
    first_token_seconds: float
    code: int
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., message: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., start_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., code: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("slot", "request_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("was_running",)
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    def __init__(self, was_running: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("slot", "state", "request_id", "guided", "context_tokens")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    state: SlotState
    request_id: str
    guided: bool
    context_tokens: int
    def __init__(self, slot: _Optional[int] = ..., state: _Optional[_Union[SlotState, str]] = ..., request_id: _Optional[str] = ..., guided: _Optional[bool] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "tp_size", "num_slots", "max_model_len", "model", "vocab_fingerprint", "vocab_size", "model_vocab_size", "slots", "device", "dtype", "serving")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tp_size: int
    num_slots: int
    max_model_len: int
    model: str
    vocab_fingerprint: str
    vocab_size: int
    model_vocab_size: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    device: str
    dtype: str
    serving: bool
    def __init__(self, rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., model_vocab_size: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., serving: _Optional[bool] = ...) -> None: ...
