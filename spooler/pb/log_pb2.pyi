from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SettleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SETTLE_UNSPECIFIED: _ClassVar[SettleKind]
    ACK: _ClassVar[SettleKind]
    NACK: _ClassVar[SettleKind]
    EXPIRE: _ClassVar[SettleKind]
SETTLE_UNSPECIFIED: SettleKind
ACK: SettleKind
NACK: SettleKind
EXPIRE: SettleKind

class QueueSettings(_message.Message):
    __slots__ = ("lease_timeout_us", "max_retries", "retention_us", "dedup_window_us", "failure_queue")
    LEASE_TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_US_FIELD_NUMBER: _ClassVar[int]
    DEDUP_WINDOW_US_FIELD_NUMBER: _ClassVar[int]
    FAILURE_QUEUE_FIELD_NUMBER: _ClassVar[int]
    lease_timeout_us: int
    max_retries: int
    retention_us: int
    dedup_window_us: int
    failure_queue: str
    def __init__(self, lease_timeout_us: _Optional[int] = ..., max_retries: _Optional[int] = ..., retention_us: _Optional[int] = ..., dedup_window_us: _Optional[int] = ..., failure_queue: _Optional[str] = ...) -> None: ...

class EpochBegin(_message.Message):
    __slots__ = ("node_id", "cluster_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cluster_id: str
    def __init__(self, node_id: _Optional[str] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class QueuePut(_message.Message):
    __slots__ = ("name", "settings")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: QueueSettings
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[QueueSettings, _Mapping]] = ...) -> None: ...

class QueueDelete(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SendEntry(_message.Message):
    __slots__ = ("queue", "id", "body", "delay_us", "dedup_key", "repeat")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    DELAY_US_FIELD_NUMBER: _ClassVar[int]
    DEDUP_KEY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    queue: str
    id: str
    body: bytes
    delay_us: int
    dedup_key: str
    repeat: bool
    def __init__(self, queue: _Optional[str] = ..., id: _Optional[str] = ..., body: _Optional[bytes] = ..., delay_us: _Optional[int] = ..., dedup_key: _Optional[str] = ..., repeat: _Optional[bool] = ...) -> None: ...

class Send(_message.Message):
    __slots__ = ("entries", "run_queue", "run_id_prefix", "run_id_first", "run_delay_us", "run_bodies")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RUN_QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIRST_FIELD_NUMBER: _ClassVar[int]
    RUN_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    RUN_BODIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SendEntry]
    run_queue: str
    run_id_prefix: str
    run_id_first: int
    run_delay_us: int
    run_bodies: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, entries: _Optional[_Iterable[_Union[SendEntry, _Mapping]]] = ..., run_queue: _Optional[str] = ..., run_id_prefix: _Optional[str] = ..., run_id_first: _Optional[int] = ..., run_delay_us: _Optional[int] = ..., run_bodies: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SettleEntry(_message.Message):
    __slots__ = ("kind", "queue", "id", "delay_us", "past_retries")
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DELAY_US_FIELD_NUMBER: _ClassVar[int]
    PAST_RETRIES_FIELD_NUMBER: _ClassVar[int]
    kind: SettleKind
    queue: str
    id: str
    delay_us: int
    past_retries: bool
    def __init__(self, kind: _Optional[_Union[SettleKind, str]] = ..., queue: _Optional[str] = ..., id: _Optional[str] = ..., delay_us: _Optional[int] = ..., past_retries: _Optional[bool] = ...) -> None: ...

class Settle(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SettleEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SettleEntry, _Mapping]]] = ...) -> None: ...

class Drop(_message.Message):
    __slots__ = ("queue", "ids")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    queue: str
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queue: _Optional[str] = ..., ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Redrive(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    def __init__(self, queue: _Optional[str] = ...) -> None: ...

class Purge(_message.Message):
    __slots__ = ("queue",)
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    def __init__(self, queue: _Optional[str] = ...) -> None: ...

class KeyPut(_message.Message):
    __slots__ = ("id", "secret_sha256", "queue", "scopes")
    ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_SHA256_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    id: str
    secret_sha256: bytes
    queue: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., secret_sha256: _Optional[bytes] = ..., queue: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyDelete(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("epoch", "lsn", "ts_us", "epoch_begin", "queue_put", "queue_delete", "send", "settle", "drop", "redrive", "key_put", "key_delete", "send_compact", "purge")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    TS_US_FIELD_NUMBER: _ClassVar[int]
    EPOCH_BEGIN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_PUT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DELETE_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    SETTLE_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    REDRIVE_FIELD_NUMBER: _ClassVar[int]
    KEY_PUT_FIELD_NUMBER: _ClassVar[int]
    KEY_DELETE_FIELD_NUMBER: _ClassVar[int]
    SEND_COMPACT_FIELD_NUMBER: _ClassVar[int]
    PURGE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lsn: int
    ts_us: int
    epoch_begin: EpochBegin
    queue_put: QueuePut
    queue_delete: QueueDelete
    send: Send
    settle: Settle
    drop: Drop
    redrive: Redrive
    key_put: KeyPut
    key_delete: KeyDelete
    send_compact: Send
    purge: Purge
    def __init__(self, epoch: _Optional[int] = ..., lsn: _Optional[int] = ..., ts_us: _Optional[int] = ..., epoch_begin: _Optional[_Union[EpochBegin, _Mapping]] = ..., queue_put: _Optional[_Union[QueuePut, _Mapping]] = ..., queue_delete: _Optional[_Union[QueueDelete, _Mapping]] = ..., send: _Optional[_Union[Send, _Mapping]] = ..., settle: _Optional[_Union[Settle, _Mapping]] = ..., drop: _Optional[_Union[Drop, _Mapping]] = ..., redrive: _Optional[_Union[Redrive, _Mapping]] = ..., key_put: _Optional[_Union[KeyPut, _Mapping]] = ..., key_delete: _Optional[_Union[KeyDelete, _Mapping]] = ..., send_compact: _Optional[_Union[Send, _Mapping]] = ..., purge: _Optional[_Union[Purge, _Mapping]] = ...) -> None: ...
