"""How the replication driver cuts an AppendReq's records into frames."""
from node.core import replication as R
from node.replication.driver import frame_parts


def _req(n: int) -> R.AppendReq:
    entries = [(10 + i, 3, 1000 + i) for i in range(1, n + 1)]
    return R.AppendReq(3, "n1", 10, 2, 999, entries, 10, 0, 10)


def test_records_over_the_byte_limit_go_as_consecutive_frames_each_under_it():
    """Each part holds at most the limit (unless one record alone is larger: it
    goes alone), and each part's prev is the last record of the part before, so
    the replica takes them as consecutive appends."""
    data = [b"a" * 40, b"b" * 40, b"c" * 100, b"d" * 10, b"e" * 30, b"f" * 30]
    parts = frame_parts(_req(len(data)), data, limit=80)
    assert [[e.rec[:1] for e in part] for _, part in parts] == [[b"a", b"b"], [b"c"], [b"d", b"e", b"f"]]
    assert [prev for prev, _ in parts] == [(10, 2, 999), (12, 3, 1002), (13, 3, 1003)]
    assert [e.lsn for _, part in parts for e in part] == list(range(11, 17))


def test_a_frame_within_the_limit_and_a_heartbeat_stay_one_frame():
    assert [len(p) for _, p in frame_parts(_req(3), [b"x"] * 3, limit=80)] == [3]
    assert frame_parts(_req(0), [], limit=80) == [((10, 2, 999), [])]
