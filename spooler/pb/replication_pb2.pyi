from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Entry(_message.Message):
    __slots__ = ("lsn", "epoch", "crc", "rec")
    LSN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CRC_FIELD_NUMBER: _ClassVar[int]
    REC_FIELD_NUMBER: _ClassVar[int]
    lsn: int
    epoch: int
    crc: int
    rec: bytes
    def __init__(self, lsn: _Optional[int] = ..., epoch: _Optional[int] = ..., crc: _Optional[int] = ..., rec: _Optional[bytes] = ...) -> None: ...

class AppendFrame(_message.Message):
    __slots__ = ("epoch", "primary", "prev_lsn", "prev_epoch", "prev_crc", "entries", "commit_lsn", "sent_us", "primary_commit_lsn", "lease_us", "contact_acks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    PREV_LSN_FIELD_NUMBER: _ClassVar[int]
    PREV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREV_CRC_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    SENT_US_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_COMMIT_LSN_FIELD_NUMBER: _ClassVar[int]
    LEASE_US_FIELD_NUMBER: _ClassVar[int]
    CONTACT_ACKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    primary: str
    prev_lsn: int
    prev_epoch: int
    prev_crc: int
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    commit_lsn: int
    sent_us: int
    primary_commit_lsn: int
    lease_us: int
    contact_acks: bool
    def __init__(self, epoch: _Optional[int] = ..., primary: _Optional[str] = ..., prev_lsn: _Optional[int] = ..., prev_epoch: _Optional[int] = ..., prev_crc: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., commit_lsn: _Optional[int] = ..., sent_us: _Optional[int] = ..., primary_commit_lsn: _Optional[int] = ..., lease_us: _Optional[int] = ..., contact_acks: _Optional[bool] = ...) -> None: ...

class AppendAck(_message.Message):
    __slots__ = ("epoch", "sender", "ok", "match_lsn", "sent_us", "releases", "joining", "contact", "disk_low", "log_format")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MATCH_LSN_FIELD_NUMBER: _ClassVar[int]
    SENT_US_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    CONTACT_FIELD_NUMBER: _ClassVar[int]
    DISK_LOW_FIELD_NUMBER: _ClassVar[int]
    LOG_FORMAT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    sender: str
    ok: bool
    match_lsn: int
    sent_us: int
    releases: _containers.RepeatedCompositeFieldContainer[PendingRelease]
    joining: bool
    contact: bool
    disk_low: bool
    log_format: int
    def __init__(self, epoch: _Optional[int] = ..., sender: _Optional[str] = ..., ok: _Optional[bool] = ..., match_lsn: _Optional[int] = ..., sent_us: _Optional[int] = ..., releases: _Optional[_Iterable[_Union[PendingRelease, _Mapping]]] = ..., joining: _Optional[bool] = ..., contact: _Optional[bool] = ..., disk_low: _Optional[bool] = ..., log_format: _Optional[int] = ...) -> None: ...

class PendingRelease(_message.Message):
    __slots__ = ("queue", "receive_id", "authorization")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    queue: str
    receive_id: str
    authorization: str
    def __init__(self, queue: _Optional[str] = ..., receive_id: _Optional[str] = ..., authorization: _Optional[str] = ...) -> None: ...

class VoteRequest(_message.Message):
    __slots__ = ("epoch", "candidate", "last_epoch", "last_lsn", "pre", "transfer", "lease_us")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_LSN_FIELD_NUMBER: _ClassVar[int]
    PRE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LEASE_US_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    candidate: str
    last_epoch: int
    last_lsn: int
    pre: bool
    transfer: bool
    lease_us: int
    def __init__(self, epoch: _Optional[int] = ..., candidate: _Optional[str] = ..., last_epoch: _Optional[int] = ..., last_lsn: _Optional[int] = ..., pre: _Optional[bool] = ..., transfer: _Optional[bool] = ..., lease_us: _Optional[int] = ...) -> None: ...

class VoteResponse(_message.Message):
    __slots__ = ("epoch", "sender", "granted", "pre", "since_contact_us", "since_vote_us", "lease_us", "vote_lease_us", "voter_epoch")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    PRE_FIELD_NUMBER: _ClassVar[int]
    SINCE_CONTACT_US_FIELD_NUMBER: _ClassVar[int]
    SINCE_VOTE_US_FIELD_NUMBER: _ClassVar[int]
    LEASE_US_FIELD_NUMBER: _ClassVar[int]
    VOTE_LEASE_US_FIELD_NUMBER: _ClassVar[int]
    VOTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    sender: str
    granted: bool
    pre: bool
    since_contact_us: int
    since_vote_us: int
    lease_us: int
    vote_lease_us: int
    voter_epoch: int
    def __init__(self, epoch: _Optional[int] = ..., sender: _Optional[str] = ..., granted: _Optional[bool] = ..., pre: _Optional[bool] = ..., since_contact_us: _Optional[int] = ..., since_vote_us: _Optional[int] = ..., lease_us: _Optional[int] = ..., vote_lease_us: _Optional[int] = ..., voter_epoch: _Optional[int] = ...) -> None: ...

class TimeoutNowRequest(_message.Message):
    __slots__ = ("epoch", "primary")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    primary: str
    def __init__(self, epoch: _Optional[int] = ..., primary: _Optional[str] = ...) -> None: ...

class ReplEmpty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("epoch", "primary", "data", "last", "sha256")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    primary: str
    data: bytes
    last: bool
    sha256: bytes
    def __init__(self, epoch: _Optional[int] = ..., primary: _Optional[str] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class SnapshotAck(_message.Message):
    __slots__ = ("epoch", "ok", "last_lsn")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    LAST_LSN_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ok: bool
    last_lsn: int
    def __init__(self, epoch: _Optional[int] = ..., ok: _Optional[bool] = ..., last_lsn: _Optional[int] = ...) -> None: ...
