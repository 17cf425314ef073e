"""One `make bench` run as Markdown: the targets, then Spooler beside the peers.

``table(result)`` reads the JSON object bench/run.py writes (bench/results/latest.json)
and returns two tables: every target of issues 2 and 4 with its median, its
samples, the bare stack's figure and whether it was met; and each workload's
medians for one node, three nodes and each peer of the same run, with the
three-node figure's ratio to each peer. bench/run.py prints it at the end of a
run and writes it beside the JSON (latest.md); docs/benchmarks.md takes its
tables from there. ``python -m bench.summary [FILE]`` prints it for a saved run.

Nothing here measures: a figure the run did not record is shown as "–", and a
target without a value is "not measured", never met.
"""
from __future__ import annotations

import json
import re
import sys

PEERS = (("nats-jetstream", "JetStream R3"), ("rabbitmq-quorum", "RabbitMQ QQ R3"))

# (key in the medians, row label, unit); *_ms: lower is better, the rest higher
FIGURES = (
    ("send_sequential_p50_ms", "send, sequential, p50", "ms"),
    ("send_sequential_p99_ms", "send, sequential, p99", "ms"),
    ("send_sequential_per_s", "send, sequential", "msg/s"),
    ("send_64_in_flight_per_s", "send, 64 in flight", "msg/s"),
    ("send_batch_100_per_s", "send_batch of 100, one at a time", "msg/s"),
    ("receive_ack_per_s", "receive + ack", "msg/s"),
)

ONE_NODE_LABELS = {"send_64_in_flight_per_s": "1 node, 64 in flight",
                   "send_batch_100_per_s": "1 node, batch of 100",
                   "send_sequential_p50_ms": "1 node, sequential p50"}
THREE_NODE_LABELS = {"send_64_in_flight_per_s": "3 nodes, 64 in flight",
                     "send_batch_100_per_s": "3 nodes, batch of 100",
                     "send_sequential_p50_ms": "3 nodes, sequential p50",
                     "receive_ack_per_s": "3 nodes, receive + ack",
                     "failover_sigkill_s": "failover after SIGKILL",
                     "failover_sigstop_s": "failover after SIGSTOP"}


def fmt(v, unit: str = "") -> str:
    """A figure as the docs write it: ms and s with three decimals, rates whole
    (without a unit: small fractions with three decimals, the rest whole)."""
    if v is None:
        return "–"
    if unit in ("ms", "s") or not unit and isinstance(v, float) and abs(v) < 100:
        return f"{v:,.3f}"
    return f"{round(v):,}"


def _wanted(target: str) -> str:
    """bench/run.py's target text, its large numbers with thousands separators."""
    return re.sub(r"\d{4,}", lambda m: f"{int(m.group()):,}", target)


def _unit(fig: str) -> str:
    if fig.endswith("_per_s"):
        return "msg/s"
    return "ms" if fig.endswith("_ms") else "s"


def _verdict(t: dict, error: str = "") -> str:
    """Met or missed; ``error``: the runs of the figure that failed (its median
    is then of the others), said beside it."""
    if t.get("passed") is None:
        v = t.get("note") or "not measured"
    elif t["passed"]:
        v = "met"
    else:
        v = f"missed by {t['missed_by_pct']}%" if "missed_by_pct" in t else "missed"
    return f"{v} ({error})" if error else v


def _target_rows(targets: dict, labels: dict, samples: dict, errors: dict) -> list:
    rows = []
    for fig, label in labels.items():
        t = targets.get(fig)
        if not isinstance(t, dict):
            continue
        unit = _unit(fig)
        seen = fmt(t.get("value"), unit)
        xs = samples.get(fig)
        if xs:
            seen += " (" + ", ".join(fmt(x, unit) for x in xs) + ")"
        if "ratio_to_peer" in t:
            seen += f", {t['ratio_to_peer']:.3f}x"
        bare = fmt(t["bare_stack"], unit) if "bare_stack" in t else "–"
        rows.append(f"| {label} | {_wanted(t['target'])} | {seen} | {bare} | {_verdict(t, errors.get(fig, ''))} |")
    return rows


def _errors(result: dict) -> tuple:
    """({figure of the 3-node targets: what failed}, [lines for every part that
    failed or was skipped]): a table that reads "met" must not hide a failed run."""
    cl = result.get("cluster") or {}
    fo = cl.get("failover") or {}
    by_fig, lines = {}, []
    parts = [("Spooler, 1 node", result.get("spooler")), ("Spooler, 3 nodes", cl.get("spooler")),
             ("Spooler, 3 nodes", cl)]
    parts += [(f"failover after {kind.upper()}", fo.get(kind)) for kind in ("sigkill", "sigstop")]
    parts += [(label, (result.get("peers") or {}).get(k)) for k, label in PEERS]
    parts += [("the job runner", result.get("jobs"))]
    for what, part in parts:
        if not isinstance(part, dict):
            continue
        why = part.get("error") or part.get("skipped")
        if why:
            lines.append(f"- {what}: {'skipped' if 'skipped' in part else 'error'}: {why}")
    for kind in ("sigkill", "sigstop"):
        if (fo.get(kind) or {}).get("error"):
            by_fig[f"failover_{kind}_s"] = fo[kind]["error"]
    return by_fig, lines


def _med(d) -> dict:
    return (d or {}).get("median") or {}


def table(result: dict) -> str:
    m = result.get("machine") or {}
    cl = result.get("cluster") or {}
    one, three = result.get("spooler") or {}, cl.get("spooler") or {}
    peers = result.get("peers") or {}
    head = (f"Run of {result.get('date_utc', '?')}, commit {m.get('git_commit', '?')}; "
            f"{m.get('nproc', '?')} cores ({m.get('cpu_model', '?')}), Python {m.get('python', '?')}; "
            f"load average at the start {', '.join(str(x) for x in m.get('loadavg_at_start') or []) or '?'}; "
            f"fdatasync of 256 bytes p50 {fmt((m.get('fdatasync_256b_ms') or {}).get('p50'), 'ms')} ms. "
            "Medians of each figure's samples (in brackets).")
    errors, error_lines = _errors(result)
    out = [head, "", "| target | wanted | seen | bare stack | |", "|---|---|---|---|---|"]
    out += _target_rows(result.get("targets") or {}, ONE_NODE_LABELS, one.get("samples") or {}, {})
    fo = cl.get("failover") or {}
    three_samples = dict(three.get("samples") or {})
    for kind in ("sigkill", "sigstop"):
        if (fo.get(kind) or {}).get("samples_s"):
            three_samples[f"failover_{kind}_s"] = fo[kind]["samples_s"]
    out += _target_rows(cl.get("targets") or {}, THREE_NODE_LABELS, three_samples, errors)
    notes = {(t or {}).get("note") for t in (result.get("targets"), cl.get("targets")) if isinstance(t, dict)}
    out += [f"\n{n}." for n in sorted(x for x in notes if x)]

    names = [(k, label) for k, label in PEERS if _med(peers.get(k))]
    cols = ["1 node", "3 nodes"] + [label for _, label in names] + [f"3 nodes / {label}" for _, label in names]
    out += ["", "| figure | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for fig, label, unit in FIGURES:
        mine = _med(three).get(fig)
        cells = [fmt(_med(one).get(fig), unit), fmt(mine, unit)]
        theirs = [_med(peers.get(k)).get(fig) for k, _ in names]
        cells += [fmt(v, unit) for v in theirs]
        cells += [f"{mine / v:.3f}" if mine and v else "–" for v in theirs]
        if all(c == "–" for c in cells):
            continue
        out.append(f"| {label}, {unit} | " + " | ".join(cells) + " |")
    failover = [("sigkill", "failover after SIGKILL, s"), ("sigstop", "failover after SIGSTOP, s")]
    peer_fo = fo.get("peers") or {}
    for kind, label in failover:
        mine = (fo.get(kind) or {}).get("median_s")
        if mine is None:
            continue
        # the peers' own failover.py kills their leader with SIGKILL only
        theirs = [(peer_fo.get(k) or {}).get("median_s") if kind == "sigkill" else None for k, _ in names]
        cells = ["–", fmt(mine, "s")] + [fmt(v, "s") for v in theirs]
        cells += [f"{mine / v:.3f}" if v else "–" for v in theirs]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    if names:
        out += ["", "Ratios are the three-node median over the peer's: above 1 is faster for msg/s, "
                "slower for ms and s."]
    jobs = result.get("jobs") or {}
    if "jobs_per_s" in jobs:
        judged = {True: "met", False: "missed"}.get(jobs.get("meets_target"), "not judged")
        out += ["", f"The job runner: {fmt(jobs['jobs_per_s'], 'msg/s')} jobs/s with {jobs.get('workers', '?')} "
                    f"workers (target {fmt(jobs.get('target_jobs_per_s'), 'msg/s')}: {judged})."]
    if error_lines:
        failed = any(": error: " in ln for ln in error_lines)
        out += ["", "Failed or skipped in this run" + (" (where a part failed, a median above is of the runs "
                                                      "that gave a figure)" if failed else "") + ":", ""]
        out += error_lines
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else "bench/results/latest.json"
    with open(path) as f:
        sys.stdout.write(table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
