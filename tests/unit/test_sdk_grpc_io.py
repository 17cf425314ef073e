"""The SDK's gRPC I/O path (spooler/grpc_io.py): it changes nothing in its user's
process unless SPOOLER_GRPC_IO=legacy asks, and says so when the ask came too late."""
import os
import subprocess
import sys

import pytest

from spooler import grpc_io

PROBE = ("import os, sys, warnings; warnings.simplefilter('always')\n"
         "{first}\n"
         "import spooler, grpc\n"
         "print(spooler.GRPC_IO, os.environ.get('GRPC_EXPERIMENTS', '-'))\n")


def _run(env_extra: dict, first: str = "") -> tuple:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "SPOOLER_GRPC_IO")}
    env.update(env_extra)
    p = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split(), p.stderr


def test_the_sdk_leaves_grpcs_io_path_alone_unless_asked():
    env: dict = {}
    assert grpc_io.prepare(env, modules={}, default="default") == "default" and env == {}
    out, err = _run({})
    assert out == ["default", "-"] and "SPOOLER_GRPC_IO" not in err


def test_spooler_grpc_io_legacy_puts_the_sdks_process_on_the_older_path():
    env = {"SPOOLER_GRPC_IO": "legacy"}
    assert grpc_io.prepare(env, modules={}, default="default") == "legacy"
    assert env["GRPC_EXPERIMENTS"] == grpc_io.LEGACY
    out, _ = _run({"SPOOLER_GRPC_IO": "legacy"})
    assert out == ["legacy", grpc_io.LEGACY]
    # a node started in such a process's environment reads it as its own choice, not the operator's
    assert grpc_io.prepare(dict(env), modules={}) == "legacy"


def test_an_ask_that_comes_after_grpcs_import_or_names_no_path_is_said_out_loud():
    out, err = _run({"SPOOLER_GRPC_IO": "legacy"}, first="import grpc")
    assert out == ["too", "late", "-"] and "came too late" in err
    out, err = _run({"SPOOLER_GRPC_IO": "fast"})
    assert out == ["invalid", "-"] and "SPOOLER_GRPC_IO must be one of legacy, default, not 'fast'" in err


@pytest.mark.integration  # (it starts a spooler-node, which stops at once)
@pytest.mark.parametrize("module", ["node.main", "node.process"])
def test_a_node_refusing_an_unknown_io_path_says_it_once_without_the_sdks_warning(tmp_path, module):
    """The SDK's warning ("grpcio's default I/O path stays") was printed by a node
    too, just before the node refused the same setting and exited (as
    ``python -m node.process`` until 0.4.37, an outside audit found)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "SPOOLER_GRPC_IO")}
    env["SPOOLER_GRPC_IO"] = "fast"
    p = subprocess.run([sys.executable, "-m", module, "--data", str(tmp_path / "d")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert p.stderr.strip() == "spooler-node: SPOOLER_GRPC_IO must be one of legacy, default, not 'fast'", p.stderr
