"""The SDK's gRPC channel options: the ping timeout that drops a hung node."""
import pytest

from spooler._common import GRPC_OPTIONS, PING_TIMEOUT_S, grpc_options
from spooler.aio import AsyncClient
from spooler.client import Client


def test_the_ping_timeout_sets_both_of_grpcs_ping_deadlines():
    opts = dict(grpc_options(20))
    assert opts["grpc.keepalive_timeout_ms"] == opts["grpc.http2.ping_timeout_ms"] == 20_000
    assert dict(grpc_options()) == dict(GRPC_OPTIONS)
    assert dict(GRPC_OPTIONS)["grpc.http2.ping_timeout_ms"] == PING_TIMEOUT_S * 1000


@pytest.mark.parametrize("bad", [0, -1, "5", True, float("nan")])
def test_a_ping_timeout_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError):
        Client("127.0.0.1:9", ping_timeout_s=bad)
    with pytest.raises(ValueError):
        AsyncClient("127.0.0.1:9", ping_timeout_s=bad)


def test_a_client_opens_its_channels_with_its_own_ping_timeout():
    c = Client("127.0.0.1:9", ping_timeout_s=12)
    try:
        assert dict(c._grpc_options)["grpc.http2.ping_timeout_ms"] == 12_000
    finally:
        c.close()
