"""spoolctl's job runner: a daemonless work queue for shell commands.

Layout (data flows one way: CLI -> store decides under BEGIN IMMEDIATE -> executor runs):

* ``knobs``    defaults, limits, the two test knobs and their bounds
* ``states``   the job lifecycle table and the pure decisions (backoff, budgets)
* ``store``    apsw schema; submit / claim / heartbeat / finish / reap / cancel / retry
* ``reaper``   PID liveness of a stale worker and the reap pass
* ``executor`` spawn in a new session, per-attempt output files, timeout, group kill
* ``worker``   the local worker loop (slots, heartbeat thread, progress line)
* ``remote``   the same executor fed from a Spooler queue (lease = heartbeat)
"""
