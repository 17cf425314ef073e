"""The one rule for ids made from a prefix and a counter (spooler/ids.py)."""
from spooler.ids import message_id, run_ids


def test_ids_are_the_prefix_and_at_least_eight_lowercase_hex_digits():
    for c in (0, 1, 0x1f, 0xabcdef, 0xffffffff, 1 << 32, (1 << 64) - 1):
        assert message_id("p-", c) == f"p-{c:08x}"
    assert run_ids("q", 0xfffffffe, 3) == ["qfffffffe", "qffffffff", "q100000000"]
    assert run_ids("q", 5, 0) == []


def test_a_run_of_ids_follows_the_one_rule_across_every_carry():
    """run_ids makes a run's ids by the counter's last two hex digits; every id
    is still message_id's, across a carry into any digit and past eight digits."""
    for first in (0, 1, 0xf0, 0xfe, 0xff, 0x100, 0xffff - 3, 0xfffff0, 0xffffff80, 0xfffffffe, 1 << 36):
        for n in (0, 1, 7, 8, 9, 100, 256, 257, 600):
            assert run_ids("m-", first, n) == [message_id("m-", c) for c in range(first, first + n)], (first, n)
