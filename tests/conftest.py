import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import nodeproc  # noqa: E402
from nodeproc import ADMIN_KEY, NodeProc  # noqa: E402

INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration") + os.sep


def pytest_collection_modifyitems(config, items):
    """The tiers: every test under tests/integration/ starts real processes of the
    product and carries the ``integration`` marker; elsewhere a test that starts a
    node says so itself (``pytestmark``). ``-m 'not integration and not slow'`` is
    the fast tier: the core, the simulation, the SDK against fakes."""
    for item in items:
        if str(item.path).startswith(INTEGRATION_DIR):
            item.add_marker(pytest.mark.integration)
        # schemathesis names each API operation's test in item.name only
        # ("test_schemathesis[GET /v1/queues]"), its node id being the bare
        # function's for all 18: pytest-xdist, which hands tests to its workers
        # by node id, then ran one of the 18 (make test, 0.4.38's first runs)
        if "[" in item.name and "[" not in item.nodeid:
            if hasattr(item, "_id") and hasattr(item.parent, "id"):  # pytest 9
                item._id = item.parent.id.child(item.name)
            else:
                item._nodeid = f"{item.parent.nodeid}::{item.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before any fixture of this test (a module's shared node included) is set up
    nodeproc.may_start_nodes = item.get_closest_marker("integration") is not None


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
