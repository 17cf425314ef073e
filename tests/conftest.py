import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from nodeproc import ADMIN_KEY, NodeProc  # noqa: E402


@pytest.fixture
def node(tmp_path):
    """A running single spooler-node on 127.0.0.1 (ephemeral ports), killed by pid afterwards.

    Attributes: http_url, grpc_target, admin_key, data_dir, pid; methods kill(), stop(), start(), restart().
    """
    n = NodeProc(str(tmp_path / "node"), admin_key=ADMIN_KEY)
    n.start()
    try:
        yield n
    finally:
        n.kill()


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory):
    """One node for a whole module (for suites that only add state)."""
    n = NodeProc(str(tmp_path_factory.mktemp("shared") / "node"), admin_key=ADMIN_KEY)
    n.start()
    try:
        yield n
    finally:
        n.kill()
