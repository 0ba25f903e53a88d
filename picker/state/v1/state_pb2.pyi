from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateBatch(_message.Message):
    __slots__ = ("origin", "sequence", "index_inserts", "in_flight", "ttft_observations", "prefills_queued")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INDEX_INSERTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TTFT_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    origin: str
    sequence: int
    index_inserts: _containers.RepeatedCompositeFieldContainer[IndexInsert]
    in_flight: InFlightLoad
    ttft_observations: _containers.RepeatedCompositeFieldContainer[TtftObservation]
    prefills_queued: _containers.RepeatedCompositeFieldContainer[PrefillQueued]
    def __init__(self, origin: _Optional[str] = ..., sequence: _Optional[int] = ..., index_inserts: _Optional[_Iterable[_Union[IndexInsert, _Mapping]]] = ..., in_flight: _Optional[_Union[InFlightLoad, _Mapping]] = ..., ttft_observations: _Optional[_Iterable[_Union[TtftObservation, _Mapping]]] = ..., prefills_queued: _Optional[_Iterable[_Union[PrefillQueued, _Mapping]]] = ...) -> None: ...

class IndexInsert(_message.Message):
    __slots__ = ("index", "endpoint", "block_hashes", "capacity", "count_reuse")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    COUNT_REUSE_FIELD_NUMBER: _ClassVar[int]
    index: str
    endpoint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    capacity: int
    count_reuse: bool
    def __init__(self, index: _Optional[str] = ..., endpoint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., capacity: _Optional[int] = ..., count_reuse: _Optional[bool] = ...) -> None: ...

class InFlightLoad(_message.Message):
    __slots__ = ("endpoints", "expires_ms")
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointInFlight]
    expires_ms: int
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointInFlight, _Mapping]]] = ..., expires_ms: _Optional[int] = ...) -> None: ...

class EndpointInFlight(_message.Message):
    __slots__ = ("endpoint", "requests", "tokens")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    requests: int
    tokens: int
    def __init__(self, endpoint: _Optional[str] = ..., requests: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class TtftObservation(_message.Message):
    __slots__ = ("endpoint", "ttft_seconds", "prompt_tokens", "cached_tokens", "work_ahead_tokens", "remote_prefill")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORK_AHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    ttft_seconds: float
    prompt_tokens: int
    cached_tokens: int
    work_ahead_tokens: float
    remote_prefill: bool
    def __init__(self, endpoint: _Optional[str] = ..., ttft_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., work_ahead_tokens: _Optional[float] = ..., remote_prefill: _Optional[bool] = ...) -> None: ...

class PrefillQueued(_message.Message):
    __slots__ = ("endpoint", "tokens")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    tokens: float
    def __init__(self, endpoint: _Optional[str] = ..., tokens: _Optional[float] = ...) -> None: ...
