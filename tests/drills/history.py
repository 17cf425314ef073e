"""The operation history a failover drill records, and its JSON-lines file.

Every client call is two events, Jepsen-style: an ``invoke`` before the request leaves
and one completion (``ok``, ``fail`` or ``unknown``) when the outcome is known, paired
by ``op``. A call whose process died in between has no completion; the checker reads
that as ``unknown``. Times are ``time.monotonic()`` seconds, one clock for every
process on the machine (CLOCK_MONOTONIC is system-wide on Linux), so histories of
several recorder processes can be merged and sorted by ``t``.

Event shapes (fields beyond these are kept and ignored by the checker)::

    {"t", "process", "type": "invoke", "f": "send", "op", "queue", "body"}
    {"t", "process", "type": "ok",     "f": "send", "op", "id", "duplicate"}
    {"t", "process", "type": "fail",   "f": "send", "op", "error": "unavailable"}
    {"t", "process", "type": "unknown","f": "send", "op", "error": "timeout"}
    {"t", "process", "type": "invoke", "f": "receive", "op", "queue"}
    {"t", "process", "type": "ok", "f": "receive", "op", "empty": true}
    {"t", "process", "type": "ok", "f": "receive", "op", "id", "body", "token", "retry",
         "epoch", "expires_at", "queue", ["drain": true]}
         (``epoch``: of the primary that granted the lease, as its token says; the drill
         also keeps the answering node's Spooler-Epoch as ``node_epoch``)
    {"t", "process", "type": "invoke", "f": "ack"|"nack"|"renew", "op", "id", "token", "epoch"}
    {"t", "process", "type": "ok", "f": "renew", "op", "expires_at"}
    {"t", "process", "type": "invoke", "f": "purge", "op", "queue"}
    {"t", "process", "type": "ok", "f": "purge", "op", "purged": 12}
    {"t", "process", "type": "fail", "f": "ack", "op", "error": "stale_lease", "reason": "expired"}
    {"t", "type": "nemesis", "f": "kill"|"stop"|"cont"|"partition"|"heal"|"restart"|"power_loss",
         "node": "n1"}
    {"t", "type": "nemesis", "f": "partition", "node", "role", "epoch", "kind": "isolate"|
         "blackhole"|"one_way_out"|"one_way_in"|"one_way_out_bytes"|"one_way_in_bytes",
         "mode", "direction", "level", "hold_s"}   (then "heal" with the links, "rejoined")
    {"t", "type": "role", "node": "n2", "role": "primary", "epoch": 7}
    {"type": "final", "expired_ids": [...], "failed_queue_ids": [...],
         "node_states": {"n1": "<digest>"}, "integrity": {"n1": "ok"}}

Recording rules the checker relies on:

- ``fail`` only for an error that proves the call had no effect (``unavailable``,
  ``stale_lease``, ``invalid_argument``, ...: ``checker.DEFINITE_FAILURE_KINDS``).
  A timeout, a dropped connection, gRPC DEADLINE_EXCEEDED / UNAVAILABLE after the
  request left, or ``operation_unconfirmed`` is ``unknown`` (a ``fail`` carrying such a
  kind is read as unknown too).
- ``expires_at`` is in the ``t`` clock: convert the server's RFC 3339 value with
  :func:`expires_at_monotonic`.
- Send bodies are unique per send invoke (a retry of the same logical send may reuse
  its body; the checker then treats the body as sent if any attempt may have stored it).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from datetime import datetime
from typing import Any, Callable, Iterable, Iterator

COMPLETIONS = ("ok", "fail", "unknown")
CLIENT_FUNCTIONS = ("send", "receive", "ack", "nack", "renew", "purge")


def wall_to_monotonic(wall_s: float) -> float:
    """A wall-clock instant (seconds since the Unix epoch) in the ``time.monotonic()`` clock."""
    return wall_s + (time.monotonic() - time.time())


def expires_at_monotonic(rfc3339: str) -> float:
    """The server's ``Spooler-Lease-Expires-At`` / ``expiresAt`` in the history's clock."""
    return wall_to_monotonic(datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp())


class Op:
    """Handle of one invoked call; complete it exactly once with ok / fail / unknown.

    Used as a context manager, an exception escaping the block records ``unknown``
    (the outcome of an interrupted call is not known) and propagates.
    """

    __slots__ = ("_history", "process", "f", "op", "invoke_event", "completion")

    def __init__(self, history: "History", process: str, f: str, op: int, invoke_event: dict):
        self._history = history
        self.process, self.f, self.op = process, f, op
        self.invoke_event = invoke_event
        self.completion: dict | None = None

    def _complete(self, typ: str, fields: dict) -> dict:
        if self.completion is not None:
            raise RuntimeError(f"op {self.op} ({self.f}) already completed as {self.completion['type']}")
        ev = {"process": self.process, "type": typ, "f": self.f, "op": self.op}
        ev.update(fields)
        self.completion = self._history.append(ev)
        return self.completion

    def ok(self, **fields: Any) -> dict:
        return self._complete("ok", fields)

    def fail(self, **fields: Any) -> dict:
        return self._complete("fail", fields)

    def unknown(self, **fields: Any) -> dict:
        return self._complete("unknown", fields)

    @property
    def done(self) -> bool:
        return self.completion is not None

    def __enter__(self) -> "Op":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and self.completion is None:
            self.unknown(error=type(exc).__name__, message=str(exc)[:200])
        return False


class History:
    """Thread-safe, append-only list of events. ``t`` is stamped under the lock, so the
    list is in ``t`` order and an invoke always precedes its completion."""

    def __init__(self, events: Iterable[dict] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] | None = None):
        """``wall``: stamped as ``w`` beside each ``t`` (time.time with the default clock):
        the checker sees from it where the wall clock moved against ``t`` (a paused
        virtual machine, a clock step), since lease ends are the primary's wall time."""
        self._lock = threading.Lock()
        self._clock = clock
        self._wall = wall if wall is not None or clock is not time.monotonic else time.time
        self._events: list[dict] = list(events) if events is not None else []
        start = max((e["op"] for e in self._events if isinstance(e.get("op"), int)), default=0)
        self._ops = itertools.count(start + 1)

    # -- recording -------------------------------------------------------------------
    def append(self, event: dict) -> dict:
        """Store ``event`` (a copy), stamping ``t`` unless given or a ``final`` event."""
        ev = dict(event)
        with self._lock:
            if "t" not in ev and ev.get("type") != "final":
                ev["t"] = self._clock()
                if self._wall is not None:
                    ev["w"] = self._wall()
            self._events.append(ev)
        return ev

    def invoke(self, process: str, f: str, **fields: Any) -> Op:
        if f not in CLIENT_FUNCTIONS:
            raise ValueError(f"unknown client function {f!r}")
        with self._lock:
            op = next(self._ops)
            ev = {"t": self._clock(), "process": process, "type": "invoke", "f": f, "op": op}
            if self._wall is not None:
                ev["w"] = self._wall()
            ev.update(fields)
            self._events.append(ev)
        return Op(self, process, f, op, ev)

    def nemesis(self, f: str, node: str | None = None, **fields: Any) -> dict:
        ev = {"type": "nemesis", "f": f}
        if node is not None:
            ev["node"] = node
        ev.update(fields)
        return self.append(ev)

    def role(self, node: str, role: str, epoch: int, **fields: Any) -> dict:
        return self.append({"type": "role", "node": node, "role": role, "epoch": epoch, **fields})

    def final(self, **facts: Any) -> dict:
        return self.append({"type": "final", **facts})

    # -- reading ---------------------------------------------------------------------
    @property
    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    # -- files -----------------------------------------------------------------------
    def to_jsonl(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            for ev in self.events:
                fh.write(json.dumps(ev, separators=(",", ":"), allow_nan=False))
                fh.write("\n")

    @classmethod
    def from_jsonl(cls, path: str) -> "History":
        events = []
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None
        return cls(events)
