"""SIGKILL the node in the middle of a burst of concurrent sends and acks.

After a restart on the same data: every send that got 201 is there exactly
once (delivered, or acked before the crash), and no message whose ack got 204
ever comes back. Sends and acks without an answer are "unknown": they may or
may not have landed, and are only counted.
"""
import threading


from nodeproc import wait_until
from spooler import errors
from spooler.http import HttpClient


def test_sigkill_mid_burst_loses_nothing_confirmed(node):
    admin = HttpClient(node.http_url, node.admin_key, timeout_s=5)
    admin.put_queue("crash", leaseTimeoutSeconds=60)
    stop = threading.Event()
    lock = threading.Lock()
    confirmed = {}      # body -> id, for every 201
    unknown_sends = set()
    acked = set()       # ids whose ack got 204
    unknown_acks = set()

    def producer(pid):
        c = HttpClient(node.http_url, node.admin_key, timeout_s=5)
        i = 0
        while not stop.is_set():
            body = f"p{pid}-{i}".encode()
            i += 1
            try:
                r = c.send("crash", body)
                with lock:
                    confirmed[body] = r["id"]
            except errors.SpoolerError:
                with lock:
                    unknown_sends.add(body)
                return

    def consumer():
        c = HttpClient(node.http_url, node.admin_key, timeout_s=5)
        while not stop.is_set():
            try:
                d = c.receive("crash", wait_s=0.2)
                if d is None:
                    continue
                c.ack(d.token)
                with lock:
                    acked.add(d.id)
            except errors.SpoolerError:
                if d is not None:
                    with lock:
                        unknown_acks.add(d.id)
                return

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=consumer) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(confirmed) >= 300 and len(acked) >= 50, timeout_s=60, what="a busy burst")
        node.kill()  # SIGKILL by pid, mid-burst
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)

    node.start()
    c = HttpClient(node.http_url, node.admin_key, timeout_s=5)
    seen = {}  # body -> [ids delivered after the restart]
    while True:
        d = c.receive("crash", wait_s=0)
        if d is None:
            break
        seen.setdefault(d.body, []).append(d.id)
        c.ack(d.token)

    by_id = {v: k for k, v in confirmed.items()}
    lost = [b for b, mid in confirmed.items() if mid not in acked and mid not in unknown_acks and b not in seen]
    duplicated = {b: ids for b, ids in seen.items() if len(ids) > 1}
    acked_came_back = [mid for mid in acked if by_id.get(mid) in seen]
    unexpected = [b for b in seen if b not in confirmed and b not in unknown_sends]
    print(f"confirmed={len(confirmed)} acked={len(acked)} unknown_sends={len(unknown_sends)} "
          f"unknown_acks={len(unknown_acks)} redelivered={len(seen)}")
    assert len(confirmed) >= 300
    assert lost == []
    assert duplicated == {}
    assert acked_came_back == []
    assert unexpected == []
    for b, [mid] in seen.items():  # ids are stable across the restart
        if b in confirmed:
            assert confirmed[b] == mid
