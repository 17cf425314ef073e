"""GET /v1/cluster's document survives the trip through gRPC's ClusterInfo (a
promote or a cluster call forwarded by a replica, or read through the SDK)."""
from node.api.grpc_api import cluster_pb
from spooler._common import cluster_dict
from spooler.pb import api_pb2


def test_the_cluster_document_round_trips_through_cluster_info():
    doc = {"nodeId": "n1", "role": "primary", "epoch": 7, "primary": "n1", "commitLsn": 41, "appliedLsn": 40,
           "clusterId": "5f0c8a", "nodes": [{"id": "n1", "role": "primary", "address": "h1:1", "lsn": 41,
                                             "diskLow": False},
                     {"id": "n2", "role": "replica", "address": "h2:1", "matchLsn": 41, "lastContactMs": 12.5,
                      "reachable": True, "diskLow": True, "eager": True},
                     {"id": "n3", "role": "replica", "address": "h3:1", "joining": True, "lastContactMs": None,
                      "reachable": False, "eager": False},
                     {"id": "n4", "role": "replica", "address": "h4:1", "lastContactMs": 0.0}]}
    assert cluster_dict(cluster_pb(doc)) == doc
    # zeros are said, not dropped: a fresh primary's replicas have matchLsn 0, a new node lsn 0
    # (and a cluster whose first epoch has not committed yet has no id: null)
    fresh = {"nodeId": "n2", "role": "primary", "epoch": 1, "primary": "n2", "commitLsn": 0, "appliedLsn": 0,
             "clusterId": None, "nodes": [{"id": "n2", "role": "primary", "address": "h2:1", "lsn": 0},
                       {"id": "n1", "role": "replica", "address": "h1:1", "matchLsn": 0, "lastContactMs": None}]}
    assert cluster_dict(cluster_pb(fresh)) == fresh


def test_an_older_nodes_cluster_info_reads_without_the_fields_it_never_sent():
    """A 0.4.1 node sends no lsn figures at the top and its own lsn as a plain field."""
    old = api_pb2.ClusterInfo(node_id="n1", role="replica", epoch=3, primary="n2",
                              nodes=[api_pb2.NodeInfo(id="n1", role="replica", address="h1:1", lsn=9),
                                     api_pb2.NodeInfo(id="n2", role="primary", address="h2:1")])
    d = cluster_dict(api_pb2.ClusterInfo.FromString(old.SerializeToString()))
    assert d == {"nodeId": "n1", "role": "replica", "epoch": 3, "primary": "n2", "clusterId": None,
                 "nodes": [{"id": "n1", "role": "replica", "address": "h1:1", "lsn": 9},
                           {"id": "n2", "role": "primary", "address": "h2:1"}]}


def test_spoolctl_promote_never_prints_a_primary_of_none(monkeypatch, capsys):
    """An older primary answers a promote with its own view, which may name no
    primary yet: spoolctl says the switchover is done and where to look, not
    "primary is now None"."""
    import argparse

    from spooler.cli import spool as cli_spool

    answers = [{"nodeId": "n1", "role": "replica", "epoch": 2, "primary": None, "nodes": []},
               {"nodeId": "n1", "role": "replica", "epoch": 2, "primary": "n2", "nodes": []}]

    class Fake:
        def promote(self, node):
            return answers.pop(0)

    monkeypatch.setattr(cli_spool, "_client", lambda args: Fake())
    args = argparse.Namespace(node="n2", json=False)
    cli_spool.cmd_cluster_promote(args)
    out = capsys.readouterr().out
    assert "None" not in out and "switchover to n2 done" in out and "epoch 2" in out, out
    cli_spool.cmd_cluster_promote(args)
    assert capsys.readouterr().out.strip() == "primary is now n2 (epoch 2)"


def test_spoolctl_cluster_status_says_which_replicas_a_primary_sends_each_record_first(monkeypatch, capsys):
    """A primary's replica entries say ``eager`` (--eager-replicas): the status
    line of such a replica says "first", the others' do not."""
    import argparse

    from spooler.cli import spool as cli_spool

    doc = {"nodeId": "n1", "role": "primary", "epoch": 4, "primary": "n1", "nodes": [
        {"id": "n1", "role": "primary", "address": "h1:1", "lsn": 9},
        {"id": "n2", "role": "replica", "address": "h2:1", "matchLsn": 9, "lastContactMs": 3.0, "eager": True},
        {"id": "n3", "role": "replica", "address": "h3:1", "matchLsn": 8, "lastContactMs": 4.0, "eager": False}]}

    class Fake:
        def cluster(self):
            return doc

    monkeypatch.setattr(cli_spool, "_client", lambda args: Fake())
    cli_spool.cmd_cluster_status(argparse.Namespace(json=False))
    lines = {x.split()[0]: x for x in capsys.readouterr().out.splitlines()[1:]}
    assert lines["n2"].split()[:4] == ["n2", "replica", "h2:1", "first"], lines
    assert "first" not in lines["n3"] and "first" not in lines["n1"], lines
