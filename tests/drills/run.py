"""Run many seeded failover drills one after another.

    python -m tests.drills.run --seeds 1-100 --duration 30 [--partitions] [--power-loss] [--client-partitions]
        [--workdir DIR] [--keep]

Prints the checker table of each seed, then a summary (totals per field, failing seeds),
and exits 1 if any seed fails its required zeros. The histories and node logs of
failing seeds are always kept (under --workdir, default a new temp dir); passing
seeds' directories are removed unless --keep.
"""
from __future__ import annotations

import argparse
import shlex
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    from . import builds
    from .checker import REQUIRED_ZEROS, format_table
    from .drill import FAULT_KINDS, run_drill
except ImportError:  # pragma: no cover - run as a plain script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from drills import builds  # type: ignore
    from drills.checker import REQUIRED_ZEROS, format_table  # type: ignore
    from drills.drill import FAULT_KINDS, run_drill  # type: ignore

SUMMED = ("sends", "confirmed_sends", "deliveries", "drain_deliveries", "empty_receives", "unknown_receives",
          "unknown_sends", "unknown_sends_appeared", "keyed_sends", "keyed_answered_duplicate", "ids_delivered_more_than_once", *REQUIRED_ZEROS,
          "purges", "purged", "orphan_completions", "client_partitions", "client_partition_calls", "client_partition_unknowns",
          "client_partition_unknown_sends_delivered")


def parse_seeds(spec: str) -> list[int]:
    """"1-100", "3", "1,5,9-12"."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def summarize(reports: list[dict]) -> str:
    totals = {k: sum(r.get(k) or 0 for r in reports) for k in SUMMED}
    dup: dict = {}
    for r in reports:
        for k, v in (r.get("duplicate_deliveries") or {}).items():
            dup[k] = dup.get(k, 0) + v
    fu = [w["unavailable_s"] for r in reports for w in r["failover_unavailability"]["windows"]
          if w["unavailable_s"] is not None]
    never = sum(r["failover_unavailability"]["never_recovered"] for r in reports)
    nem: dict = {}
    for r in reports:
        for k, v in (r.get("nemesis_counts") or {}).items():
            nem[k] = nem.get(k, 0) + v
    failing = [r["seed"] for r in reports if not r["required_zeros_ok"]]
    lines = [f"=== summary: {len(reports)} seeds, {len(failing)} failing ===="]
    w = max(len(k) for k in list(totals) + [f"duplicate_deliveries.{k}" for k in dup])
    for k, v in totals.items():
        mark = "  FAIL" if k in REQUIRED_ZEROS and v else ""
        lines.append(f"{k.ljust(w)}  {v:>9}{mark}")
    for k, v in dup.items():
        lines.append(f"{('duplicate_deliveries.' + k).ljust(w)}  {v:>9}")
    lines.append(f"{'nodes_disagree_seeds'.ljust(w)}  {sum(1 for r in reports if r['nodes_agree'] is False):>9}")
    lines.append(f"{'integrity_fail_seeds'.ljust(w)}  {sum(1 for r in reports if r['integrity_ok'] is False):>9}")
    lines.append(f"{'unexpected_node_exits'.ljust(w)}  {sum(len(r.get('unexpected_exits') or ()) for r in reports):>9}")
    lines.append(f"{'drain_incomplete_seeds'.ljust(w)}  {sum(1 for r in reports if not r.get('drain_complete')):>9}")
    lines.append(f"{'nemeses'.ljust(w)}  {json.dumps(nem, sort_keys=True)}")
    dl = [r["disk_low"] for r in reports if r.get("disk_low")]
    if dl:
        took = sorted(x for d in dl for x in d["handover_s"])
        lines.append(f"{'disk_low'.ljust(w)}  rounds={sum(d['rounds'] for d in dl)} "
                     f"handed_over={sum(d['handed_over'] for d in dl)} "
                     f"cut_short={sum(d.get('cut_short', 0) for d in dl)}"
                     + (f" p50={took[(len(took) - 1) // 2]:.2f}s max={took[-1]:.2f}s" if took else ""))
    if fu:
        fu.sort()
        lines.append(f"{'failover_unavailability'.ljust(w)}  n={len(fu)} p50={fu[len(fu) // 2]:.3f}s "
                     f"max={fu[-1]:.3f}s never_recovered={never}")
        by_kind: dict = {}
        for r in reports:
            for x in r["failover_unavailability"]["windows"]:
                k = "_".join(str(v) for v in (x.get("f"), x.get("kind"), x.get("role")) if v)
                by_kind.setdefault(k, []).append(x["unavailable_s"])
        for k in sorted(by_kind):
            got = sorted(v for v in by_kind[k] if v is not None)
            if not got:
                lines.append(f"{('  ' + k).ljust(w)}  n=0 (no send invoked after it: {len(by_kind[k])})")
                continue
            p99 = got[min(len(got) - 1, max(0, -(-99 * len(got) // 100) - 1))]
            lines.append(f"{('  ' + k).ljust(w)}  n={len(got)} p50={got[(len(got) - 1) // 2]:.3f}s "
                         f"p99={p99:.3f}s max={got[-1]:.3f}s no_window={len(by_kind[k]) - len(got)}")
    rj: dict = {}
    for r in reports:
        for x in r.get("rejoins") or ():
            rj.setdefault(x["kind"], []).append(x["after_heal_s"])
    for k in sorted(rj):
        v = sorted(rj[k])
        lines.append(f"{('rejoin_after_heal ' + k).ljust(w)}  n={len(v)} p50={v[(len(v) - 1) // 2]:.3f}s "
                     f"max={v[-1]:.3f}s")
    lines.append(f"{'wall_s'.ljust(w)}  {sum(r.get('wall_s', 0) for r in reports):9.1f}")
    lines.append("failing seeds: " + (" ".join(map(str, failing)) if failing else "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.drills.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1-10", help="e.g. 1-100 or 1,5,9-12 (default %(default)s)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load+faults per seed")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where seed-<n>/ dirs go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep passing seeds' histories and logs too")
    ap.add_argument("--power-loss", action="store_true",
                    help="every SIGKILL is a power cut (nodes buffer writes until fsync)")
    ap.add_argument("--partitions", action="store_true",
                    help="route node-to-node traffic through a fault proxy; the nemesis also partitions")
    ap.add_argument("--cascades", action="store_true",
                    help="the nemesis also overlaps two faults (a new primary killed right after its "
                         "election; a replica killed, then the primary stopped)")
    ap.add_argument("--disk-loss", action="store_true",
                    help="the nemesis also loses a replica's disk: a replacement starts empty with --join")
    ap.add_argument("--graceful", action="store_true",
                    help="the nemesis also stops the primary with SIGTERM (it hands over first) and restarts it")
    ap.add_argument("--fsync-errors", action="store_true",
                    help="the nemesis also fails the next fsync of the primary or a replica (needs "
                         "--power-loss): the node must stop (exit 70) and rejoin once started again")
    ap.add_argument("--client-partitions", action="store_true",
                    help="the clients reach the nodes through a fault proxy; the nemesis also cuts the "
                         "links between the clients and one node, or holds their bytes (answers lost "
                         "after the node acted)")
    ap.add_argument("--write-errors", action="store_true",
                    help="the nemesis also fails the next writes of the primary's or a replica's store (an "
                         "I/O error of a write, not of an fsync; needs --power-loss): the node must stop "
                         "(exit 70) and rejoin once started again")
    ap.add_argument("--slow-links", action="store_true",
                    help="the nemesis also makes every byte between one node and the others late (by up "
                         "to the failover timeout) for a while (needs --partitions)")
    ap.add_argument("--disk-low", action="store_true",
                    help="the nemesis also fills the primary's disk (and now and then a replica's) past its "
                         "reserve for a while: the primary must hand over to a member with room")
    ap.add_argument("--purges", action="store_true",
                    help="a second queue with a producer and a consumer of its own is purged every 1-3 s; "
                         "the checker counts any message delivered after a purge that confirmed it gone")
    ap.add_argument("--upgrade-from", default=None, metavar="REV",
                    help="start every node on an older build, REV's node/ and spooler/ (a git revision of "
                         "this checkout, or 'previous': the last commit of the release before this one); the "
                         "nemesis's first rounds upgrade one node each to this checkout's build, the primary last")
    ap.add_argument("--sdk-clients", action="store_true",
                    help="a service on the asyncio SDK (auto-batched sends on its Session stream, receives, "
                         "acks, nacks, renewals) runs beside the HTTP clients, its calls recorded and checked "
                         "as theirs are")
    ap.add_argument("--faults", default="",
                    help="comma-separated fault kinds each seed's nemesis makes first, in order "
                         "(e.g. kill_primary_twice,replace_replica); the load runs on until they are over")
    ap.add_argument("--json", default=None, help="also write every report (JSON lines) to this file")
    ap.add_argument("--node-args", default="",
                    help="more flags for every node, e.g. '--log-keep-records 50' (a short log tail: "
                         "compaction, segment rows taking their bodies in, snapshots for lagging replicas)")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running drill's finally blocks end its nodes by pid
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    for flag, on in (("--fsync-errors", args.fsync_errors), ("--write-errors", args.write_errors)):
        if on and not args.power_loss:
            ap.error(f"{flag} needs --power-loss (the nodes' test VFS is what fails the call)")
    if args.slow_links and not args.partitions:
        ap.error("--slow-links needs --partitions (the proxy between the nodes makes the links slow)")
    seeds = parse_seeds(args.seeds)
    faults = tuple(f for f in args.faults.split(",") if f)
    if set(faults) - FAULT_KINDS:
        ap.error(f"--faults: unknown kinds {sorted(set(faults) - FAULT_KINDS)}; known: {', '.join(sorted(FAULT_KINDS))}")
    root = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="spooler-drills-"))
    os.makedirs(root, exist_ok=True)
    old_tree = None
    if args.upgrade_from:
        rev = args.upgrade_from
        old_tree = os.path.join(root, "older-build")
        if os.path.exists(old_tree):
            shutil.rmtree(old_tree)
        try:
            if rev == "previous":
                _, rev = builds.previous_release(builds.repo_root())
            builds.extract(rev, old_tree, builds.repo_root())
        except (LookupError, subprocess.SubprocessError, OSError) as e:
            why = getattr(e, "stderr", None)
            why = why.decode(errors="replace").strip() if isinstance(why, bytes) and why else e
            ap.error(f"--upgrade-from {args.upgrade_from}: cannot build it from this checkout's history "
                     f"(a shallow clone, or no git?): {why}")
        print(f"older build: {builds.version_at(builds.repo_root(), rev)} ({rev[:12]})", flush=True)
    print(f"drills: seeds {args.seeds} ({len(seeds)}), {args.duration:g}s each, {args.nodes} nodes"
          f"{', power loss' if args.power_loss else ''}{', partitions' if args.partitions else ''}"
          f"{', cascades' if args.cascades else ''}{', disk loss' if args.disk_loss else ''}"
          f"{', graceful stops' if args.graceful else ''}{', fsync errors' if args.fsync_errors else ''}"
          f"{', write errors' if args.write_errors else ''}"
          f"{', client partitions' if args.client_partitions else ''}"
          f"{', slow links' if args.slow_links else ''}{', SDK clients' if args.sdk_clients else ''}"
          f"{', disks low' if args.disk_low else ''}{', purges' if args.purges else ''}"
          f"{', upgrading from ' + args.upgrade_from if args.upgrade_from else ''}"
          f"{', node flags ' + repr(args.node_args) if args.node_args else ''}, in {root}",
          flush=True)
    reports = []
    for seed in seeds:
        wd = os.path.join(root, f"seed-{seed}")
        if os.path.exists(wd):
            shutil.rmtree(wd)
        t0 = time.monotonic()
        try:
            r = run_drill(seed, args.duration, nodes=args.nodes, workdir=wd, power_loss=args.power_loss,
                          partitions=args.partitions, cascades=args.cascades, disk_loss=args.disk_loss,
                          graceful=args.graceful, fsync_errors=args.fsync_errors,
                          write_errors=args.write_errors, faults=faults, node_args=tuple(shlex.split(args.node_args)),
                          client_partitions=args.client_partitions, slow_links=args.slow_links,
                          sdk_clients=args.sdk_clients, disk_low=args.disk_low,
                          purges=args.purges, upgrade_from=old_tree)
        except Exception as e:  # noqa: BLE001 - a drill that cannot finish is a failing seed
            import traceback
            traceback.print_exc()
            print(f"--- seed {seed}: drill error: {e!r} (kept {wd})", flush=True)
            r = {"seed": seed, "required_zeros_ok": False, "error": repr(e), "wall_s": time.monotonic() - t0,
                 "failover_unavailability": {"windows": [], "never_recovered": 0},
                 "nodes_agree": None, "integrity_ok": None}
            reports.append(r)
            continue
        reports.append(r)
        print(f"\n--- seed {seed} ({r['wall_s']:.1f}s wall, nemeses {json.dumps(r['nemesis_counts'])},"
              f" drain {'complete' if r['drain_complete'] else 'INCOMPLETE'}) ---")
        print(format_table(r))
        for x in r.get("unexpected_exits") or ():
            print(f"UNEXPECTED EXIT: node {x['node']} exited with {x['returncode']} at t={x['t']:.3f}")
        for x in r.get("duplicate_other_examples") or ():
            print(f"duplicate without a cause: {json.dumps(x, default=str)}")
        for n in r.get("notes") or ():
            print(f"note: {n}")
        for t in r.get("thread_errors") or ():
            print(f"thread error: {t}")
        if r["required_zeros_ok"]:
            if not args.keep:
                shutil.rmtree(wd, ignore_errors=True)
        else:
            print(f"FAILED: history {r['history']}, node logs {wd}/nodes/n*/n*.log")
        sys.stdout.flush()
        if args.json:
            with open(args.json, "a") as fh:
                slim = {k: v for k, v in r.items() if not k.endswith("_details")}
                fh.write(json.dumps(slim, default=str) + "\n")
    if old_tree and not args.keep and all(r["required_zeros_ok"] for r in reports):
        shutil.rmtree(old_tree, ignore_errors=True)  # (kept with a failing seed: its nodes ran it)
    print()
    print(summarize(reports))
    if not args.workdir and not args.keep:
        try:
            os.rmdir(root)  # the directory it made itself, once every seed passed (emptied): not left behind
        except OSError:
            pass  # a failing seed's files are in it: kept
    return 0 if all(r["required_zeros_ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
