from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SettleAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SETTLE_ACTION_UNSPECIFIED: _ClassVar[SettleAction]
    SETTLE_ACK: _ClassVar[SettleAction]
    SETTLE_NACK: _ClassVar[SettleAction]
    SETTLE_RENEW: _ClassVar[SettleAction]
SETTLE_ACTION_UNSPECIFIED: SettleAction
SETTLE_ACK: SettleAction
SETTLE_NACK: SettleAction
SETTLE_RENEW: SettleAction

class ErrorDetail(_message.Message):
    __slots__ = ("kind", "message", "reason", "retry_after_seconds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    reason: str
    retry_after_seconds: float
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., retry_after_seconds: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class Settings(_message.Message):
    __slots__ = ("lease_timeout_seconds", "max_retries", "retention_seconds", "dedup_window_seconds", "failure_queue")
    LEASE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_QUEUE_FIELD_NUMBER: _ClassVar[int]
    lease_timeout_seconds: float
    max_retries: int
    retention_seconds: float
    dedup_window_seconds: float
    failure_queue: str
    def __init__(self, lease_timeout_seconds: _Optional[float] = ..., max_retries: _Optional[int] = ..., retention_seconds: _Optional[float] = ..., dedup_window_seconds: _Optional[float] = ..., failure_queue: _Optional[str] = ...) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("visible", "leased", "delayed", "sent_total", "acked_total", "failed_total", "expired_total", "nacked_total", "lease_expired_total", "purged_total")
    VISIBLE_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    DELAYED_FIELD_NUMBER: _ClassVar[int]
    SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACKED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NACKED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PURGED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    visible: int
    leased: int
    delayed: int
    sent_total: int
    acked_total: int
    failed_total: int
    expired_total: int
    nacked_total: int
    lease_expired_total: int
    purged_total: int
    def __init__(self, visible: _Optional[int] = ..., leased: _Optional[int] = ..., delayed: _Optional[int] = ..., sent_total: _Optional[int] = ..., acked_total: _Optional[int] = ..., failed_total: _Optional[int] = ..., expired_total: _Optional[int] = ..., nacked_total: _Optional[int] = ..., lease_expired_total: _Optional[int] = ..., purged_total: _Optional[int] = ...) -> None: ...

class Queue(_message.Message):
    __slots__ = ("name", "settings", "stats")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: Settings
    stats: QueueStats
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ..., stats: _Optional[_Union[QueueStats, _Mapping]] = ...) -> None: ...

class PutQueueRequest(_message.Message):
    __slots__ = ("name", "settings")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: Settings
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[Settings, _Mapping]] = ...) -> None: ...

class PutQueueResponse(_message.Message):
    __slots__ = ("created", "queue")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    created: bool
    queue: Queue
    def __init__(self, created: _Optional[bool] = ..., queue: _Optional[_Union[Queue, _Mapping]] = ...) -> None: ...

class QueueRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListQueuesResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[Queue]
    def __init__(self, queues: _Optional[_Iterable[_Union[Queue, _Mapping]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RedriveResponse(_message.Message):
    __slots__ = ("moved",)
    MOVED_FIELD_NUMBER: _ClassVar[int]
    moved: int
    def __init__(self, moved: _Optional[int] = ...) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("purged",)
    PURGED_FIELD_NUMBER: _ClassVar[int]
    purged: int
    def __init__(self, purged: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("queue", "body", "delay_seconds", "dedup_key")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_KEY_FIELD_NUMBER: _ClassVar[int]
    queue: str
    body: bytes
    delay_seconds: float
    dedup_key: str
    def __init__(self, queue: _Optional[str] = ..., body: _Optional[bytes] = ..., delay_seconds: _Optional[float] = ..., dedup_key: _Optional[str] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("id", "duplicate", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    duplicate: bool
    error: ErrorDetail
    def __init__(self, id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...

class SendBatchRequest(_message.Message):
    __slots__ = ("entries", "queue", "bodies", "delay_seconds", "compact_run_ids")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    BODIES_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SendRequest]
    queue: str
    bodies: _containers.RepeatedScalarFieldContainer[bytes]
    delay_seconds: float
    compact_run_ids: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[SendRequest, _Mapping]]] = ..., queue: _Optional[str] = ..., bodies: _Optional[_Iterable[bytes]] = ..., delay_seconds: _Optional[float] = ..., compact_run_ids: _Optional[bool] = ...) -> None: ...

class SendBatchResponse(_message.Message):
    __slots__ = ("results", "run_ids", "run_id_prefix", "run_id_first", "run_count")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIRST_FIELD_NUMBER: _ClassVar[int]
    RUN_COUNT_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SendResponse]
    run_ids: _containers.RepeatedScalarFieldContainer[str]
    run_id_prefix: str
    run_id_first: int
    run_count: int
    def __init__(self, results: _Optional[_Iterable[_Union[SendResponse, _Mapping]]] = ..., run_ids: _Optional[_Iterable[str]] = ..., run_id_prefix: _Optional[str] = ..., run_id_first: _Optional[int] = ..., run_count: _Optional[int] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("queue", "wait_seconds", "max_messages", "receive_id", "caller_receive_id")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_RECEIVE_ID_FIELD_NUMBER: _ClassVar[int]
    queue: str
    wait_seconds: float
    max_messages: int
    receive_id: str
    caller_receive_id: str
    def __init__(self, queue: _Optional[str] = ..., wait_seconds: _Optional[float] = ..., max_messages: _Optional[int] = ..., receive_id: _Optional[str] = ..., caller_receive_id: _Optional[str] = ...) -> None: ...

class ReleaseReceiveRequest(_message.Message):
    __slots__ = ("queue", "receive_id")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_ID_FIELD_NUMBER: _ClassVar[int]
    queue: str
    receive_id: str
    def __init__(self, queue: _Optional[str] = ..., receive_id: _Optional[str] = ...) -> None: ...

class ReleaseReceiveResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("id", "body", "lease_token", "retry_count", "lease_expires_at", "queue", "lease_seconds_left")
    ID_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RETRY_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    id: str
    body: bytes
    lease_token: str
    retry_count: int
    lease_expires_at: str
    queue: str
    lease_seconds_left: float
    def __init__(self, id: _Optional[str] = ..., body: _Optional[bytes] = ..., lease_token: _Optional[str] = ..., retry_count: _Optional[int] = ..., lease_expires_at: _Optional[str] = ..., queue: _Optional[str] = ..., lease_seconds_left: _Optional[float] = ...) -> None: ...

class ReceiveResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Delivery]
    def __init__(self, messages: _Optional[_Iterable[_Union[Delivery, _Mapping]]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("token", "delay_seconds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    delay_seconds: float
    def __init__(self, token: _Optional[str] = ..., delay_seconds: _Optional[float] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("expires_at", "lease_seconds_left")
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    expires_at: str
    lease_seconds_left: float
    def __init__(self, expires_at: _Optional[str] = ..., lease_seconds_left: _Optional[float] = ...) -> None: ...

class SettleBatchRequest(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("token", "action", "delay_seconds")
        TOKEN_FIELD_NUMBER: _ClassVar[int]
        ACTION_FIELD_NUMBER: _ClassVar[int]
        DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
        token: str
        action: SettleAction
        delay_seconds: float
        def __init__(self, token: _Optional[str] = ..., action: _Optional[_Union[SettleAction, str]] = ..., delay_seconds: _Optional[float] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SettleBatchRequest.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[SettleBatchRequest.Item, _Mapping]]] = ...) -> None: ...

class SettleResult(_message.Message):
    __slots__ = ("error", "expires_at", "lease_seconds_left")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    error: ErrorDetail
    expires_at: str
    lease_seconds_left: float
    def __init__(self, error: _Optional[_Union[ErrorDetail, _Mapping]] = ..., expires_at: _Optional[str] = ..., lease_seconds_left: _Optional[float] = ...) -> None: ...

class SettleBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SettleResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SettleResult, _Mapping]]] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("queue", "scopes")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    queue: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queue: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("id", "queue", "scopes", "key")
    ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    id: str
    queue: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    key: str
    def __init__(self, id: _Optional[str] = ..., queue: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ..., key: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ...) -> None: ...

class DeleteKeyRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("id", "role", "address", "lsn", "match_lsn", "joining", "last_contact_ms", "reachable", "disk_low", "eager")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    MATCH_LSN_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTACT_MS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DISK_LOW_FIELD_NUMBER: _ClassVar[int]
    EAGER_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    address: str
    lsn: int
    match_lsn: int
    joining: bool
    last_contact_ms: float
    reachable: bool
    disk_low: bool
    eager: bool
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., lsn: _Optional[int] = ..., match_lsn: _Optional[int] = ..., joining: _Optional[bool] = ..., last_contact_ms: _Optional[float] = ..., reachable: _Optional[bool] = ..., disk_low: _Optional[bool] = ..., eager: _Optional[bool] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("node_id", "role", "epoch", "primary", "nodes", "commit_lsn", "applied_lsn", "cluster_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    APPLIED_LSN_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    epoch: int
    primary: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    commit_lsn: int
    applied_lsn: int
    cluster_id: str
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., primary: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., commit_lsn: _Optional[int] = ..., applied_lsn: _Optional[int] = ..., cluster_id: _Optional[str] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("id", "send_batch", "receive", "settle_batch")
    ID_FIELD_NUMBER: _ClassVar[int]
    SEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_FIELD_NUMBER: _ClassVar[int]
    SETTLE_BATCH_FIELD_NUMBER: _ClassVar[int]
    id: int
    send_batch: SendBatchRequest
    receive: ReceiveRequest
    settle_batch: SettleBatchRequest
    def __init__(self, id: _Optional[int] = ..., send_batch: _Optional[_Union[SendBatchRequest, _Mapping]] = ..., receive: _Optional[_Union[ReceiveRequest, _Mapping]] = ..., settle_batch: _Optional[_Union[SettleBatchRequest, _Mapping]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("id", "epoch", "send_batch", "receive", "settle_batch", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_FIELD_NUMBER: _ClassVar[int]
    SETTLE_BATCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    epoch: int
    send_batch: SendBatchResponse
    receive: ReceiveResponse
    settle_batch: SettleBatchResponse
    error: ErrorDetail
    def __init__(self, id: _Optional[int] = ..., epoch: _Optional[int] = ..., send_batch: _Optional[_Union[SendBatchResponse, _Mapping]] = ..., receive: _Optional[_Union[ReceiveResponse, _Mapping]] = ..., settle_batch: _Optional[_Union[SettleBatchResponse, _Mapping]] = ..., error: _Optional[_Union[ErrorDetail, _Mapping]] = ...) -> None: ...
