"""Message ids made from a prefix and a counter: the one rule, shared by the
node (which hands them out and stores them compactly, log.proto's
``Send.run_id_*``) and the SDK (which reads a compact answer,
api.proto's ``SendBatchResponse.run_id_*``).

An id is the prefix followed by the counter in lowercase hex, at least 8
digits: ``f"{prefix}{counter:08x}"``, written here in the form that costs
about half as much in CPython (the SDK makes a batch's hundred ids from a
compact answer, and a primary one for each message it takes out of a
segment)."""
from __future__ import annotations


def message_id(prefix: str, counter: int) -> str:
    return prefix + hex(counter)[2:].zfill(8)


def run_ids(prefix: str, first: int, n: int) -> list:
    """The ids of ``n`` consecutive counters from ``first`` (message_id's rule,
    inline: a call per id would cost about as much again)."""
    return [prefix + hex(c)[2:].zfill(8) for c in range(first, first + n)]
