"""The node decodes a request body's Content-Encoding itself (node/api/http.py,
decode_body): whole or not at all, and never past the body limit."""
from __future__ import annotations

import gzip
import os
import zlib

import pytest

from node.api import http
from node.api.http import GZIP_MEMBERS_MAX, RUNNER_OPTIONS, decode_body, raw_allowance
from spooler import errors

BODY = bytes(range(256)) * 40
CAP = 256 * 1024


def test_whole_bodies_decode_as_sent():
    assert decode_body(gzip.compress(BODY), "gzip", CAP) == BODY
    assert decode_body(zlib.compress(BODY), "deflate", CAP) == BODY
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert decode_body(raw.compress(BODY) + raw.flush(), "deflate", CAP) == BODY  # raw deflate, as aiohttp took it
    assert decode_body(gzip.compress(b"a") + gzip.compress(b"b"), "gzip", CAP) == b"ab"  # gzip's members, in order
    assert decode_body(BODY, "identity", CAP) == BODY and decode_body(BODY, "", CAP) == BODY
    assert decode_body(b"", "identity", CAP) == b"" and decode_body(gzip.compress(b""), "gzip", CAP) == b""


@pytest.mark.parametrize("coding, cut", [
    ("gzip", lambda g: g[:-8]),            # no trailer: checksum and length missing
    ("gzip", lambda g: g[:-3]),            # half a trailer
    ("gzip", lambda g: g[:len(g) // 2]),   # the stream itself stops short
    ("gzip", lambda g: g + b"junk"),       # bytes after the end that are not a member
    ("gzip", lambda g: g[:-8] + b"\0\0\0\0" + g[-4:]),  # wrong checksum
    ("deflate", lambda g: g[:-4]),         # (for deflate, g is zlib's format)
    ("deflate", lambda g: g[:len(g) // 2]),
    ("deflate", lambda g: g + b"x"),
    ("gzip", lambda g: b""),               # cut to nothing: no encoder makes zero bytes
    ("deflate", lambda g: b""),
], ids=["gzip-no-trailer", "gzip-half-trailer", "gzip-cut", "gzip-junk", "gzip-bad-crc",
        "deflate-no-adler", "deflate-cut", "deflate-junk", "gzip-empty", "deflate-empty"])
def test_a_body_that_is_not_whole_is_invalid_argument(coding, cut):
    whole = gzip.compress(BODY) if coding == "gzip" else zlib.compress(BODY)
    with pytest.raises(errors.InvalidArgument):
        decode_body(cut(whole), coding, CAP)


def test_a_body_larger_than_the_cap_once_decoded_is_too_large_without_decoding_it_all():
    bomb = gzip.compress(b"\0" * (50 * 1024 * 1024))  # 50 MiB of zeros in about 50 KiB
    assert len(bomb) < CAP
    with pytest.raises(errors.MessageTooLarge):
        decode_body(bomb, "gzip", CAP)
    assert decode_body(gzip.compress(b"x" * CAP), "gzip", CAP) == b"x" * CAP  # the cap itself is allowed
    with pytest.raises(errors.MessageTooLarge):
        decode_body(zlib.compress(b"x" * (CAP + 1)), "deflate", CAP)


def test_the_node_runner_leaves_bodies_to_decode_body():
    """aiohttp's own decoder accepts a gzip body that stops short; it must be off."""
    assert RUNNER_OPTIONS.get("auto_decompress") is False


def test_an_incompressible_body_at_the_limit_fits_the_raw_allowance():
    """Compressing random bytes makes them a little larger; such a body at the
    message limit must still be read, then decoded to within the limit."""
    import os
    for compress in (gzip.compress, zlib.compress):
        raw = compress(os.urandom(CAP))
        assert CAP < len(raw) <= CAP + raw_allowance(CAP)


def test_gzip_members_are_capped_and_each_is_fed_in_bounded_slices(monkeypatch):
    """Empty 20-byte members, as many as a body holds: without a cap and bounded
    input, each member's end made zlib copy the rest of the body (time growing
    with the square of its size)."""
    empty = gzip.compress(b"")
    assert decode_body(empty * GZIP_MEMBERS_MAX, "gzip", CAP) == b""
    assert decode_body(empty * (GZIP_MEMBERS_MAX - 1) + gzip.compress(BODY), "gzip", CAP) == BODY
    with pytest.raises(errors.InvalidArgument, match="members"):
        decode_body(empty * (CAP // len(empty)), "gzip", CAP)
    fed = []
    real = zlib.decompressobj

    class Spy:
        def __init__(self, *a):
            self.d = real(*a)

        def decompress(self, data, max_length=0):
            fed.append(len(data))
            return self.d.decompress(data, max_length)

        def __getattr__(self, name):
            return getattr(self.d, name)

    monkeypatch.setattr(http.zlib, "decompressobj", Spy)
    big = gzip.compress(os.urandom(CAP // 2)) + empty * 10
    assert len(decode_body(big, "gzip", CAP)) == CAP // 2
    assert max(fed) <= http._DECODE_SLICE < len(big)


def test_deflate_is_one_stream():
    """deflate names one zlib stream: two back to back are bytes after its end."""
    with pytest.raises(errors.InvalidArgument):
        decode_body(zlib.compress(b"a") + zlib.compress(b"b"), "deflate", CAP)


def test_a_replica_and_the_sdk_render_whole_seconds_as_integers():
    """queue_dict renders gRPC's doubles (a replica forwarding a queue call, the SDK)."""
    from spooler._common import queue_dict
    from spooler.pb import api_pb2
    q = api_pb2.Queue(name="q", settings=api_pb2.Settings(lease_timeout_seconds=30.0, retention_seconds=345600.0,
                                                           dedup_window_seconds=0.5, max_retries=5))
    s = queue_dict(q)["settings"]
    assert (s["leaseTimeoutSeconds"], s["retentionSeconds"], s["dedupWindowSeconds"]) == (30, 345600, 0.5)
    assert type(s["leaseTimeoutSeconds"]) is int and type(s["retentionSeconds"]) is int
    assert type(s["dedupWindowSeconds"]) is float
    from spooler._common import whole_seconds
    assert whole_seconds(float("inf")) == float("inf")  # a faulty node's answer renders, it does not raise
