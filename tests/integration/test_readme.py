"""The README's examples, run as written against a live node: the curl
walkthrough, the spoolctl lines, the job runner lines and the Python example.
Only the addresses (the node listens on ephemeral ports), the admin key and the
`.venv/bin/` prefix (the test's own environment) change."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BIN = Path(sys.executable).parent
KEY = "dev-admin-key"  # the key the README uses, as `make run` does


def blocks(lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def block_with(lang: str, marker: str) -> str:
    [b] = [b for b in blocks(lang) if marker in b]
    return b


def _local(text: str, node) -> str:
    assert KEY in text
    return (text.replace("http://127.0.0.1:8080", node.http_url).replace("127.0.0.1:50051", node.grpc_target)
            .replace(".venv/bin/", f"{BIN}/").replace(KEY, node.admin_key))


def _bash(script: str, cwd, timeout_s: float = 120) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPOOLER_", "SPOOLCTL_"))}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s, env=env)
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p.stdout


def test_the_curl_walkthrough_works_as_written(node, tmp_path):
    out = _bash(_local(block_with("sh", "curl -s"), node), tmp_path)
    lines = out.splitlines()
    assert lines.count("204") == 2, out  # the nack, then the ack
    assert '{"moved": 1}' in lines, out
    assert re.search(r'^resize image 42\{"expiresAt": "[^"]+Z"\}$', out, re.M), out  # the body, then the renew
    docs = [json.loads(x) for x in lines if x.startswith('{"name"')]
    failed = next(d for d in docs if d["name"] == "jobs.failed")
    assert failed["stats"]["visible"] == 1, failed  # before the redrive
    final = docs[-1]
    assert final["name"] == "jobs" and final["stats"]["ackedTotal"] == 1 and final["stats"]["failedTotal"] == 1
    assert final["stats"]["visible"] == final["stats"]["leased"] == 0
    assert re.search(r"(?i)^spooler-retry-count: 0$", out, re.M), out


def test_the_spoolctl_lines_work_as_written(node, tmp_path):
    out = _bash(_local(block_with("sh", "spoolctl queue create"), node), tmp_path)
    assert out.startswith("created mail:"), out
    # the body exactly as it was sent (no newline added), then the stats document
    head, rest = out.split("\nhello", 1)
    stats = json.loads(rest.splitlines()[0])
    assert any(q["name"] == "mail" and q["stats"]["ackedTotal"] == 1 for q in stats["queues"]), stats
    assert any(x.startswith("spk_") for x in out.splitlines()), out  # the new key's secret, printed once
    assert "(primary)" in out, out


def _by_line(script: str, cwd) -> list:
    """Run a block of one-line commands; [(command, its stdout)] in order."""
    cmds = [x for x in script.splitlines() if x.strip() and not x.lstrip().startswith("#")]
    marked = "".join(f"{c}\necho '@@@{k}'\n" for k, c in enumerate(cmds))
    out = _bash(marked, cwd)
    parts = re.split(r"^@@@\d+\n", out, flags=re.M)
    assert len(parts) == len(cmds) + 1 and parts[-1] == "", out
    return list(zip(cmds, parts))


def test_the_job_runner_lines_work_as_written(tmp_path):
    steps = _by_line(block_with("sh", "submit --max-retries 2").replace(".venv/bin/", f"{BIN}/"), tmp_path)
    out = dict((c.split("#")[0].split()[1] if c.startswith("$S") else c.split("=")[0], o) for c, o in steps)
    assert out["output"] == "hello\n"  # the first attempt's stdout, exactly
    status = out["status"]
    job = re.match(r"job (\S+): dead\n", status).group(1)
    assert status.count("  attempt ") == 3, status  # the first run and its 2 retries
    dead = json.loads(out["list"])
    [j] = [j for j in dead["jobs"] if j["id"] == job]  # listed before the retry brings it back
    assert j["state"] == "dead" and [a["exit_code"] for a in j["attempts"]] == [1, 1, 1], j
    assert out["retry"] == f"{job}\n"


def test_the_python_example_works_as_written_and_ends(node, tmp_path):
    code = _local(block_with("python", "from spooler import Client"), node)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == ["b'hello' 0", "b'world'"], p.stdout
