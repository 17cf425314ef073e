"""Defaults, limits and the test knobs of the job runner (one place, published by
``spoolctl capabilities --json``).

The two ``SPOOLCTL_TEST_*`` variables exist so a test suite can compress the
30-second reap cycle; they are validated against their bounds and an
out-of-bounds value is an error, never silently clamped.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from spooler import __version__
from spooler.errors import InvalidArgument

ENV_SPOOL_DIR = "SPOOLCTL_DIR"
ENV_TEST_HEARTBEAT_INTERVAL = "SPOOLCTL_TEST_HEARTBEAT_INTERVAL"
ENV_TEST_REAP_THRESHOLD = "SPOOLCTL_TEST_REAP_THRESHOLD"
ENV_BUSY_TIMEOUT = "SPOOLCTL_BUSY_TIMEOUT"

DEFAULT_SPOOL_DIR = "./.spoolctl"
DEFAULT_HEARTBEAT_INTERVAL_S = 5.0
REAP_THRESHOLD_FLOOR_S = 30.0
REAP_HEARTBEAT_MULTIPLE = 4
DEFAULT_BUSY_TIMEOUT_S = 5.0
DEFAULT_MAX_RETRIES = 3
DEFAULT_MAX_CRASHES: Optional[int] = None  # unbounded
DEFAULT_TIMEOUT_S: Optional[float] = None  # no timeout
DEFAULT_PRIORITY = 0
DEFAULT_CONCURRENCY = 1
TERM_GRACE_S = 5.0            # SIGTERM -> wait this long -> SIGKILL
BACKOFF_BASE_S = 2.0
BACKOFF_CAP_S = 60.0
IDLE_POLL_S = 0.2             # how often an idle worker looks for work
REMOTE_RECEIVE_WAIT_S = 2.0   # long-poll wait of a cluster worker

PRIORITY_MIN, PRIORITY_MAX = -1_000_000, 1_000_000
MAX_RETRIES_MAX = 1000
MAX_CRASHES_MAX = 1000
TIMEOUT_S_MAX = 30 * 86400.0
CONCURRENCY_MAX = 64
COMMAND_ARGS_MAX = 4096
COMMAND_BYTES_MAX = 128 * 1024
IDEMPOTENCY_KEY_BYTES_MAX = 256
BUSY_TIMEOUT_S_MIN, BUSY_TIMEOUT_S_MAX = 0.0, 600.0
HEARTBEAT_INTERVAL_S_MIN, HEARTBEAT_INTERVAL_S_MAX = 1.0, 300.0   # the --heartbeat-interval flag
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 10_000, 1_000_000
OUTPUT_JSON_BYTES_MAX = 16 * 1024 * 1024

# name -> (min, max) in seconds, inclusive
TEST_KNOB_BOUNDS = {
    ENV_TEST_HEARTBEAT_INTERVAL: (0.05, 300.0),
    ENV_TEST_REAP_THRESHOLD: (0.1, 3600.0),
}


# A worker whose PID probes alive (with the marker) but whose heartbeat a reaping
# worker has itself watched stand still this many reap thresholds is hung: reaped.
HUNG_REAP_MULTIPLE = 10


def reap_threshold_s(heartbeat_interval_s: float, override_s: Optional[float] = None) -> float:
    """The age past which a running job's heartbeat makes it a reap candidate."""
    if override_s is not None:
        return override_s
    return max(REAP_HEARTBEAT_MULTIPLE * heartbeat_interval_s, REAP_THRESHOLD_FLOOR_S)


def _seconds(name: str, raw: str, lo: float, hi: float) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(v) or not lo <= v <= hi:
        raise InvalidArgument(f"{name}={raw!r} is outside its bounds [{lo:g}, {hi:g}] seconds")
    return v


def test_knob(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    env = os.environ if env is None else env
    raw = env.get(name, "")
    if raw.strip() == "":
        return None
    lo, hi = TEST_KNOB_BOUNDS[name]
    return _seconds(name, raw.strip(), lo, hi)


@dataclass(frozen=True)
class Settings:
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    reap_threshold_override_s: Optional[float] = None
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S

    @property
    def own_reap_threshold_s(self) -> float:
        return reap_threshold_s(self.heartbeat_interval_s, self.reap_threshold_override_s)


def load(env: Optional[Mapping[str, str]] = None, heartbeat_interval_s: Optional[float] = None,
         busy_timeout_s: Optional[float] = None) -> Settings:
    """Settings from flags, then env, then defaults. Raises InvalidArgument on a bad value.

    The heartbeat test knob wins over the flag: it exists to make a whole test
    run fast without threading a flag through every command.
    """
    env = os.environ if env is None else env
    hb = test_knob(ENV_TEST_HEARTBEAT_INTERVAL, env)
    if hb is None:
        if heartbeat_interval_s is not None:
            hb = _seconds("--heartbeat-interval", str(heartbeat_interval_s),
                          HEARTBEAT_INTERVAL_S_MIN, HEARTBEAT_INTERVAL_S_MAX)
        else:
            hb = DEFAULT_HEARTBEAT_INTERVAL_S
    reap = test_knob(ENV_TEST_REAP_THRESHOLD, env)
    if busy_timeout_s is not None:
        busy = _seconds("--busy-timeout", str(busy_timeout_s), BUSY_TIMEOUT_S_MIN, BUSY_TIMEOUT_S_MAX)
    elif env.get(ENV_BUSY_TIMEOUT, "").strip():
        busy = _seconds(ENV_BUSY_TIMEOUT, env[ENV_BUSY_TIMEOUT].strip(), BUSY_TIMEOUT_S_MIN, BUSY_TIMEOUT_S_MAX)
    else:
        busy = DEFAULT_BUSY_TIMEOUT_S
    return Settings(heartbeat_interval_s=hb, reap_threshold_override_s=reap, busy_timeout_s=busy)


def capabilities(env: Optional[Mapping[str, str]] = None) -> dict:
    """The published contract of this build (stable keys; values may grow)."""
    from spooler.jobs import states

    env = os.environ if env is None else env
    knobs = {}
    for name, (lo, hi) in TEST_KNOB_BOUNDS.items():
        knobs[name] = {"unit": "s", "min": lo, "max": hi, "value": test_knob(name, env),
                       "default": None, "purpose": "test only; compresses the reap cycle"}
    return {
        "name": "spoolctl",
        "version": __version__,
        "backends": ["local", "spooler"],
        "states": list(states.STATES),
        "terminal_states": sorted(states.TERMINAL),
        "failure_reasons": list(states.FAILURE_REASONS),
        "defaults": {
            "spool_dir": DEFAULT_SPOOL_DIR,
            "heartbeat_interval_s": DEFAULT_HEARTBEAT_INTERVAL_S,
            "reap_threshold_s": reap_threshold_s(DEFAULT_HEARTBEAT_INTERVAL_S),
            "reap_threshold_formula": "max(4 * heartbeat_interval_s, 30.0)",
            "hung_reap_after_s": HUNG_REAP_MULTIPLE * reap_threshold_s(DEFAULT_HEARTBEAT_INTERVAL_S),
            "hung_reap_formula": "10 * the reaping worker's reap threshold, watched on its own monotonic clock",
            "busy_timeout_s": DEFAULT_BUSY_TIMEOUT_S,
            "max_retries": DEFAULT_MAX_RETRIES,
            "max_crashes": DEFAULT_MAX_CRASHES,
            "timeout_s": DEFAULT_TIMEOUT_S,
            "priority": DEFAULT_PRIORITY,
            "concurrency": DEFAULT_CONCURRENCY,
            "term_grace_s": TERM_GRACE_S,
            "backoff_base_s": BACKOFF_BASE_S,
            "backoff_cap_s": BACKOFF_CAP_S,
            "backoff_formula": "min(60, 2 * 2^(failures-1))",
            "idle_poll_s": IDLE_POLL_S,
        },
        "limits": {
            "priority_min": PRIORITY_MIN,
            "priority_max": PRIORITY_MAX,
            "max_retries_min": 0,
            "max_retries_max": MAX_RETRIES_MAX,
            "max_crashes_min": 0,
            "max_crashes_max": MAX_CRASHES_MAX,
            "timeout_s_above": 0.0,  # exclusive: a timeout must be more than this
            "timeout_s_max": TIMEOUT_S_MAX,
            "concurrency_min": 1,
            "concurrency_max": CONCURRENCY_MAX,
            "command_args_max": COMMAND_ARGS_MAX,
            "command_bytes_max": COMMAND_BYTES_MAX,
            "idempotency_key_bytes_min": 1,
            "idempotency_key_bytes_max": IDEMPOTENCY_KEY_BYTES_MAX,
            "busy_timeout_s_min": BUSY_TIMEOUT_S_MIN,
            "busy_timeout_s_max": BUSY_TIMEOUT_S_MAX,
            "heartbeat_interval_s_min": HEARTBEAT_INTERVAL_S_MIN,
            "heartbeat_interval_s_max": HEARTBEAT_INTERVAL_S_MAX,
            "list_limit_max": LIST_LIMIT_MAX,
            "output_json_bytes_max": OUTPUT_JSON_BYTES_MAX,
        },
        "test_knobs": knobs,
        "liveness_marker": "worker command line contains 'spoolctl' or runs '-m spooler[.*]'",
    }
