"""spoolctl commands for a Spooler node: queues, messages, leases, keys, cluster.

They speak HTTP (``--server``/SPOOLER_URL, ``--key``/SPOOLER_KEY) through
``spooler.http.HttpClient``; every command takes ``--json``.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from spooler.cli import add_json, emit, int_arg, number_arg, seconds_arg, server_client
from spooler.errors import InvalidArgument, SpoolerError
from spooler.http import HttpClient

# numbers in plain ASCII (not Python's int()/float(), which take "1_000", other
# scripts' digits, "nan"): one written otherwise is a usage error; one out of range
# is the node's invalid_argument (docs/jobs.md)
SETTING_FLAGS = (("--lease-timeout", "leaseTimeoutSeconds", number_arg), ("--max-retries", "maxRetries", int_arg),
                 ("--retention", "retentionSeconds", number_arg), ("--dedup-window", "dedupWindowSeconds", number_arg),
                 ("--failure-queue", "failureQueue", str))


def _listing(args, obj: dict, lines: list, empty: str) -> None:
    """A list: one line per item on stdout; an empty one says so on stderr, so that
    a script reading stdout line by line gets no item that is not one."""
    emit(args, obj, "\n".join(lines))
    if not lines and not args.json:
        print(empty, file=sys.stderr)


def _client(args) -> HttpClient:
    return server_client(args)


def _body_text(b: bytes):
    try:
        return {"body": b.decode("utf-8")}
    except UnicodeDecodeError:
        return {"bodyBase64": base64.b64encode(b).decode()}


def _queue_line(d: dict) -> str:
    s = d["stats"]
    return (f"{d['name']}: visible={s['visible']} leased={s['leased']} delayed={s['delayed']} "
            f"sent={s['sentTotal']} acked={s['ackedTotal']} failed={s['failedTotal']} expired={s['expiredTotal']}")


def cmd_queue_create(args):
    settings = {api: getattr(args, api) for _, api, _ in SETTING_FLAGS if getattr(args, api) is not None}
    d = _client(args).put_queue(args.name, **settings)
    emit(args, d, f"{'created' if d['created'] else 'updated'} {_queue_line(d)}")


def cmd_queue_get(args):
    d = _client(args).get_queue(args.name)
    emit(args, d, json.dumps(d, indent=2))


def cmd_queue_list(args):
    qs = _client(args).list_queues()
    _listing(args, {"queues": qs}, [_queue_line(d) for d in qs], "(no queues)")


def cmd_queue_delete(args):
    _client(args).delete_queue(args.name)
    emit(args, {"deleted": args.name}, f"deleted {args.name}")


def cmd_send(args):
    # os.fsencode: the argument's own bytes, also when they are not UTF-8
    if args.body == "-":
        if sys.stdin is None:  # started with its stdin closed: there is no body to read
            raise InvalidArgument("the body is - (standard input), but standard input is closed")
        body = sys.stdin.buffer.read()
    else:
        body = os.fsencode(args.body)
    r = _client(args).send(args.queue, body, delay_s=args.delay, dedup_key=args.dedup_key)
    emit(args, r, r["id"] + (" (duplicate)" if r["duplicate"] else ""))


def cmd_receive(args):
    c = _client(args)
    d = c.receive(args.queue, wait_s=args.wait)
    if d is None:
        if args.json:
            emit(args, {"message": None})
            return 0
        print("(no message)", file=sys.stderr)  # stdout carries message bodies only
        return 3
    out = {"id": d.id, "token": d.token, "retryCount": d.retry_count, "leaseExpiresAt": d.expires_at,
           "acked": bool(args.ack), **_body_text(d.body)}
    if args.json:
        if args.ack:
            _ack_received(c, d, out)
        emit(args, out)
        return 0
    # the body first, exactly as sent (a pipe gets every byte and nothing more; only
    # a terminal gets a line break after a body that lacks one), and only then the
    # ack: a body that could not be written is not acked (it comes back once its
    # lease expires), and one whose ack failed has been shown, with its token
    sys.stdout.buffer.write(d.body)
    if sys.stdout.isatty() and not d.body.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()
    if args.ack:
        _ack_received(c, d, out)
    print(f"id={d.id} retry={d.retry_count} expires={d.expires_at}" + ("" if args.ack else f"\ntoken={d.token}"),
          file=sys.stderr)


def _ack_received(c, d, out: dict) -> None:
    """``receive --ack``'s ack. If it fails, what was received is not lost with it:
    the error carries the message (``--json``: beside the error, with ``acked``
    null, as it may or may not have landed), and stderr has its id and token."""
    try:
        c.ack(d.token)
    except SpoolerError as e:
        out["acked"] = None
        e.received = out
        print(f"id={d.id} retry={d.retry_count} expires={d.expires_at}\ntoken={d.token}\n"
              "spoolctl: the message was received but its ack failed: ack it with `spoolctl ack TOKEN`; "
              "an ack that did not land leaves it to be delivered again once its lease expires", file=sys.stderr)
        raise


def cmd_ack(args):
    _client(args).ack(args.token)
    emit(args, {"acked": True}, "acked")


def cmd_nack(args):
    _client(args).nack(args.token, delay_s=args.delay)
    emit(args, {"nacked": True}, "nacked")


def cmd_renew(args):
    exp = _client(args).renew(args.token)
    emit(args, {"expiresAt": exp}, exp)


def cmd_purge(args):
    n = _client(args).purge(args.queue)
    emit(args, {"purged": n}, f"purged {n} messages from {args.queue}")


def cmd_redrive(args):
    n = _client(args).redrive(args.queue)
    emit(args, {"moved": n}, f"moved {n}")


def cmd_stats(args):
    c = _client(args)
    qs = [c.get_queue(args.queue)] if args.queue is not None else c.list_queues()  # "" is refused, not "all"
    _listing(args, {"queues": [{"name": d["name"], "stats": d["stats"]} for d in qs]},
             [_queue_line(d) for d in qs], "(no queues)")


def cmd_keys_create(args):
    given = args.scope or ["send,receive"]  # --scope may be given more than once: every one counts
    scopes = list(dict.fromkeys(s.strip() for g in given for s in g.split(",") if s.strip()))
    k = _client(args).create_key(args.queue, scopes)  # "" is the node's to refuse, never "every queue"
    emit(args, k, k["key"])


def cmd_keys_list(args):
    ks = _client(args).list_keys()
    _listing(args, {"keys": ks}, [f"{k['id']} queue={k['queue']} scopes={','.join(k['scopes'])}" for k in ks],
             "(no keys)")


def cmd_keys_delete(args):
    _client(args).delete_key(args.id)
    emit(args, {"deleted": args.id}, f"deleted {args.id}")


def cmd_cluster_status(args):
    d = _client(args).cluster()
    lines = [f"node {d['nodeId']} ({d['role']}), epoch {d['epoch']}, "
             + (f"primary {d['primary']}" if d.get("primary") else "no primary known")
             + (f", cluster {d['clusterId']}" if d.get("clusterId") else "")]
    for n in d["nodes"]:
        heard = n.get("lastContactMs", "")
        heard = "" if heard == "" else ("  never heard" if heard is None else f"  heard {heard / 1e3:.1f} s ago")
        if n.get("reachable") is False:
            heard += "  UNREACHABLE"
        if n.get("diskLow"):
            heard += "  DISK LOW"
        # (a primary's replica entries: sent each new record at once, --eager-replicas)
        first = " first" if n.get("eager") else ""
        lines.append(f"  {n['id']} {n['role']} {n.get('address', '')}{' joining' if n.get('joining') else ''}"
                     f"{first}{heard}")
    emit(args, d, "\n".join(lines))


def cmd_cluster_promote(args):
    d = _client(args).promote(args.node)
    if d.get("primary"):
        emit(args, d, f"primary is now {d['primary']} (epoch {d['epoch']})")
    else:  # an older primary answers with its own view, which may not know the new one yet
        emit(args, d, f"switchover to {args.node} done; the answering node does not know the new primary "
                      f"yet (epoch {d['epoch']}): see spoolctl cluster status")


def register(sub) -> None:
    def cmd(parent, name, func, help):
        p = add_json(parent.add_parser(name, help=help))
        p.set_defaults(func=func)
        return p

    def group(name, help, dest):
        """A command with actions (``queue list``): --json goes before the action or after it."""
        g = sub.add_parser(name, help=help)
        g.add_argument("--json", dest="json_before_action", action="store_true", help="machine-readable output")
        return g.add_subparsers(dest=dest, metavar="ACTION")

    q = group("queue", "create, inspect, list and delete queues", "queue_cmd")
    q.required = True
    for action, func in (("create", cmd_queue_create), ("update", cmd_queue_create)):
        p = cmd(q, action, func, f"{action} a queue (PUT: creates or updates)")
        p.add_argument("name")
        for flag, api, typ in SETTING_FLAGS:
            p.add_argument(flag, dest=api, type=typ, default=None)
    cmd(q, "get", cmd_queue_get, "show a queue").add_argument("name")
    cmd(q, "list", cmd_queue_list, "list queues")
    cmd(q, "delete", cmd_queue_delete, "delete a queue and its messages").add_argument("name")

    p = cmd(sub, "send", cmd_send, "send a message (BODY, or - for stdin)")
    p.add_argument("queue")
    p.add_argument("body")
    p.add_argument("--delay", type=seconds_arg, default=None, help="seconds before it becomes visible")
    p.add_argument("--dedup-key", default=None)

    p = cmd(sub, "receive", cmd_receive, "lease one message (body to stdout, token to stderr)")
    p.epilog = ("exit status: 0 a message was received; 3 none came within --wait (\"(no message)\" on "
                "stderr; with --json the answer is {\"message\": null} and the status 0); 1 an error; "
                "2 a usage error")
    p.add_argument("queue")
    p.add_argument("--wait", type=seconds_arg, default=0.0, help="long poll up to 20 s")
    p.add_argument("--ack", action="store_true", help="ack it at once")

    cmd(sub, "ack", cmd_ack, "ack a lease").add_argument("token")
    p = cmd(sub, "nack", cmd_nack, "nack a lease (redelivered, retry count +1)")
    p.add_argument("token")
    p.add_argument("--delay", type=seconds_arg, default=None)
    cmd(sub, "renew", cmd_renew, "renew a lease").add_argument("token")
    cmd(sub, "redrive", cmd_redrive, "move the failure queue's messages back").add_argument("queue")
    cmd(sub, "purge", cmd_purge, "delete every message of a queue (leased ones too)").add_argument("queue")
    cmd(sub, "stats", cmd_stats, "queue statistics").add_argument("queue", nargs="?")

    k = group("keys", "API keys", "keys_cmd")
    k.required = True
    p = cmd(k, "create", cmd_keys_create, "create a scoped key (printed once)")
    p.add_argument("--queue", default="*", help="queue name, or * for every queue")
    p.add_argument("--scope", action="append", default=None,
                   help="comma list of send, receive, admin; may be repeated (default send,receive)")
    cmd(k, "list", cmd_keys_list, "list keys (never the secrets)")
    cmd(k, "delete", cmd_keys_delete, "delete a key").add_argument("id")

    c = group("cluster", "cluster status and switchover", "cluster_cmd")
    c.required = True
    cmd(c, "status", cmd_cluster_status, "who is primary, epoch, members")
    cmd(c, "promote", cmd_cluster_promote, "planned switchover to NODE").add_argument("node")


__all__ = ["register", "argparse"]
