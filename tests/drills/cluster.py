"""A local N-node Spooler cluster of real ``spooler-node`` processes, for failover drills.

    with Cluster(workdir, nodes=3) as c:
        p = c.primary()            # polls GET /v1/cluster on the live nodes
        c.kill(p); c.restart(p)    # SIGKILL by pid, start again on the same ports and data
        c.stop_proc(p); c.cont(p)  # SIGSTOP / SIGCONT by pid

    with Cluster(workdir, nodes=3, partitions=True) as c:
        c.proxy.isolate(c.primary(), "drop")   # node-to-node traffic crosses a FaultProxy
        c.proxy.heal()

With ``partitions=True`` every node-to-node gRPC connection goes through a
``proxy.FaultProxy`` running in a thread of this process: node a's ``--peers`` names,
for each other member b, the proxy's port for link (a->b) (its own entry stays its real
gRPC address). The proxy is closed in ``close()`` after the nodes are killed.

With ``client_partitions=True`` a second ``FaultProxy`` (``self.client_proxy``) stands
between the clients and the nodes: one link from the pseudo-node ``clients`` to each
node's HTTP port (link ``("clients", id)``) and one to its gRPC port (``("clients",
id + "/grpc")``); ``client_url(id)`` and ``client_grpc_target(id)`` name the proxy's
ends, and ``client_links(id)`` both links. A node's HTTP port changes at each start,
and the proxy follows. The drill's own views (``info``, ``current_primary``) still go
to the nodes directly.

While a node's process is gone (killed, exited, not yet started again), every link of
either proxy to it refuses new connections (``FaultProxy.refuse``), as the kernel
refuses a dead process's port: a call to a down node fails to connect (``unavailable``,
nothing sent) instead of being accepted by the proxy and then reset (an unknown
outcome). A thread of this helper watches the processes every WATCH_S.

Every process this helper started is ended by its pid in ``close()`` (stopped ones get
SIGCONT first), also when the block raises; on an exception the nodes' logs are dumped
to stderr. Nothing is ever signalled by name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from nodeproc import ADMIN_KEY, NodeProc, free_ports  # noqa: E402

try:  # imported as tests.drills.cluster (python -m) or drills.cluster (pytest rootdir tests/)
    from .proxy import FaultProxy
except ImportError:  # pragma: no cover
    from proxy import FaultProxy  # type: ignore


CLIENTS, GRPC = "clients", "/grpc"  # the client proxy's pseudo-node, and its gRPC links' suffix
WATCH_S = 0.02  # how often the processes are looked at, for the proxies' refusals (_watch)
WATCH_ERRORS_KEPT = 20


class Cluster:
    def __init__(self, workdir: str, nodes: int = 3, failover_timeout_s: float = 1.0,
                 admin_key: str = ADMIN_KEY, extra_args=(), power_loss: bool = False, partitions: bool = False,
                 fsync_errors: bool = False, write_errors: bool = False, client_partitions: bool = False,
                 disk_low: bool = False, entry: Optional[list] = None):
        """power_loss: nodes keep every write in memory until fsync (test VFS), so each
        SIGKILL is a power cut that loses everything not fsync'd. partitions: route all
        node-to-node traffic through a FaultProxy (``self.proxy``) that can cut links.
        fsync_errors (with power_loss): each node's fsyncs fail while its file
        ``fail_file(id)`` exists (``fail_fsync``); write_errors (with power_loss)
        likewise its writes, ``fail_file(id, "write")`` (``fail_writes``). client_partitions:
        the clients reach the nodes through a FaultProxy of their own (``self.client_proxy``).
        disk_low: each node's data directory reads as full (0 bytes free) while its file
        ``fail_file(id, "disk-free")`` exists (``fill_disk``; SPOOLER_TEST_DISK_FREE_FILE).
        entry: how every node is started at first (``NodeProc(entry=...)``: another
        build, see builds.py); ``set_entry`` changes one node's for its next start."""
        self.workdir = os.path.abspath(workdir)
        self.ids = [f"n{i + 1}" for i in range(nodes)]
        self.failover_timeout_s = failover_timeout_s
        self.admin_key = admin_key
        self.extra_args = list(extra_args)
        self.env = {"SPOOLER_TEST_VFS": "buffered"} if power_loss else None
        self.entry = entry
        self.procs: dict[str, NodeProc] = {}
        self.stopped: set[str] = set()   # SIGSTOPped, not yet SIGCONTed
        self.lock = threading.RLock()
        self._watcher: Optional[threading.Thread] = None  # _watch, while a proxy runs
        self._watch_stop = threading.Event()
        self._starting: set = set()  # nodes being started (_start)
        self.watch_errors: list[str] = []  # refusals _watch failed to make (the first WATCH_ERRORS_KEPT)
        self.watch_errors_total = 0
        self._popens: list = []           # every process this cluster ever started
        self.partitions = partitions
        self.fsync_errors = fsync_errors
        self.write_errors = write_errors
        self.disk_low = disk_low
        self.proxy: Optional[FaultProxy] = None
        self.client_partitions = client_partitions
        self.client_proxy: Optional[FaultProxy] = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        os.makedirs(self.workdir, exist_ok=True)
        if self.partitions:  # listening first: the nodes' ports are picked among the free ones left
            self.proxy = FaultProxy(self.ids).start()
        if self.client_partitions:
            self.client_proxy = FaultProxy([CLIENTS] + self.ids + [n + GRPC for n in self.ids],
                                           links=[k for n in self.ids for k in self.client_links(n)]).start()
        grpc_ports = free_ports(len(self.ids))
        real = dict(zip(self.ids, grpc_ports))
        if self.proxy is not None:
            for nid, gp in real.items():
                self.proxy.set_target(nid, "127.0.0.1", gp)
        if self.client_proxy is not None:
            for nid, gp in real.items():
                self.client_proxy.set_target(nid + GRPC, "127.0.0.1", gp)

        def peers(me: str) -> str:
            """Every member, me included: my own real address, the others through my links."""
            return ",".join(f"{nid}=127.0.0.1:{gp}" if self.proxy is None or nid == me
                            else f"{nid}={self.proxy.address(me, nid)}" for nid, gp in real.items())

        for nid, gp in zip(self.ids, grpc_ports):
            args = ["--peers", peers(nid), "--failover-timeout", repr(float(self.failover_timeout_s)),
                    *self.extra_args]
            env = self.env
            if self.fsync_errors:
                env = {**(env or {}), "SPOOLER_TEST_FSYNC_FAIL_FILE": self.fail_file(nid)}
            if self.write_errors:
                env = {**(env or {}), "SPOOLER_TEST_WRITE_FAIL_FILE": self.fail_file(nid, "write")}
            if self.disk_low:
                env = {**(env or {}), "SPOOLER_TEST_DISK_FREE_FILE": self.fail_file(nid, "disk-free")}
            self.procs[nid] = NodeProc(os.path.join(self.workdir, nid), node_id=nid, admin_key=self.admin_key,
                                       grpc_port=gp, extra_args=args, env=env, entry=self.entry)
        errs: list = []

        def go(nid):
            try:
                self._start(nid)
            except Exception as e:  # noqa: BLE001
                errs.append(e)

        ts = [threading.Thread(target=go, args=(nid,)) for nid in self.ids]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        if self.proxy is not None or self.client_proxy is not None:
            self._start_watcher()
        return self

    def _start_watcher(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="cluster-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Every WATCH_S: a node whose process is gone, or not yet ready again (its
        HTTP port, which the client proxy forwards to, is known only then), has its
        proxies' links refuse new connections; a node running again has them listen
        again. A change that fails (a listener that cannot listen again) is kept in
        ``watch_errors`` and tried again at the next look (each step is idempotent):
        the thread ends only with the cluster."""
        down: set = set()
        while not self._watch_stop.wait(WATCH_S):
            for nid in self.ids:
                gone = nid in self._starting or not self.alive(nid)
                if gone == (nid in down):
                    continue
                try:
                    if self.proxy is not None:
                        self.proxy.refuse(nid, gone)
                    if self.client_proxy is not None:
                        self.client_proxy.refuse(nid, gone)
                        self.client_proxy.refuse(nid + GRPC, gone)
                except RuntimeError:  # a proxy closed meanwhile: the cluster is closing
                    return
                except Exception as e:  # noqa: BLE001 - kept, and tried again next time
                    self.watch_errors_total += 1
                    if len(self.watch_errors) < WATCH_ERRORS_KEPT:
                        self.watch_errors.append(f"{nid} {'refusing' if gone else 'listening'}: {e!r}")
                    continue
                (down.add if gone else down.discard)(nid)

    def _start(self, nid: str) -> None:
        p = self.procs[nid]
        # HTTP on a port the kernel picks at bind time (clients read it from the node's
        # ready line): a port picked beforehand can be taken by another process in between.
        # The gRPC port stays fixed, since every peer is configured with it.
        p.http_port = 0
        self._starting.add(nid)
        try:
            try:
                p.start()
            finally:
                if p.proc is not None:
                    with self.lock:
                        self._popens.append(p.proc)
            if self.client_proxy is not None:
                self.client_proxy.set_target(nid, "127.0.0.1", p.http_port)
        finally:
            self._starting.discard(nid)

    def close(self) -> None:
        """SIGCONT the stopped nodes, then SIGKILL every process this cluster started; then
        close the fault proxies (their threads), if any. The nodes are killed whatever
        else fails here: a node left running would go on calling its peers' old
        addresses, which later clusters on this machine may have taken."""
        try:
            self._watch_stop.set()
            if self._watcher is not None and self._watcher.is_alive():
                self._watcher.join(timeout=15)
        finally:
            try:
                self._kill_all()
            finally:
                self._close_proxies()

    def _close_proxies(self) -> None:
        try:
            if self.proxy is not None:
                self.proxy.close()
        finally:
            if self.client_proxy is not None:
                self.client_proxy.close()

    def _kill_all(self) -> None:
        with self.lock:
            for nid in list(self.stopped):
                self._signal(nid, signal.SIGCONT)
            self.stopped.clear()
            for p in self.procs.values():
                try:
                    p.kill()
                except Exception:  # noqa: BLE001
                    pass
            # belt and braces: earlier incarnations, by their Popen (poll() reaps a dead
            # one), never by a bare pid, which may be another process's by now
            for proc in self._popens:
                if proc.poll() is None:
                    proc.kill()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            sys.stderr.write(self.logs())
            self.close()
            raise

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            sys.stderr.write(f"\n=== cluster in {self.workdir} failed with {exc_type.__name__}: {exc}\n")
            sys.stderr.write(self.logs())
        self.close()
        return False

    # -- nemesis primitives --------------------------------------------------------------------
    def _signal(self, nid: str, sig: int) -> None:
        p = self.procs[nid]
        if p.alive():
            os.kill(p.pid, sig)

    def kill(self, nid: str) -> None:
        """SIGKILL by pid (a stopped process dies too)."""
        with self.lock:
            self.procs[nid].kill()
            self.stopped.discard(nid)

    def fail_file(self, nid: str, what: str = "fsync") -> str:
        return os.path.join(self.workdir, f"{nid}.fail-{what}")

    def fail_fsync(self, nid: str, on: bool) -> None:
        """While on, every fsync of ``nid`` fails (fsync_errors=True)."""
        self._fail(nid, "fsync", self.fsync_errors, on)

    def fail_writes(self, nid: str, on: bool) -> None:
        """While on, every write of ``nid``'s store fails (write_errors=True)."""
        self._fail(nid, "write", self.write_errors, on)

    def fill_disk(self, nid: str, on: bool) -> None:
        """While on, ``nid``'s disk reads as full: below its reserve (disk_low=True)."""
        self._fail(nid, "disk-free", self.disk_low, on, content="0")

    def _fail(self, nid: str, what: str, enabled: bool, on: bool, content: str = "") -> None:
        if not enabled:
            raise RuntimeError(f"this cluster's nodes were not started to fail {what}s on demand")
        if on:
            with open(self.fail_file(nid, what), "w") as f:
                f.write(content)
        else:
            try:
                os.unlink(self.fail_file(nid, what))
            except FileNotFoundError:
                pass

    def wait_exit(self, nid: str, timeout_s: float) -> Optional[int]:
        """``nid``'s exit status once its process has exited, or None after ``timeout_s``."""
        proc = self.procs[nid].proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop_proc(self, nid: str) -> None:
        """SIGSTOP: the process freezes with its sockets open (a hung node, not a dead one)."""
        with self.lock:
            self._signal(nid, signal.SIGSTOP)
            self.stopped.add(nid)

    def cont(self, nid: str) -> None:
        with self.lock:
            self._signal(nid, signal.SIGCONT)
            self.stopped.discard(nid)

    def restart(self, nid: str) -> None:
        """Kill (if running) and start again with the same data dir and gRPC port."""
        with self.lock:
            if nid in self.stopped:
                self.cont(nid)
            self.procs[nid].kill()
        self._start(nid)

    def replace(self, nid: str) -> str:
        """A lost disk: kill the node, then start its replacement with the same id and
        gRPC port on a new, empty data dir, with --join (docs/operations.md, "Replace a
        node"). Returns the new data dir."""
        with self.lock:
            if nid in self.stopped:
                self.cont(nid)
            p = self.procs[nid]
            p.kill()
            n = sum(1 for x in os.listdir(self.workdir) if x.startswith(f"{nid}-disk"))
            p.data_dir = os.path.join(self.workdir, f"{nid}-disk{n + 2}")
            if "--join" not in p.extra_args:
                p.extra_args.append("--join")
        self._start(nid)
        return p.data_dir

    def joining(self, nid: str) -> Optional[bool]:
        """Whether ``nid`` says it is still joining (None: it did not answer)."""
        info = self.info(nid, timeout_s=0.5)
        if not info:
            return None
        me = next((n for n in info.get("nodes", []) if n.get("id") == nid), {})
        return bool(me.get("joining"))

    def set_entry(self, nid: str, entry: Optional[list]) -> None:
        """Start ``nid`` with ``entry`` from its next start on (None: this checkout's build)."""
        self.procs[nid].entry = list(entry or NodeProc.DEFAULT_ENTRY)

    def graceful_stop(self, nid: str) -> int:
        with self.lock:
            if nid in self.stopped:
                self.cont(nid)
        return self.procs[nid].stop()

    # -- queries ----------------------------------------------------------------------------------
    def alive(self, nid: str) -> bool:
        return self.procs[nid].alive()

    def live(self) -> list[str]:
        """Running and not SIGSTOPped."""
        with self.lock:
            return [n for n in self.ids if self.procs[n].alive() and n not in self.stopped]

    def url(self, nid: str) -> str:
        return self.procs[nid].http_url

    @staticmethod
    def client_links(nid: str) -> list:
        """The client proxy's links to ``nid``: its HTTP port, its gRPC port."""
        return [(CLIENTS, nid), (CLIENTS, nid + GRPC)]

    def client_url(self, nid: str) -> str:
        """Where clients reach ``nid``'s HTTP API: through the client proxy, if any."""
        if self.client_proxy is None:
            return self.url(nid)
        return "http://" + self.client_proxy.address(CLIENTS, nid)

    def client_grpc_target(self, nid: str) -> str:
        if self.client_proxy is None:
            return self.procs[nid].grpc_target
        return self.client_proxy.address(CLIENTS, nid + GRPC)

    def info(self, nid: str, timeout_s: float = 1.0) -> Optional[dict]:
        """GET /v1/cluster on one node, or None if it does not answer."""
        p = self.procs[nid]
        if not p.alive() or not p.http_url:
            return None
        req = urllib.request.Request(p.http_url + "/v1/cluster",
                                     headers={"Authorization": f"Bearer {self.admin_key}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None

    def version(self, nid: str, timeout_s: float = 10.0) -> Optional[str]:
        """The version ``nid``'s /metrics names (spooler_build_info), asked until it
        answers or ``timeout_s`` has passed (None then)."""
        p = self.procs[nid]
        deadline = time.monotonic() + timeout_s
        while p.alive() and p.http_url and time.monotonic() < deadline:
            req = urllib.request.Request(p.http_url + "/metrics",
                                         headers={"Authorization": f"Bearer {self.admin_key}"})
            try:
                with urllib.request.urlopen(req, timeout=max(0.1, deadline - time.monotonic())) as r:
                    m = re.search(r'^spooler_build_info\{[^}]*version="([^"]+)"', r.read().decode(), re.M)
                    return m.group(1) if m else None
            except (OSError, ValueError, urllib.error.URLError):
                time.sleep(0.1)
        return None

    def infos(self, timeout_s: float = 1.0) -> dict[str, dict]:
        out = {}
        for nid in self.live():
            d = self.info(nid, timeout_s)
            if d is not None:
                out[nid] = d
        return out

    def current_primary(self, timeout_s: float = 1.0) -> Optional[tuple[str, int]]:
        """(node, epoch) of the live node that reports itself primary under the highest epoch
        and that a majority of all nodes (itself included) names as primary; else None."""
        infos = self.infos(timeout_s)
        prim = [(d["epoch"], nid) for nid, d in infos.items() if d.get("role") == "primary"]
        if not prim:
            return None
        epoch, nid = max(prim)
        agree = sum(1 for d in infos.values() if d.get("primary") == nid and d.get("epoch") == epoch)
        if agree * 2 > len(self.ids):
            return nid, epoch
        return None

    def primary(self, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            cp = self.current_primary()
            if cp is not None:
                return cp[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no agreed primary within {timeout_s}s; views: {self.infos()}")
            time.sleep(0.05)

    def wait_converged(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Every node runs, agrees on the primary and epoch, and has applied the same LSN
        (== the primary's commitLsn), twice in a row. Returns {node: appliedLsn}."""
        deadline = time.monotonic() + timeout_s
        prev = None
        while True:
            infos = self.infos()
            ok = len(infos) == len(self.ids)
            if ok:
                prims = {d.get("primary") for d in infos.values()}
                epochs = {d.get("epoch") for d in infos.values()}
                lsns = {nid: d.get("appliedLsn") for nid, d in infos.items()}
                commit = max(d.get("commitLsn", 0) or 0 for d in infos.values())
                ok = (len(prims) == 1 and None not in prims and len(epochs) == 1
                      and len(set(lsns.values())) == 1 and next(iter(lsns.values())) == commit)
                if ok and prev == lsns:
                    return lsns
                prev = lsns if ok else None
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster did not converge within {timeout_s}s; views: {infos}")
            time.sleep(0.1)

    # -- evidence -----------------------------------------------------------------------------------
    def logs(self, tail_chars: int = 6000) -> str:
        out = []
        for nid, p in self.procs.items():
            try:
                with open(p.log_path, errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            out.append(f"\n----- {nid} log ({p.log_path}), last {tail_chars} chars -----\n{text[-tail_chars:]}")
        for name, px in (("fault proxy", self.proxy), ("client proxy", self.client_proxy)):
            if px is None:
                continue
            try:
                out.append(f"\n----- {name} links -----\n" + json.dumps(px.stats(), sort_keys=True))
            except Exception as e:  # noqa: BLE001 - evidence only
                out.append(f"\n----- {name}: no stats ({e!r}) -----")
        return "".join(out) + "\n"


def _messages_of(db) -> list:
    """Every stored message as (id, queue, seq, retry, visible_at, expires_at, body), sorted
    by id: the rows of the messages table plus the messages still inside segment rows
    (which of the two holds a message differs between nodes; the message does not)."""
    from node.store.sqlite import offsets_from_blob
    out = [tuple(r) for r in db.execute("SELECT id, queue, seq, retry, visible_at, expires_at, body FROM messages")]
    for queue, seq0, prefix, first, n, vis, exp, offs, gone, bodies, lsn, pos in db.execute(
            "SELECT queue, seq0, prefix, first, n, visible_at, expires_at, offs, gone, bodies, lsn, pos FROM segments"):
        o = offsets_from_blob(offs)
        if lsn is None:  # the row holds its bodies
            at = o
        else:  # they are in the log record that sent them
            [(bodies,)] = db.execute("SELECT rec FROM log WHERE lsn = ?", (lsn,)).fetchall() or [(None,)]
            if bodies is None:
                raise KeyError(f"segment {seq0}: its record {lsn} is not in the log")
            at = offsets_from_blob(pos)
        out.extend((f"{prefix}{first + i:08x}", queue, seq0 + i, 0, vis, exp,
                    bytes(bodies[at[i]:at[i] + o[i + 1] - o[i]])) for i in range(n) if not gone[i])
    out.sort(key=lambda r: r[0])
    return out


_ELECTED = re.compile(r"node (\S+) elected primary in epoch (\d+)")


def _node_log_lines(workdir: str):
    """Every line of every node log under ``workdir`` (a replaced node's old data dir,
    and its log, are kept)."""
    for root, _, files in os.walk(workdir):
        for name in files:
            if name.endswith(".log"):
                with open(os.path.join(root, name), errors="replace") as f:
                    yield from f


def primaries_from_logs(workdir: str) -> dict:
    """{epoch: {node ids}} from every node log under ``workdir`` (each node writes
    "node N elected primary in epoch E" when it wins). Unlike the observer's polling
    of GET /v1/cluster, this misses no primary however briefly it served."""
    out: dict = {}
    for line in _node_log_lines(workdir):
        m = _ELECTED.search(line)
        if m:
            out.setdefault(int(m.group(2)), set()).add(m.group(1))
    return out


def snapshot_installs_from_logs(workdir: str) -> dict:
    """How many snapshot copies the nodes installed, how many they refused as not
    installable, how many because what arrived did not hash to the primary's digest
    (0.4.45), and how many came without one (from a primary before 0.4.45)
    (docs/DESIGN.md, "Snapshots"), from every node log under ``workdir``: evidence of
    what a run exercised, not judged."""
    out = {"installed": 0, "refused": 0, "refused_digest": 0, "without_digest": 0}
    for line in _node_log_lines(workdir):
        if "installed a snapshot from" in line:
            out["installed"] += 1
        elif "it could not be installed" in line:
            out["refused"] += 1
        elif "does not hash to the digest" in line:
            out["refused_digest"] += 1
        elif "came without a digest" in line:
            out["without_digest"] += 1
    return out


def db_digest(data_dir: str) -> dict:
    """Integrity check and a digest of the replicated state of a *stopped* node's store.

    The digest covers the queues (settings and counters), the messages, the dedup keys
    remembered and the API keys; the log and meta tables are per node (truncation,
    checkpoints) and left out."""
    import apsw

    path = os.path.join(data_dir, "spool.db")
    db = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = db.execute("PRAGMA integrity_check").fetchall()
        integrity = "ok" if rows == [("ok",)] else "; ".join(str(r[0]) for r in rows)[:500]
        h = hashlib.sha256()
        counts = {}
        for table, rows in (("queues", db.execute("SELECT name, settings, counters FROM queues ORDER BY name")),
                            ("messages", _messages_of(db)),
                            ("dedup", db.execute("SELECT queue, key, msg_id, until FROM dedup ORDER BY queue, key")),
                            ("keys", db.execute("SELECT id, sha256, queue, scopes FROM keys ORDER BY id"))):
            n = 0
            for row in rows:
                h.update(repr((table, row)).encode())
                n += 1
            counts[table] = n
        queues = {name: json.loads(counters) for name, _, counters in
                  db.execute("SELECT name, settings, counters FROM queues ORDER BY name")}
    finally:
        db.close()
    return {"integrity": integrity, "digest": h.hexdigest(), "counts": counts, "counters": queues}
