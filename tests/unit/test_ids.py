"""The one rule for ids made from a prefix and a counter (spooler/ids.py)."""
from spooler.ids import message_id, run_ids


def test_ids_are_the_prefix_and_at_least_eight_lowercase_hex_digits():
    for c in (0, 1, 0x1f, 0xabcdef, 0xffffffff, 1 << 32, (1 << 64) - 1):
        assert message_id("p-", c) == f"p-{c:08x}"
    assert run_ids("q", 0xfffffffe, 3) == ["qfffffffe", "qffffffff", "q100000000"]
    assert run_ids("q", 5, 0) == []
