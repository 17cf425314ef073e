"""Backups (docs/operations.md, "Backups"): ``python -m node.backup`` copies a
running node's store; the copy restores as a node's store, alone or as every
member of a cluster, with what was confirmed before the copy began."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from integration.test_cluster import primary_of, until_ok
from nodeproc import NodeProc, start_cluster, wait_until
from spooler import errors
from spooler.http import HttpClient

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_backup(data_dir: str, dest: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.backup", data_dir, dest], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def drain(c: HttpClient, queue: str, timeout_s: float = 15.0) -> list:
    """Receive and ack until the queue is empty; a node not yet serving
    (unavailable: a new primary's first moments) is asked again until the deadline."""
    got = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            d = c.receive(queue)
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            threading.Event().wait(0.02)
            continue
        if d is None:
            return got
        got.append(d.body)
        c.ack(d.token)


def test_a_backup_of_a_running_node_restores_what_was_confirmed_before_it(tmp_path):
    node = NodeProc(str(tmp_path / "live")).start()
    try:
        c = HttpClient(node.http_url, node.admin_key, timeout_s=10)
        c.put_queue("q")
        for i in range(50):
            c.send("q", b"before-%d" % i)
        for _ in range(10):  # acked before the copy: not there after the restore
            d = c.receive("q")
            c.ack(d.token)
        stop = threading.Event()
        during = []

        def keep_sending():  # group commits go on while the copy is taken
            i = 0
            while not stop.is_set():
                c.send("q", b"during-%d" % i)
                during.append(i)
                i += 1

        t = threading.Thread(target=keep_sending)
        t.start()
        try:
            wait_until(lambda: len(during) >= 20, 20, what="sends under way")
            r = run_backup(node.data_dir, str(tmp_path / "b.db"))
        finally:
            stop.set()
            t.join(30)
        assert r.returncode == 0, r.stderr
        # a second backup never overwrites a file
        again = run_backup(node.data_dir, str(tmp_path / "b.db"))
        assert again.returncode == 1 and "exists" in again.stderr and "Traceback" not in again.stderr
    finally:
        node.kill()
    restored = tmp_path / "restored"
    restored.mkdir()
    shutil.copy(tmp_path / "b.db", restored / "spool.db")
    node2 = NodeProc(str(restored)).start()
    try:
        c2 = HttpClient(node2.http_url, node2.admin_key, timeout_s=10)
        bodies = drain(c2, "q")
        before = sorted(b for b in bodies if b.startswith(b"before-"))
        assert before == sorted(b"before-%d" % i for i in range(10, 50))
        got_during = [int(b.split(b"-")[1]) for b in bodies if b.startswith(b"during-")]
        # the copy is one committed state: a prefix of what was sent meanwhile, no gaps
        assert sorted(got_during) == list(range(len(got_during))), got_during
        assert len(got_during) <= len(during)
    finally:
        node2.kill()


def test_a_missing_store_is_one_line_and_exit_1(tmp_path):
    r = run_backup(str(tmp_path / "nowhere"), str(tmp_path / "b.db"))
    assert r.returncode == 1 and "no store" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "b.db").exists()


def test_one_backup_restored_on_every_member_makes_a_cluster_again(tmp_path):
    nodes = start_cluster(str(tmp_path / "old"), 3, 1.0)
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary")
        c = HttpClient(nodes[p].http_url, nodes[p].admin_key, timeout_s=10)
        until_ok(lambda: c.put_queue("q"))
        for i in range(30):
            c.send("q", b"m-%d" % i)
        r = run_backup(nodes[p].data_dir, str(tmp_path / "b.db"))
        assert r.returncode == 0, r.stderr
    finally:
        for n in nodes.values():
            n.kill()
    for i in nodes:
        os.makedirs(tmp_path / "new" / i)
        shutil.copy(tmp_path / "b.db", tmp_path / "new" / i / "spool.db")
    again = start_cluster(str(tmp_path / "new"), 3, 1.0)
    try:
        p, _ = wait_until(lambda: primary_of(again), 15, what="a primary")
        c = HttpClient(again[p].http_url, again[p].admin_key, timeout_s=10)
        stats = until_ok(lambda: c.get_queue("q"))["stats"]
        assert stats["visible"] == 30 and stats["sentTotal"] == 30, stats
        bodies = drain(c, "q")
        assert sorted(bodies) == sorted(b"m-%d" % i for i in range(30))
        c.send("q", b"after")  # and it takes writes, confirmed by a quorum
        assert drain(c, "q") == [b"after"]
    finally:
        for n in again.values():
            n.kill()


def _a_store(tmp_path):
    import apsw
    d = tmp_path / "data"
    d.mkdir()
    db = apsw.Connection(str(d / "spool.db"))
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t(x); INSERT INTO t VALUES (1), (2)")
    return db, str(d)


def test_the_copy_gets_its_name_without_hard_links_and_never_replaces_a_file_that_took_it(tmp_path, monkeypatch):
    import errno

    import apsw

    from node import backup
    db, data = _a_store(tmp_path)
    try:
        real_link = os.link

        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_links)  # (a file system without hard links)
        backup.backup(data, str(tmp_path / "a.db"))
        assert [r[0] for r in apsw.Connection(str(tmp_path / "a.db")).execute("SELECT x FROM t")] == [1, 2]

        def another_file_first(src, dst):
            with open(dst, "w") as f:
                f.write("someone else's")
            return real_link(src, dst)
        monkeypatch.setattr(os, "link", another_file_first)
        with pytest.raises(FileExistsError):
            backup.backup(data, str(tmp_path / "b.db"))
        assert (tmp_path / "b.db").read_text() == "someone else's"
        assert not (tmp_path / "b.db.partial").exists()
    finally:
        db.close()


def test_a_copy_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno

    from node import backup
    db, data = _a_store(tmp_path)
    try:
        def eio(fd):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(os, "fsync", eio)
        with pytest.raises(OSError):
            backup.backup(data, str(tmp_path / "c.db"))
        assert sorted(os.listdir(tmp_path)) == ["data"]
    finally:
        db.close()
