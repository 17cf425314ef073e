"""bench/summary.py: one run's JSON as the tables docs/benchmarks.md takes."""
from __future__ import annotations

import statistics

from bench import run as bench_run
from bench.summary import table


def _result(js_in_flight=20_000, seq_p50=1.1, peers=True, sigkill=(0.06, 0.08, 0.07)):
    one = {"median": {"send_sequential_p50_ms": 0.6, "send_64_in_flight_per_s": 40_000,
                      "send_batch_100_per_s": 90_000, "receive_ack_per_s": 50_000},
           "samples": {"send_sequential_p50_ms": [0.5, 0.6, 0.7], "send_batch_100_per_s": [80_000, 90_000, 95_000]}}
    three = {"median": {"send_sequential_p50_ms": seq_p50, "send_64_in_flight_per_s": 33_000,
                        "send_batch_100_per_s": 70_000, "receive_ack_per_s": 39_000}}
    peer_med = {"nats-jetstream": {"median": {"send_sequential_p50_ms": 0.5, "send_64_in_flight_per_s": js_in_flight,
                                              "receive_ack_per_s": 26_000}},
                "rabbitmq-quorum": {"median": {"send_sequential_p50_ms": 0.8, "send_64_in_flight_per_s": 5_000,
                                               "receive_ack_per_s": 5_500}}} if peers else {}
    fo = {"sigkill": {"samples_s": list(sigkill), "median_s": statistics.median(sigkill), "failover_timeout_s": 2.0},
          "sigstop": {"samples_s": [2.1, 2.05, 2.2], "median_s": 2.1, "failover_timeout_s": 2.0},
          "peers": {"nats-jetstream": {"median_s": 5.0}}}
    cl = {"spooler": three, "failover": fo}
    cl["targets"] = bench_run.cluster_targets(cl, peer_med, 2, {"median": {"send_batch_100_per_s": 110_000}})
    return {"date_utc": "2026-12-07T00:00:00Z", "machine": {"git_commit": "abc1234", "nproc": 2},
            "spooler": one, "targets": bench_run.targets(one, 2), "peers": peer_med, "cluster": cl,
            "jobs": {"jobs_per_s": 500.4, "workers": 4, "target_jobs_per_s": 150.0, "meets_target": True}}


def _row(text: str, label: str) -> list:
    lines = [ln for ln in text.splitlines() if ln.startswith(f"| {label} ")]
    assert len(lines) == 1, (label, text)
    return [c.strip() for c in lines[0].strip("|").split("|")]


def test_each_target_reads_met_or_missed_from_the_run_with_its_samples_and_the_bare_stack():
    t = table(_result())
    assert _row(t, "1 node, sequential p50") == ["1 node, sequential p50", "<= 0.7", "0.600 (0.500, 0.600, 0.700)",
                                                 "–", "met"]
    assert _row(t, "1 node, batch of 100")[2:] == ["90,000 (80,000, 90,000, 95,000)", "–", "missed by 10.0%"]
    assert _row(t, "3 nodes, sequential p50")[-1] == "missed by 10.0%"
    # 33,000 over JetStream's 20,000: 1.650x, met; the bare stack beside the batch target
    assert _row(t, "3 nodes, 64 in flight")[2:] == ["33,000, 1.650x", "–", "met"]
    assert _row(t, "3 nodes, batch of 100")[3] == "110,000"
    assert _row(t, "failover after SIGKILL")[2] == "0.070 (0.060, 0.080, 0.070)"
    assert "500 jobs/s with 4 workers (target 150: met)" in t


def test_a_slower_run_reads_missed_and_the_ratios_follow_the_peers_of_that_run():
    t = table(_result(js_in_flight=25_000, seq_p50=0.95))
    assert _row(t, "3 nodes, 64 in flight")[-1] == "missed by 12.0%"  # 33,000 against 1.5 x 25,000
    assert _row(t, "3 nodes, sequential p50")[-1] == "met"
    side = _row(t, "send, 64 in flight, msg/s")
    assert side == ["send, 64 in flight, msg/s", "40,000", "33,000", "25,000", "5,000", "1.320", "6.600"]
    assert _row(t, "failover after SIGKILL, s")[1:] == ["–", "0.070", "5.000", "–", "0.014", "–"]
    # the peers' failover scripts kill only: nothing of theirs beside a SIGSTOP
    assert _row(t, "failover after SIGSTOP, s")[1:] == ["–", "2.100", "–", "–", "–", "–"]
    assert "Ratios are the three-node median" in t


def test_a_target_met_by_the_runs_that_gave_a_figure_says_how_many_gave_none():
    r = _result(sigkill=(0.06,))
    fo = r["cluster"]["failover"]["sigkill"]
    fo["error"] = "2 of 3 runs gave no figure"
    r["peers"]["rabbitmq-quorum"] = {"skipped": "rabbitmq-server is not installed"}
    t = table(r)
    assert _row(t, "failover after SIGKILL")[-1] == "met (2 of 3 runs gave no figure)"
    assert _row(t, "failover after SIGSTOP")[-1] == "met"
    assert "- failover after SIGKILL: error: 2 of 3 runs gave no figure" in t.splitlines()
    assert "- RabbitMQ QQ R3: skipped: rabbitmq-server is not installed" in t.splitlines()
    assert "RabbitMQ" not in t.split("| figure |", 1)[1].splitlines()[0]


def test_what_no_system_measured_has_no_row():
    r = _result()
    del r["cluster"]["failover"]
    for part in (r["spooler"], r["cluster"]["spooler"], *r["peers"].values()):
        part["median"].pop("receive_ack_per_s", None)
    r["cluster"]["targets"] = bench_run.cluster_targets(r["cluster"], r["peers"], 2)
    t = table(r)
    assert not [ln for ln in t.splitlines() if ln.startswith(("| failover after SIGKILL, s", "| receive + ack,"))]
    assert _row(t, "3 nodes, receive + ack")[-1] == "nats-jetstream not measured in this run"
    assert _row(t, "failover after SIGKILL")[2:] == ["–", "–", "not measured"]
    assert "Failed or skipped" not in t


def test_without_peers_the_relative_targets_are_not_measured_and_no_peer_column_appears():
    t = table(_result(peers=False))
    assert _row(t, "3 nodes, 64 in flight")[-1] == "nats-jetstream not measured in this run"
    assert "JetStream" not in t.split("| figure |", 1)[1].splitlines()[0]
    assert _row(t, "send, 64 in flight, msg/s") == ["send, 64 in flight, msg/s", "40,000", "33,000"]
    assert "Ratios are" not in t
