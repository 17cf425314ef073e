"""The fast tier stays fast: a test outside the ``integration`` marker cannot start a node."""
import pathlib
import re
import subprocess
import sys

import pytest

import nodeproc
from nodeproc import NodeProc, UnmarkedNodeStart


def test_a_node_started_by_a_test_outside_the_integration_tier_fails_that_test(tmp_path):
    assert nodeproc.may_start_nodes is False  # set by conftest for this unmarked test
    n = NodeProc(str(tmp_path / "node"))
    try:
        with pytest.raises(UnmarkedNodeStart):
            n.start()
        assert n.proc is None  # refused before any process was started
    finally:
        if n.proc is not None:
            n.kill()


@pytest.mark.integration
def test_the_integration_marker_lets_a_test_start_nodes():
    assert nodeproc.may_start_nodes is True


def test_every_test_under_tests_integration_carries_the_marker():
    root = pathlib.Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", "not integration", "tests/integration"], cwd=root, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout
    # every test there is collected and then left out by -m "not integration"
    assert re.search(r"no tests collected \((\d+) deselected\)", out), out[-2000:]
    assert int(re.search(r"\((\d+) deselected\)", out).group(1)) > 100


def test_every_test_has_a_node_id_of_its_own():
    """pytest-xdist (make test's workers) hands tests out by node id, and runs one
    of several that share one: schemathesis's 18 operations once shared
    ``test_bad_input.py::test_schemathesis``, and only one of them ran (conftest
    gives them their operation's name)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/integration/test_bad_input.py"], cwd=root, capture_output=True, text=True,
                       timeout=120)
    ids = [ln for ln in p.stdout.splitlines() if "::" in ln]
    assert len([i for i in ids if "::test_schemathesis" in i]) > 10, p.stdout[-2000:]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, dupes
