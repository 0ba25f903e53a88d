from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateBatch(_message.Message):
    __slots__ = ("origin", "sequence", "index_inserts")
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INDEX_INSERTS_FIELD_NUMBER: _ClassVar[int]
    origin: str
    sequence: int
    index_inserts: _containers.RepeatedCompositeFieldContainer[IndexInsert]
    def __init__(self, origin: _Optional[str] = ..., sequence: _Optional[int] = ..., index_inserts: _Optional[_Iterable[_Union[IndexInsert, _Mapping]]] = ...) -> None: ...

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
