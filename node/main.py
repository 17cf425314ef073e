"""spooler-node: flags and environment, wiring, signals.

Every flag has an environment variable (for containers): --id -> SPOOLER_ID,
--data -> SPOOLER_DATA, and so on. One asyncio loop runs the HTTP server, the
gRPC server and the engine.
"""
from __future__ import annotations

if __name__ == "__main__":  # python -m node.main: settle what must precede grpc's import (node/process.py)
    from node.process import prepare as _prepare
    _GRPC_IO = _prepare()

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from typing import Optional

from aiohttp import web

from node import logs
from node.api import grpc_api
from node.api import http_conns
from node.api.http import CLIENT_TIMEOUT_S, CONNECTIONS, RUNNER_OPTIONS, build_app
from node.api.metrics import Metrics
from node.api.service import KEY_CHARS_MAX, Service
from node.core.replication import EAGER_ALL, EAGER_QUORUM
from node.engine import INTERNAL_FAILURE, STORAGE_FAILURE, CorruptStore, Engine, Limits
from spooler import __version__

log = logging.getLogger("spooler.node")

# The exit status of a node that stopped because its store failed (a write or
# fsync error), or because its primary's log conflicts with records it holds as
# committed: restarting it on the same store would fail the same way, and
# deploy/systemd/spooler-node.service tells systemd not to loop on it.
EXIT_STORE_FAILED = 70
# A background task died (a bug, not the disk): a restart may well serve again,
# and the systemd unit restarts on it (Restart=on-failure).
EXIT_INTERNAL_FAILURE = 71
EXIT_CANNOT_LISTEN = 1   # an address in --http or --grpc cannot be bound (taken, or not this host's)


# --failover-timeout: below a tenth of a second a replica would campaign between
# the primary's heartbeats (a tenth of the timeout, at least 10 ms) at the first
# fsync that takes a little longer; above an hour, a hung primary stops the
# cluster's writes for longer than anyone would wait
FAILOVER_TIMEOUT_MIN_S, FAILOVER_TIMEOUT_MAX_S = 0.1, 3600
NODE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# --max-messages at most: two hundred times the default (150 GB of memory and more)
MESSAGES_MAX_MAX = 1_000_000_000


def tls_files_problem(cert: str, key: str, ca: str) -> str:
    """Why these PEM files cannot serve mTLS, or "". Checked before anything is
    made: gRPC itself only says it could not bind the port (a key that does not
    match its certificate) or fails on a missing file with a traceback."""
    import ssl

    for flag, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        try:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
        except OSError as e:
            return f"{flag} {path!r} cannot be read: {e.strerror or e}"
        if flag == "--tls-key" and b"ENCRYPTED" in head:
            return f"--tls-key {path!r} is encrypted: gRPC takes no pass phrase, give it the key unencrypted"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # whatever key sizes and signatures gRPC itself takes: judging them is not this check's part
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    try:
        ctx.load_cert_chain(cert, key, password=lambda: b"")  # (never a prompt on the terminal)
    except (ssl.SSLError, ValueError, OSError) as e:
        return f"--tls-cert and --tls-key are not a certificate and its private key in PEM ({e})"
    try:
        ctx.load_verify_locations(ca)
    except (ssl.SSLError, ValueError, OSError) as e:
        return f"--tls-ca {ca!r} holds no PEM certificate ({e})"
    return ""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        """A bad flag is one line (argparse would print the whole usage first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


JOIN_ON, JOIN_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env(name, default=None):
    return os.environ.get(name, default)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="spooler-node", description="Spooler node")
    p.add_argument("--version", action="version", version=f"spooler-node {__version__}")
    p.add_argument("--id", default=_env("SPOOLER_ID", "n1"), help="node id (SPOOLER_ID)")
    p.add_argument("--data", default=_env("SPOOLER_DATA", "./var"), help="data directory (SPOOLER_DATA)")
    p.add_argument("--http", default=_env("SPOOLER_HTTP", "127.0.0.1:8080"), help="HTTP HOST:PORT (SPOOLER_HTTP)")
    p.add_argument("--grpc", default=_env("SPOOLER_GRPC", "127.0.0.1:50051"), help="gRPC HOST:PORT (SPOOLER_GRPC)")
    p.add_argument("--peers", default=_env("SPOOLER_PEERS", ""),
                   help="ID=HOST:PORT,... every member's gRPC address, this node included (SPOOLER_PEERS)")
    p.add_argument("--admin-key", action="append", default=None,
                   help="bootstrap admin API key, repeatable (SPOOLER_ADMIN_KEY, comma-separated; "
                        "spaces around the commas are ignored)")
    p.add_argument("--cluster-key", default=_env("SPOOLER_CLUSTER_KEY", ""),
                   help="a secret every member of the cluster is given: members' calls to each other carry it, "
                        "and replication calls without it are refused (SPOOLER_CLUSTER_KEY; without it any caller "
                        "that reaches the gRPC port can act as a member)")
    p.add_argument("--failover-timeout", type=float, default=_env("SPOOLER_FAILOVER_TIMEOUT", "2"),
                   help="seconds replicas wait for a silent primary (SPOOLER_FAILOVER_TIMEOUT, default 2)")
    p.add_argument("--max-body-bytes", type=int, default=_env("SPOOLER_MAX_BODY_BYTES", str(256 * 1024)),
                   help="largest message body (SPOOLER_MAX_BODY_BYTES, default 262144)")
    p.add_argument("--max-messages", type=int, default=_env("SPOOLER_MAX_MESSAGES", str(Limits().messages_max)),
                   help="messages the node holds, every queue together; past it sends are refused (503) "
                        f"(SPOOLER_MAX_MESSAGES, default {Limits().messages_max}; each takes 150 to 950 bytes "
                        "of memory)")
    p.add_argument("--max-dedup-keys", type=int, default=_env("SPOOLER_MAX_DEDUP_KEYS", str(Limits().dedup_keys_max)),
                   help="dedup keys the node remembers, every queue together; past it sends with a new key "
                        f"are refused (503) (SPOOLER_MAX_DEDUP_KEYS, default {Limits().dedup_keys_max})")
    p.add_argument("--http-max-connections", type=int,
                   default=_env("SPOOLER_HTTP_MAX_CONNECTIONS", str(http_conns.CONNECTIONS_MAX_DEFAULT)),
                   help="HTTP connections served at once; the next are answered 503 and closed "
                        f"(SPOOLER_HTTP_MAX_CONNECTIONS, default {http_conns.CONNECTIONS_MAX_DEFAULT})")
    p.add_argument("--http-client-timeout", type=float,
                   default=_env("SPOOLER_HTTP_CLIENT_TIMEOUT", f"{http_conns.CLIENT_TIMEOUT_S_DEFAULT:g}"),
                   help="seconds an HTTP client has to send its next request's head (from its connection's "
                        "opening or its last answer) and, apart, a request's body; past it the connection "
                        f"closes (SPOOLER_HTTP_CLIENT_TIMEOUT, default {http_conns.CLIENT_TIMEOUT_S_DEFAULT:g})")
    p.add_argument("--grpc-max-connections", type=int,
                   default=_env("SPOOLER_GRPC_MAX_CONNECTIONS", str(grpc_api.CONNECTIONS_MAX_DEFAULT)),
                   help="gRPC connections served at once, clients' and peers' together; the next are closed "
                        f"as soon as accepted (SPOOLER_GRPC_MAX_CONNECTIONS, default {grpc_api.CONNECTIONS_MAX_DEFAULT})")
    p.add_argument("--grpc-handshake-timeout", type=float,
                   default=_env("SPOOLER_GRPC_HANDSHAKE_TIMEOUT", f"{grpc_api.HANDSHAKE_TIMEOUT_S_DEFAULT:g}"),
                   help="seconds a new gRPC connection has to finish its handshake (TLS when on, HTTP/2's "
                        "preface); past it the connection closes (SPOOLER_GRPC_HANDSHAKE_TIMEOUT, default "
                        f"{grpc_api.HANDSHAKE_TIMEOUT_S_DEFAULT:g})")
    p.add_argument("--tls-cert", default=_env("SPOOLER_TLS_CERT", ""),
                   help="PEM certificate of this node: enables mTLS on the gRPC port (SPOOLER_TLS_CERT)")
    p.add_argument("--tls-key", default=_env("SPOOLER_TLS_KEY", ""), help="PEM private key (SPOOLER_TLS_KEY)")
    p.add_argument("--tls-ca", default=_env("SPOOLER_TLS_CA", ""),
                   help="PEM CA that signs every node's and client's certificate (SPOOLER_TLS_CA)")
    p.add_argument("--log-keep-records", type=int, default=_env("SPOOLER_LOG_KEEP_RECORDS", "100000"),
                   help="log records kept behind a checkpoint for lagging replicas; further behind, "
                        "a replica gets a snapshot (SPOOLER_LOG_KEEP_RECORDS, default 100000)")
    p.add_argument("--log-keep-bytes", type=int, default=_env("SPOOLER_LOG_KEEP_BYTES", str(256 << 20)),
                   help="bytes of log records kept behind a checkpoint, the same tail bounded by size "
                        "(SPOOLER_LOG_KEEP_BYTES, default 268435456)")
    p.add_argument("--join", action="store_true", default=_env("SPOOLER_JOIN", "").strip().lower() in JOIN_ON,
                   help="this node replaces a member whose data is lost: on an empty --data it neither "
                        "votes nor stands for election until it holds what the cluster committed (SPOOLER_JOIN=1)")
    p.add_argument("--eager-replicas", default=_env("SPOOLER_EAGER_REPLICAS", EAGER_QUORUM),
                   help="quorum: a new record goes at once to as many replicas as a quorum needs (the most "
                        "caught up), the others get it within a tick (10 ms); all: to every replica at once "
                        "(SPOOLER_EAGER_REPLICAS, default quorum)")
    p.add_argument("--disk-reserve-bytes", type=int, default=_env("SPOOLER_DISK_RESERVE_BYTES", str(64 << 20)),
                   help="sends are refused (503) while the data directory's file system has less free than this "
                        "(SPOOLER_DISK_RESERVE_BYTES, default 67108864; 0: never)")
    p.add_argument("--log-level", default=_env("SPOOLER_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING, ERROR or CRITICAL (SPOOLER_LOG_LEVEL, default INFO)")
    a = p.parse_args(argv)
    join_env = _env("SPOOLER_JOIN", "").strip().lower()
    if join_env not in JOIN_ON + JOIN_OFF:
        # SPOOLER_JOIN=false once meant "join": any value but empty or 0 did
        p.error(f"SPOOLER_JOIN must be one of 1, true, yes, on (join) or 0, false, no, off, empty (not), "
                f"not {join_env[:40]!r}")
    if a.admin_key is None:
        # "k1, k2" as well as "k1,k2": a key never begins or ends with a space (refused
        # below), so spaces around the commas can only be the list's
        a.admin_key = [k.strip() for k in _env("SPOOLER_ADMIN_KEY", "").split(",") if k.strip()]
    if a.failover_timeout <= 0:
        p.error("--failover-timeout must be > 0")
    if not FAILOVER_TIMEOUT_MIN_S <= a.failover_timeout <= FAILOVER_TIMEOUT_MAX_S:  # (nan and inf too)
        p.error(f"--failover-timeout must be {FAILOVER_TIMEOUT_MIN_S}..{FAILOVER_TIMEOUT_MAX_S} seconds")
    if a.eager_replicas not in (EAGER_QUORUM, EAGER_ALL):
        p.error(f"--eager-replicas must be {EAGER_QUORUM} or {EAGER_ALL}, not {a.eager_replicas[:40]!r}")
    if not NODE_ID_RE.match(a.id):
        # it names the node in --peers (ID=HOST:PORT,...), in votes and in /v1/cluster,
        # where an empty id would read as "no primary"
        p.error("--id must match [A-Za-z0-9._-]{1,64}")
    if a.log_level.upper() not in LOG_LEVELS:
        p.error(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    if not a.data:
        p.error("--data must name a directory")
    if os.path.exists(a.data) and not os.path.isdir(a.data):
        p.error(f"--data {a.data!r} exists and is not a directory")
    # a body is sent in one log record, whose bodies are at most 8 MiB
    # (Limits.batch_bytes_max), and answered in one gRPC message of at most 16 MiB
    if not 1 <= a.max_body_bytes <= Limits().batch_bytes_max:
        p.error(f"--max-body-bytes must be 1..{Limits().batch_bytes_max}")
    if not 1 <= a.max_messages <= MESSAGES_MAX_MAX:
        p.error(f"--max-messages must be 1..{MESSAGES_MAX_MAX}")
    if not 1 <= a.max_dedup_keys <= MESSAGES_MAX_MAX:
        p.error(f"--max-dedup-keys must be 1..{MESSAGES_MAX_MAX}")
    if not 1 <= a.http_max_connections <= http_conns.CONNECTIONS_MAX_MAX:
        p.error(f"--http-max-connections must be 1..{http_conns.CONNECTIONS_MAX_MAX}")
    if not http_conns.CLIENT_TIMEOUT_S_MIN <= a.http_client_timeout <= http_conns.CLIENT_TIMEOUT_S_MAX:
        p.error(f"--http-client-timeout must be {http_conns.CLIENT_TIMEOUT_S_MIN:g}.."
                f"{http_conns.CLIENT_TIMEOUT_S_MAX:g} seconds")
    if not 1 <= a.grpc_max_connections <= grpc_api.CONNECTIONS_MAX_MAX:
        p.error(f"--grpc-max-connections must be 1..{grpc_api.CONNECTIONS_MAX_MAX}")
    if not grpc_api.HANDSHAKE_TIMEOUT_S_MIN <= a.grpc_handshake_timeout <= grpc_api.HANDSHAKE_TIMEOUT_S_MAX:
        p.error(f"--grpc-handshake-timeout must be {grpc_api.HANDSHAKE_TIMEOUT_S_MIN:g}.."
                f"{grpc_api.HANDSHAKE_TIMEOUT_S_MAX:g} seconds")
    if any((a.tls_cert, a.tls_key, a.tls_ca)) and not all((a.tls_cert, a.tls_key, a.tls_ca)):
        p.error("--tls-cert, --tls-key and --tls-ca go together")
    if a.tls_cert:
        why = tls_files_problem(a.tls_cert, a.tls_key, a.tls_ca)
        if why:
            p.error(why)
    if a.join and len([x for x in a.peers.split(",") if x.strip()]) < 2:
        # a lone node has no cluster to take its history from: it would just serve
        p.error("--join (SPOOLER_JOIN) replaces a member of a cluster: it needs --peers naming every member")
    if a.log_keep_records < 1:
        p.error("--log-keep-records must be >= 1")
    if a.log_keep_bytes < 0:
        p.error("--log-keep-bytes must be >= 0")
    if a.disk_reserve_bytes < 0:
        p.error("--disk-reserve-bytes must be >= 0")
    def bad_key(k: str) -> bool:
        # such a key could never be presented in an Authorization header, or carried
        # in gRPC metadata (the SDK's calls, a replica's forwarded ones)
        return not 1 <= len(k) <= KEY_CHARS_MAX or k != k.strip() or any(not 32 <= ord(ch) < 127 for ch in k)

    if any(bad_key(k) for k in a.admin_key):
        p.error(f"--admin-key must be 1..{KEY_CHARS_MAX} printable ASCII characters, without spaces "
                "at either end")
    if a.cluster_key and bad_key(a.cluster_key):
        p.error(f"--cluster-key must be 1..{KEY_CHARS_MAX} printable ASCII characters, without spaces "
                "at either end")
    return a


def _hostport(s: str) -> tuple:
    host, _, port = s.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise SystemExit(f"spooler-node: expected HOST:PORT (a port up to 65535), got {s!r}")
    return host.strip("[]"), int(port)


def _join(host: str, port: int) -> str:
    """HOST:PORT again, an IPv6 address in brackets (as gRPC wants it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_listenable(what: str, host: str, port: int, hold: Optional[list] = None) -> None:
    """Refuse an address another process holds before anything is created: no
    data directory or store is made, no election is held, and gRPC's own log
    line about a failed bind is not printed beside ours. Binds a socket per
    address the name gives, as asyncio's server does (an address family the host
    lacks is skipped), and closes it; with ``hold``, it listens on it instead and
    appends it there, so that a second check meets it (the caller closes them):
    that is the gRPC address, held as gRPC binds it (a wildcard as one socket for
    both families, "localhost" as both loopback addresses). The servers bind for real later; a process taking the port in between still
    meets the ListenError there."""
    import errno
    import socket
    if port == 0:
        return  # any free port
    if hold is not None and host in ("", "0.0.0.0", "::"):
        # gRPC listens on a wildcard as one socket for both families ([::], not
        # v6-only): so must the held one, to meet an IPv4 or IPv6 address on its port
        infos = [(socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("::", port, 0, 0)),
                 (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("0.0.0.0", port))]
    elif hold is not None and host == "localhost":
        # gRPC resolves "localhost" itself, to both loopback addresses
        infos = [(socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", port)),
                 (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("::1", port, 0, 0))]
    else:
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as e:
            raise grpc_api.ListenError(f"cannot listen for {what} on {host}:{port}: {e.strerror or e}") from None
    # gRPC itself starts on a wildcard when [::] is taken but 0.0.0.0 is free, and on
    # "localhost" when one loopback is free: there, one address free is enough
    any_of = hold is not None and host in ("", "0.0.0.0", "::", "localhost")
    bound, dual, in_use = 0, False, None
    for family, kind, proto, _, addr in infos:
        if dual:
            break  # the wildcard's one socket holds both families
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            if e.errno in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT):
                continue  # a family this host lacks: skipped, as asyncio's server does
            raise grpc_api.ListenError(f"cannot listen for {what} on {host}:{port}: {e.strerror or e}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                both = hold is not None and addr[0] == "::"
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if both else 1)
            try:
                sock.bind(addr)
                if hold is not None:
                    sock.listen(1)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:
                    continue
                if any_of and e.errno == errno.EADDRINUSE:
                    in_use = e
                    continue
                raise grpc_api.ListenError(f"cannot listen for {what} on {host}:{port}: "
                                           f"{e.strerror or e}") from None
            bound += 1
            dual = family == socket.AF_INET6 and hold is not None and addr[0] == "::"
            if hold is not None:
                hold.append(sock)
                sock = None
        finally:
            if sock is not None:
                sock.close()
    if not bound and in_use is not None:
        raise grpc_api.ListenError(f"cannot listen for {what} on {host}:{port}: {in_use.strerror or in_use}")
    if not bound:
        raise grpc_api.ListenError(f"cannot listen for {what} on {host}:{port}: no such address here")


def check_both_listenable(grpc_addr: str, http_addr: str) -> None:
    """Both APIs' addresses, each free, and not one address under two spellings
    (localhost and 127.0.0.1, or a wildcard and one of its addresses): the gRPC
    address is held listening while the HTTP one is tried, so any overlap the
    kernel would refuse later is refused now, before anything is made."""
    (ghost, gport), (hhost, hport) = _hostport(grpc_addr), _hostport(http_addr)
    held: list = []
    try:
        check_listenable("gRPC", ghost, gport, hold=held)
        try:
            check_listenable("HTTP", hhost, hport)
        except grpc_api.ListenError:
            if not held:
                raise
            for sock in held:
                sock.close()
            held.clear()
            check_listenable("HTTP", hhost, hport)  # another process holds it: that error
            raise grpc_api.ListenError(f"cannot listen for HTTP on {http_addr}: "
                                       "the same address as --grpc") from None
    finally:
        for sock in held:
            sock.close()


def _parse_peers(spec: str, me: str):
    """ID=HOST:PORT,... -> {id: address}; None for a single node."""
    items = [x.strip() for x in spec.split(",") if x.strip()]
    if not items:
        return None
    peers = {}
    for it in items:
        nid, sep, addr = it.partition("=")
        if not sep or not nid or not addr:
            raise SystemExit(f"spooler-node: --peers entries are ID=HOST:PORT, got {it!r}")
        if not NODE_ID_RE.match(nid):
            raise SystemExit(f"spooler-node: --peers ids must match [A-Za-z0-9._-]{{1,64}}, got {nid!r}")
        if nid in peers:
            raise SystemExit(f"spooler-node: --peers names {nid} twice")
        peers[nid] = _join(*_hostport(addr))  # (an IPv6 address in brackets, as gRPC dials it)
    if me not in peers:
        raise SystemExit(f"spooler-node: --peers must include this node ({me})")
    return peers if len(peers) > 1 else None


def _admin_keys(args) -> list:
    if args.admin_key:
        return args.admin_key
    # No key given: make one, keep it beside the store so restarts reuse it.
    path = os.path.join(args.data, "admin.key")
    if os.path.exists(path):
        with open(path) as f:
            key = f.read().strip()
    else:
        import secrets
        key = secrets.token_urlsafe(24)
        os.makedirs(args.data, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    # where it is, not the secret itself: logs are read (and kept) more widely than the data directory
    print(f"spooler-node: no --admin-key given; using the admin key in {path} (readable by this user only)",
          file=sys.stderr, flush=True)
    return [key]


# Python's cyclic garbage collector makes a young-generation pass every 700
# net allocations of container objects by default. A node makes several per
# message (messages, leases, heap entries), so receive + ack paid about
# 3 us per message in collections (docs/benchmarks-history.md, measured with
# gc.callbacks). Our objects seldom form cycles (reference counting frees
# them), so collect far less often: cyclic garbage still has a bound, it is
# only found later. What the store loaded at start is frozen out of the walks.
GC_THRESHOLDS = (50_000, 50, 100)


def tune_gc() -> None:
    import gc
    gc.set_threshold(*GC_THRESHOLDS)


def freeze_loaded_state() -> None:
    import gc
    gc.collect()
    gc.freeze()  # what the store loaded lives on: no later collection walks it


# Descriptors a node needs besides its HTTP and gRPC connections: threads' pipes,
# the store's files, the listening sockets, its channels to peers
FDS_BESIDE_CONNECTIONS = 1024


def fit_fd_limit(need: int) -> Optional[int]:
    """Raise this process's soft limit on open files toward ``need`` (as far as its
    hard limit allows; many systems start processes at a soft 1,024 under a far
    higher hard limit). Returns the soft limit now, or None when it is unlimited."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    if soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


async def serve(args) -> int:
    peers = _parse_peers(args.peers, args.id)
    need = (args.http_max_connections + http_conns.SPARE_DEFAULT + args.grpc_max_connections
            + FDS_BESIDE_CONNECTIONS)
    soft = fit_fd_limit(need)
    if soft is not None and soft < need:
        log.warning("open files are limited to %d (ulimit -n) but --http-max-connections %d and "
                    "--grpc-max-connections %d need about %d: connections past the limit wait for one to close",
                    soft, args.http_max_connections, args.grpc_max_connections, need)
    (ghost, gport), (hhost, hport) = _hostport(args.grpc), _hostport(args.http)
    check_both_listenable(args.grpc, args.http)
    try:
        os.makedirs(args.data, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"spooler-node: cannot make the data directory {args.data!r}: {e.strerror or e}") from None
    tls = None
    if args.tls_cert:
        from node.tls import TLS
        tls = TLS.from_files(args.tls_cert, args.tls_key, args.tls_ca)
    from node.store.testvfs import vfs_from_env
    engine = Engine(args.data, node_id=args.id, limits=Limits(body_bytes_max=args.max_body_bytes,
                                                                 disk_free_bytes_min=args.disk_reserve_bytes,
                                                                 messages_max=args.max_messages,
                                                                 dedup_keys_max=args.max_dedup_keys),
                    peers=peers, failover_timeout_s=args.failover_timeout, grpc_options=grpc_api.GRPC_OPTIONS,
                    tls=tls, vfs=vfs_from_env(), log_keep_records=args.log_keep_records,
                    log_keep_bytes=args.log_keep_bytes, join=args.join, cluster_key=args.cluster_key,
                    eager_replicas=args.eager_replicas,
                    synchronous=os.environ.get("SPOOLER_TEST_SYNCHRONOUS", "FULL"))  # tests' control runs only
    stop = asyncio.Event()
    exit_code = 0

    def fatal(e):
        nonlocal exit_code
        exit_code = exit_status(engine.failed_what)
        stop.set()

    engine.on_fatal = fatal
    svc = Service(engine, _admin_keys(args))
    metrics = Metrics(engine)

    server, health_servicer, gport = await grpc_api.build_server(svc, metrics, _join(ghost, gport), tls,
                                                                 args.grpc_max_connections,
                                                                 args.grpc_handshake_timeout)
    engine.grpc_address = _join(ghost, gport)
    tune_gc()
    # grpcio's health service starts out SERVING: not until the node is ready
    await grpc_api.set_serving(health_servicer, False)
    await server.start()  # first: peers reach us as soon as we can answer (the replication calls wait for the load)
    try:
        await engine.start()
    except CorruptStore as e:  # a restart would find the same: 70, which the systemd unit does not restart
        engine._fail(e, STORAGE_FAILURE)  # (failed: the stop below writes no checkpoint of what was loaded)
        await server.stop(None)
        await engine.stop()
        return EXIT_STORE_FAILED
    freeze_loaded_state()
    health = asyncio.ensure_future(grpc_api.follow_readiness(health_servicer, engine))

    app = build_app(svc, metrics)
    guard = http_conns.ConnectionGuard(args.http_max_connections)
    guard.epoch_of = lambda: engine.known_epoch
    app[CONNECTIONS], app[CLIENT_TIMEOUT_S] = guard, args.http_client_timeout
    # aiohttp's keep-alive timer closes a connection whose next request head has
    # not come whole within it, from its opening or its last answer: an idle
    # one, and one sending its head slowly alike (http_conns.py).
    # A client that hangs up cancels its call, as over gRPC: a long poll stops
    # waiting (its state must not outlive the connection); a write already
    # proposed still commits, its answer unread (Service is written for that).
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=args.http_client_timeout,
                           handler_cancellation=True, **RUNNER_OPTIONS)
    await runner.setup()
    guard.attach(runner.server)
    metrics.registry.register(guard)
    # a graceful stop ends every call within about a second (Service.shut_down):
    # anything still open after a few is not waited for
    site = web.TCPSite(runner, hhost, hport, reuse_address=True, shutdown_timeout=3.0)
    try:
        await site.start()
    except OSError as e:
        await server.stop(None)
        await runner.cleanup()
        await engine.stop()
        raise grpc_api.ListenError(f"cannot listen for HTTP on {hhost}:{hport}: {e.strerror or e}") from None
    hport = site._server.sockets[0].getsockname()[1]

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"event": "ready", "id": args.id, "http": _join(hhost, hport), "grpc": _join(ghost, gport),
                      "epoch": engine.epoch, "pid": os.getpid()}), flush=True)
    await stop.wait()
    log.info("stopping")
    engine.draining = True  # /readyz 503 from now on, also while a primary hands over
    health.cancel()
    await grpc_api.set_serving(health_servicer, False)
    if engine.cluster:
        if not engine.failed:
            # a primary hands over first, so its successor leases at once (Driver.hand_over)
            try:
                await engine.repl.hand_over()
            except Exception:  # noqa: BLE001 - the stop goes on; the cluster elects as after a crash
                log.exception("handing over before the stop failed")
        # then the streams that the (new) primary keeps open to this node end: the
        # server's stop below would wait its whole grace period for them
        engine.repl.end_inbound()
    svc.shut_down()  # calls in progress end as unavailable (with their kind), not cancelled
    await server.stop(grace=1.0)
    await runner.cleanup()
    await svc.fwd.drain(2.0)  # a replica: give back what its forwarded polls leased
    await engine.stop()
    return exit_code


def exit_status(what: str) -> int:
    """The status a node exits with after ``Engine._fail(e, what)``."""
    return EXIT_INTERNAL_FAILURE if what == INTERNAL_FAILURE else EXIT_STORE_FAILED


def main(argv=None, grpc_io: str = "") -> int:
    """``grpc_io``: what node.process.prepare settled, for the log (the
    ``spooler-node`` script and ``python -m node.main`` both run it first)."""
    args = parse_args(argv)
    if grpc_io == "invalid":  # (after the flags: --help still answers)
        from node.process import refusal
        raise SystemExit(refusal())
    if os.environ.get("SPOOLER_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["SPOOLER_SWITCH_INTERVAL"]))
    # the node's id on every line: the logs of a cluster's members read apart (make cluster, drills)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {args.id.replace('%', '%%')} %(levelname)s %(name)s %(message)s",
                        stream=sys.stderr)
    logs.install()  # asyncio's, aiohttp's and grpc's lines that clients can cause: at most one a minute
    log.info("gRPC I/O path: %s (GRPC_EXPERIMENTS=%s)", grpc_io or "not settled (node.process not run)",
             os.environ.get("GRPC_EXPERIMENTS", ""))
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 0
    except grpc_api.ListenError as e:
        print(f"spooler-node: {e}", file=sys.stderr)
        return EXIT_CANNOT_LISTEN


if __name__ == "__main__":
    sys.exit(main(grpc_io=_GRPC_IO))
