"""Which epoch an answer names (in-process node, HTTP through aiohttp's test server,
gRPC through a real grpc.aio server on a loopback port).

A replica learns a new primary's epoch from that primary's first message, before the
epoch's first record is committed and applied. Answers name the newest epoch the node
knows (what GET /v1/cluster says too), so an answer forwarded to the new primary names
the epoch of the leases in it. The gap is made here by hand: the replication core is
moved one epoch ahead of the applied records, as a vote for a newer primary does."""
import asyncio

import grpc
from aiohttp.test_utils import TestClient, TestServer

from node.api import grpc_api
from node.api.http import build_app
from node.api.metrics import Metrics
from node.api.service import Service
from node.engine import Engine
from spooler.pb import api_pb2, api_pb2_grpc

KEY = "k" * 20


def test_answers_name_the_newest_epoch_the_node_knows(tmp_path):
    async def main():
        eng = Engine(str(tmp_path / "n"))
        await eng.start()
        server = None
        try:
            svc = Service(eng, [KEY])
            metrics = Metrics(eng)
            applied = eng.epoch
            eng.repl.core.epoch = applied + 1  # voted for a newer primary, nothing of it applied yet
            assert eng.epoch == applied

            async with TestClient(TestServer(build_app(svc, metrics))) as http:
                ok = await http.get("/v1/queues", headers={"Authorization": f"Bearer {KEY}"})
                bad = await http.get("/v1/queues")  # errors carry it too
                cluster = await http.get("/v1/cluster", headers={"Authorization": f"Bearer {KEY}"})
                assert ok.status == 200 and bad.status == 401
                assert ok.headers["Spooler-Epoch"] == bad.headers["Spooler-Epoch"] == str(applied + 1)
                assert (await cluster.json())["epoch"] == applied + 1 == int(cluster.headers["Spooler-Epoch"])

            server = grpc.aio.server()
            grpc_api.add_spooler_service(grpc_api.SpoolerServicer(svc, metrics), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = api_pb2_grpc.SpoolerStub(ch).ListQueues(api_pb2.ListQueuesRequest(),
                                                               metadata=(("authorization", f"Bearer {KEY}"),))
                await call
                trailers = dict(await call.trailing_metadata())
                assert trailers["spooler-epoch"] == str(applied + 1)
        finally:
            if server is not None:
                await server.stop(None)
            await eng.stop()
    asyncio.run(main())


def test_a_not_ready_probe_is_a_call_counted_unavailable_but_not_an_error(tmp_path, monkeypatch):
    """/readyz answering 503 says "not ready" to a load balancer: counted in
    spooler_calls_total (outcome unavailable), never in spooler_errors_total,
    where every probe of a node without a primary would swell the error rate."""
    async def main():
        eng = Engine(str(tmp_path / "n"))
        await eng.start()
        try:
            svc = Service(eng, [KEY])
            metrics = Metrics(eng)
            monkeypatch.setattr(eng, "clients_ready", lambda: False)
            async with TestClient(TestServer(build_app(svc, metrics))) as http:
                for _ in range(3):
                    assert (await http.get("/readyz")).status == 503
                assert (await http.get("/v1/queues")).status == 401  # an error of a client's call: counted
                text = await (await http.get("/metrics")).text()
            assert 'spooler_calls_total{api="http",call="GET /readyz",outcome="unavailable"} 3.0' in text, text
            assert 'spooler_errors_total{kind="unavailable"' not in text, text
            assert 'spooler_errors_total{kind="unauthenticated",reason=""} 1.0' in text, text
        finally:
            await eng.stop()
    asyncio.run(main())
