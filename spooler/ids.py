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


_LOW = [f"{i:02x}" for i in range(256)]   # the last two hex digits of a counter


def run_ids(prefix: str, first: int, n: int) -> list:
    """The ids of ``n`` consecutive counters from ``first``: message_id's rule,
    a run of up to 256 counters at a time. Counters that share all but their
    last two hex digits share the rest of their id, which is made once per such
    run; each id is then one concatenation (a hundred ids cost about a quarter
    of one ``message_id`` call each)."""
    if n < 8:
        return [prefix + hex(c)[2:].zfill(8) for c in range(first, first + n)]
    out: list = []
    c, end = first, first + n
    while c < end:
        low = c & 255
        take = min(256 - low, end - c)
        head = prefix + hex(c >> 8)[2:].zfill(6)
        out += [head + x for x in _LOW[low:low + take]]
        c += take
    return out
