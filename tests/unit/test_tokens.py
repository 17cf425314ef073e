"""Lease tokens: what encode_token packs, decode_token gives back, from its memory of
the tokens this node handed out lately or, for any other, by unpacking it."""
import os

import pytest

from node.api import service as service_mod
from node.api.service import ISSUED_TOKENS_MAX, Service
from spooler import errors


class _Lease:
    def __init__(self, i: int, queue: str = "q"):
        self.epoch, self.id, self.nonce, self.queue = 3, i, os.urandom(8), queue


def _svc() -> Service:
    s = Service.__new__(Service)  # the token methods need nothing but their memory
    s._issued = {}
    return s


def test_a_token_decodes_to_what_was_packed_from_memory_and_by_unpacking():
    s, lease = _svc(), _Lease(7, "jobs.failed")
    token = s.encode_token(lease)
    want = (3, 7, lease.nonce, "jobs.failed")
    assert s.decode_token(token) == want
    assert _svc().decode_token(token) == want  # a node that did not hand it out unpacks it


def test_a_token_handed_out_here_is_answered_without_unpacking(monkeypatch):
    s = _svc()
    token = s.encode_token(_Lease(1))
    other = _svc().encode_token(_Lease(2))

    def no_unpacking(*a):
        raise AssertionError("unpacked")
    monkeypatch.setattr(service_mod.binascii, "a2b_base64", no_unpacking)
    assert s.decode_token(token)[1] == 1
    with pytest.raises(AssertionError):
        s.decode_token(other)


def test_the_memory_is_bounded_and_keeps_the_newest():
    s = _svc()
    tokens = [s.encode_token(_Lease(i)) for i in range(ISSUED_TOKENS_MAX + 10)]
    assert len(s._issued) <= ISSUED_TOKENS_MAX
    assert tokens[-1] in s._issued and tokens[0] not in s._issued
    assert s.decode_token(tokens[0])[1] == 0  # forgotten: unpacked again, same fields


@pytest.mark.parametrize("bad", ["", "!" * 40, "A" * 30, 12, None, ["x"]])
def test_anything_else_is_a_malformed_token(bad):
    s = _svc()
    s.encode_token(_Lease(1))
    with pytest.raises(errors.InvalidArgument):
        s.decode_token(bad)
