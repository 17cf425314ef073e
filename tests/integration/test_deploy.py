"""The manifests in deploy/, run as written.

Containers cannot be built here (no image registry), so each compose service is
run as the container would run it: ``spooler-node`` with no flags, and exactly
the environment the service gets (the Dockerfile's ENV, then the service's own
``environment`` with compose's ``${VAR:?...}`` filled in). Only what Docker
itself provides is replaced: every service's host name becomes 127.0.0.1 and
its container ports become free ports here, and the data volume becomes a
directory. So a misspelt variable, a peer list that does not match the
services, a data directory that is not the mounted volume, a healthcheck that
asks the wrong port, or a port mapping to the wrong container port fails here.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from integration.test_cluster import primary_of, until_ok, view
from node.main import EXIT_STORE_FAILED
from nodeproc import NodeProc, free_ports, wait_until
from spooler.http import HttpClient

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY = "deploy-test-admin-key"
CLUSTER_KEY = "deploy-test-cluster-key"


def dockerfile_env() -> dict:
    env = {}
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def interpolate(value: str, outer: dict) -> str:
    """compose's ${VAR}, ${VAR:-default} and ${VAR:?message}."""
    def one(m):
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if outer.get(name):
            return outer[name]
        if op == ":?":
            raise AssertionError(f"compose would refuse to start: {arg}")
        return arg if op == ":-" else ""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:[-?])?([^}]*)\}", one, value)


def hostport(s: str) -> tuple:
    host, _, port = s.rpartition(":")
    return host, int(port)


def services_of(compose_file: str) -> dict:
    """{service: environment as the container gets it}, and checks of what the
    file promises beside the environment: the data volume, published ports, health."""
    doc = yaml.safe_load((DEPLOY / compose_file).read_text())
    image_env = dockerfile_env()
    out = {}
    for name, svc in doc["services"].items():
        env = dict(image_env)
        env.update({k: interpolate(str(v), {"SPOOLER_ADMIN_KEY": KEY, "SPOOLER_CLUSTER_KEY": CLUSTER_KEY})
                    for k, v in svc["environment"].items()})
        out[name] = (env, svc)
    return out


def check_layout(services: dict) -> None:
    ids = {env["SPOOLER_ID"]: name for name, (env, _) in services.items()}
    assert len(ids) == len(services), "two services share a SPOOLER_ID"
    published = []
    for name, (env, svc) in services.items():
        peers = dict(p.split("=", 1) for p in env["SPOOLER_PEERS"].split(","))
        assert set(peers) == set(ids), f"{name}: SPOOLER_PEERS names {sorted(peers)}, the services are {sorted(ids)}"
        # every member holds the cluster's key (a member without it could not replicate)
        assert env.get("SPOOLER_CLUSTER_KEY") == CLUSTER_KEY, f"{name}: no SPOOLER_CLUSTER_KEY"
        for nid, addr in peers.items():
            host, port = hostport(addr)
            target_env = services[ids[nid]][0]
            assert host == ids[nid], f"{name}: peer {nid} is at host {host}, its service is {ids[nid]}"
            assert port == hostport(target_env["SPOOLER_GRPC"])[1], f"{name}: peer {nid}'s port is not its gRPC port"
        mounts = [v.split(":", 1)[1] for v in svc.get("volumes", [])]
        assert env["SPOOLER_DATA"] in mounts, f"{name}: SPOOLER_DATA {env['SPOOLER_DATA']} is not a mounted volume"
        for var in ("SPOOLER_HTTP", "SPOOLER_GRPC"):  # the other containers and the published ports reach it
            assert hostport(env[var])[0] in ("0.0.0.0", "[::]"), f"{name}: {var} listens on {env[var]} only"
        http_port, grpc_port = hostport(env["SPOOLER_HTTP"])[1], hostport(env["SPOOLER_GRPC"])[1]
        container_ports = set()
        for p in svc.get("ports", []):
            host_port, _, container_port = str(p).rpartition(":")
            published.append(host_port)
            container_ports.add(int(container_port))
        assert container_ports == {http_port, grpc_port}, f"{name}: publishes {container_ports}, serves {http_port}, {grpc_port}"
    assert len(published) == len(set(published)), "two services publish the same host port"


def start_services(services: dict, base: Path) -> dict:
    """Start every service's node from its environment, on 127.0.0.1."""
    names = list(services)
    grpc_ports = dict(zip(names, free_ports(len(names))))
    ids = {env["SPOOLER_ID"]: name for name, (env, _) in services.items()}
    nodes = {}
    try:
        for name, (env, _) in services.items():
            env = dict(env)
            peers = dict(p.split("=", 1) for p in env["SPOOLER_PEERS"].split(","))
            env["SPOOLER_PEERS"] = ",".join(f"{nid}=127.0.0.1:{grpc_ports[ids[nid]]}" for nid in peers)
            env["SPOOLER_GRPC"] = f"127.0.0.1:{grpc_ports[name]}"
            env["SPOOLER_HTTP"] = "127.0.0.1:0"
            env["SPOOLER_DATA"] = str(base / name)
            nodes[env["SPOOLER_ID"]] = NodeProc(str(base / name), node_id=env["SPOOLER_ID"], admin_key=KEY,
                                                env=env, env_only=True).start()
    except BaseException:
        for n in nodes.values():
            n.kill()
        raise
    return nodes


def run_healthcheck(svc: dict, node: NodeProc) -> int:
    cmd = svc["healthcheck"]["test"]
    assert cmd[0] == "CMD" and cmd[1] == "python", cmd
    args = [a.replace("127.0.0.1:8080", node.http_url.removeprefix("http://")) for a in cmd[2:]]
    return subprocess.run([sys.executable, *args], timeout=30).returncode


@pytest.mark.parametrize("compose_file,n", [("docker-compose.yml", 3), ("docker-compose-5.yml", 5)])
def test_compose_cluster_runs_from_its_manifest(tmp_path, compose_file, n):
    services = services_of(compose_file)
    assert len(services) == n
    check_layout(services)
    nodes = start_services(services, tmp_path)
    try:
        for name, (_, svc) in services.items():
            assert run_healthcheck(svc, nodes[services[name][0]["SPOOLER_ID"]]) == 0
        wait_until(lambda: primary_of(nodes), timeout_s=20, what="a primary")
        # every node follows the same primary, and knows every member
        def agreed():
            vs = [view(x) for x in nodes.values()]
            return all(v and v["primary"] and v["primary"] == vs[0]["primary"] and len(v["nodes"]) == n for v in vs)
        wait_until(agreed, timeout_s=20, what="every node naming the same primary")
        first, last = list(nodes.values())[0], list(nodes.values())[-1]
        a, b = HttpClient(first.http_url, KEY, timeout_s=10), HttpClient(last.http_url, KEY, timeout_s=10)
        until_ok(lambda: a.put_queue("jobs"))
        mid = until_ok(lambda: a.send("jobs", b"from the manifest"))["id"]
        # the quorum survives losing a minority: kill the primary (and on five nodes one replica too)
        pid, _ = primary_of(nodes)
        doomed = [pid] + ([next(i for i in nodes if i != pid)] if n == 5 else [])
        for i in doomed:
            nodes[i].kill()
        alive = {i: x for i, x in nodes.items() if i not in doomed}
        wait_until(lambda: primary_of(alive), timeout_s=20, what="a new primary among the survivors")
        c = HttpClient(next(iter(alive.values())).http_url, KEY, timeout_s=10)
        got = until_ok(lambda: c.receive("jobs", wait_s=5))
        assert got.id == mid and got.body == b"from the manifest" and got.retry_count == 0
        until_ok(lambda: c.ack(got.token) or True, what="the ack")
    finally:
        for x in nodes.values():
            x.kill()


def test_systemd_unit_names_only_real_settings():
    unit = (DEPLOY / "systemd" / "spooler-node.service").read_text()
    example = re.findall(r"^#\s+(SPOOLER_[A-Z_]+)=", unit, re.M)
    assert "SPOOLER_PEERS" in example and "SPOOLER_ID" in example
    help_text = subprocess.run([sys.executable, "-m", "node.main", "--help"], capture_output=True, text=True,
                               timeout=30, env={k: v for k, v in os.environ.items() if not k.startswith("SPOOLER_")}).stdout
    known = set(re.findall(r"SPOOLER_[A-Z_]+", help_text))
    assert set(example) <= known, f"the unit's example names settings the node does not read: {set(example) - known}"
    status = re.search(r"^RestartPreventExitStatus=(\d+)$", unit, re.M)
    assert status and int(status.group(1)) == EXIT_STORE_FAILED


def test_the_build_context_leaves_out_the_working_tree_but_not_what_the_image_copies():
    """The compose files build from the repository root: .dockerignore keeps a
    virtualenv, a node's data and the spool out of the context (a make run
    leaves them there), and none of what the Dockerfile COPYs."""
    ignored = [ln.strip().rstrip("/") for ln in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for must in (".venv", "var", ".spoolctl", ".git"):
        assert must in ignored, must
    copied = [src for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
              for src in shlex.split(line[5:])[:-1]]
    assert {"pyproject.toml", "spooler", "node"} <= set(copied), copied
    for src in copied:
        assert not any(src == ig or src.startswith(ig + "/") for ig in ignored), src
