"""The node's checks of its own state hold under ``python -O`` (node/core/invariant.py).

A bare ``assert`` vanishes when Python runs optimized (``-O``, or PYTHONOPTIMIZE in
a service's environment): a log gap or an epoch going back would then be applied
silently. These tests run the checks in an optimized interpreter and keep product
code free of ``assert`` statements."""
import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# run with -O: each case must raise BrokenInvariant (an AssertionError that is not an
# assert statement); the script prints the cases that did not
_SCRIPT = r'''
import sys
assert False, "not optimized"  # compiled away under -O: the run goes on only if optimized
from node.core import replication as R
from node.core.invariant import BrokenInvariant
from node.core.spool import Core
from spooler.pb import log_pb2

def core_at(lsn, epoch):
    c = Core(rand=lambda n: b"\x01" * n)
    for i in range(1, lsn + 1):
        c.apply(log_pb2.Record(epoch=epoch, lsn=i, ts_us=i, epoch_begin=log_pb2.EpochBegin(node_id="n1")))
    return c

def gap():
    core_at(1, 1).apply(log_pb2.Record(epoch=1, lsn=3, ts_us=3, queue_put=log_pb2.QueuePut(name="q")))

def epoch_back():
    core_at(2, 2).apply(log_pb2.Record(epoch=1, lsn=3, ts_us=3, queue_put=log_pb2.QueuePut(name="q")))

def view_gap():
    R.LogView.from_store([(5, 1, 105, 1)], (3, 1, 103))

def appended_out_of_order():
    c = R.Replication("n1", ["n1"], 2_000_000, rand=lambda: 0.5)
    c.tick(0)
    c.tick(10_000_000)  # a lone member elects itself
    c.appended([(c.log.last_lsn + 2, c.epoch, 0)], 10_000_001)

missed = []
for case in (gap, epoch_back, view_gap, appended_out_of_order):
    try:
        case()
    except BrokenInvariant:
        continue
    except Exception as e:
        missed.append(f"{case.__name__}: {e!r}")
        continue
    missed.append(f"{case.__name__}: nothing raised")
print("MISSED " + "; ".join(missed) if missed else "ALL RAISED")
'''


def test_the_checks_of_a_log_raise_under_python_O():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-O", "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ALL RAISED", out.stdout + out.stderr[-2000:]


def _asserts(path: pathlib.Path) -> list:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Assert)]


def test_product_code_has_no_assert_statements():
    files = [p for d in ("node", "spooler") for p in (ROOT / d).rglob("*.py") if "/pb/" not in p.as_posix()]
    assert len(files) > 30  # the scan reads the packages, not an empty tree
    found = [a for p in files for a in _asserts(p)]
    assert found == [], f"use `if ...: raise BrokenInvariant(...)` (node/core/invariant.py), not assert: {found}"
