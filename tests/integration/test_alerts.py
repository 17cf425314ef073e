"""deploy/prometheus/spooler-alerts.yml reads only metrics a running cluster
exposes, under the names it exposes them by; and where promtool is installed,
the rules load and pass their unit tests (spooler-alerts.test.yml)."""
import os
import re
import shutil
import subprocess
import urllib.request

import pytest
import yaml

from nodeproc import start_cluster, wait_until
from spooler import Client

RULES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "prometheus")
RULES = os.path.join(RULES_DIR, "spooler-alerts.yml")
# the node's own metrics, not Prometheus's (up) nor PromQL's (rate, by, ...)
NAME = re.compile(r"\bspooler_[a-z0-9_]+\b")


def _rules() -> list:
    with open(RULES) as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def _text(node) -> str:
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _exposed(node) -> set:
    """Every sample name and family name in the node's /metrics."""
    names = set()
    for line in _text(node).splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_alert_says_how_bad_and_what_happened():
    rules = _rules()
    assert len(rules) >= 10
    for r in rules:
        assert r["alert"].startswith("Spooler") and r["expr"].strip(), r
        assert r["labels"]["severity"] in ("warning", "critical"), r
        assert r["annotations"]["summary"] and r["annotations"]["description"], r


def test_every_metric_the_alerts_read_is_one_a_cluster_exposes(tmp_path):
    """Names taken from the rules' expressions are looked up in the /metrics of a
    3-node cluster's primary (which alone has the member figures) and of a
    replica, after a queue has seen a send, a nack and a failure: a metric
    renamed or dropped in the node leaves an alert that can never fire."""
    wanted = {n for r in _rules() for n in NAME.findall(r["expr"])}
    assert {"spooler_is_primary", "spooler_member_disk_low", "spooler_queue_events_total",
            "spooler_commit_seconds_bucket", "spooler_build_info"} <= wanted, wanted
    nodes = start_cluster(str(tmp_path), 3, 2.0)
    try:
        def primary():
            for i, n in nodes.items():
                try:
                    if n.get("/v1/cluster")[1]["role"] == "primary":
                        return i
                except Exception:
                    pass
            return None
        p = wait_until(primary, 20, what="a primary")
        with Client(nodes[p].grpc_target, nodes[p].admin_key, timeout_s=30) as c:
            c.put_queue("alerted", maxRetries=0)
            c.send("alerted", b"x")
            [m] = c.receive("alerted")
            c.nack(m.token)  # out of retries: to the failure queue
        others = [i for i in nodes if i != p]
        wait_until(lambda: all(f'spooler_member_disk_low{{member="{o}"}} 0.0' in _text(nodes[p]) for o in others),
                   20, what="both members' answers on the primary")
        exposed = _exposed(nodes[p]) | _exposed(nodes[others[0]])
        assert wanted <= exposed, sorted(wanted - exposed)
    finally:
        for n in nodes.values():
            n.kill()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Prometheus) is not installed")
def test_the_alert_rules_load_and_pass_their_unit_tests():
    for args in (["check", "rules", "spooler-alerts.yml"], ["test", "rules", "spooler-alerts.test.yml"]):
        out = subprocess.run(["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
