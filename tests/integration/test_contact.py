"""A primary keeps its majority while its replicas' disks work through a backlog
of frames slower than the failover timeout: contact acknowledgements (R4)."""
import asyncio
import os
import tempfile

import pytest

from nodeproc import start_cluster, wait_until
from spooler import errors
from spooler.http import HttpClient

FAILOVER_S = 1.0
SYNC_DELAY_S = 0.4   # per fsync on the replicas: 8 frames in flight are 3.2 s of backlog


def _view(n):
    try:
        return n.get("/v1/cluster")[1]
    except Exception:
        return None


def _primary(nodes):
    for i, n in nodes.items():
        v = _view(n)
        if v and v["role"] == "primary":
            return i, v["epoch"]
    return None


@pytest.mark.parametrize("contact", [True, False], ids=["contact-acks", "control"])
def test_a_primary_keeps_its_majority_while_its_replicas_disks_lag(contact, tmp_path):
    """Every commit goes through the store's thread (as a large one does), and the
    replicas' fsyncs take 0.4 s each: frames pile up behind the one being stored,
    longer than the failover timeout. The frames that wait are acknowledged as
    contact when they arrive, so the primary keeps serving and every send is
    confirmed. The control run, without contact acknowledgements, shows that the
    setup does depose the primary (it did before 0.4.11)."""
    from spooler import AsyncClient

    env = {"SPOOLER_TEST_VFS": "buffered", "SPOOLER_TEST_SYNC_DELAY": "1", "SPOOLER_INLINE_COMMIT_BYTES": "0",
           "SPOOLER_TEST_CONTACT_ACKS": "1" if contact else "0"}
    nodes = start_cluster(str(tmp_path), 3, FAILOVER_S, env=env)
    try:
        p, epoch = wait_until(lambda: _primary(nodes), 15, what="a primary")

        def put():
            try:
                return HttpClient(nodes[p].http_url, nodes[p].admin_key, timeout_s=10).put_queue("slow") or True
            except (errors.Unavailable, errors.OperationUnconfirmed):
                return None
        wait_until(put, 15, interval_s=0.05, what="the queue")
        for i in nodes:
            if i != p:
                with open(os.path.join(nodes[i].data_dir, "test-sync-delay"), "w") as f:
                    f.write(str(SYNC_DELAY_S))

        async def main():
            async with AsyncClient(nodes[p].grpc_target, nodes[p].admin_key, timeout_s=30, retry_attempts=1,
                                   batch_max=1) as c:
                async def sender(k):
                    out = []
                    for j in range(3):
                        try:
                            await c.send("slow", b"%d-%d" % (k, j))
                            out.append(None)
                        except errors.SpoolerError as e:
                            out.append(type(e).__name__)
                    return out
                return await asyncio.gather(*[sender(k) for k in range(12)])

        results = [r for rs in asyncio.run(main()) for r in rs]
        after = _primary(nodes)
        if contact:
            assert results == [None] * len(results), results
            assert after == (p, epoch), f"the primary changed: {after}"
        else:
            assert after != (p, epoch) or any(results), "the control kept its primary: the setup shows nothing"
    finally:
        for n in nodes.values():
            n.kill()
