"""GET /v1/cluster's document survives the trip through gRPC's ClusterInfo (a
promote or a cluster call forwarded by a replica, or read through the SDK)."""
from node.api.grpc_api import cluster_pb
from spooler._common import cluster_dict


def test_the_cluster_document_round_trips_through_cluster_info():
    doc = {"nodeId": "n1", "role": "primary", "epoch": 7, "primary": "n1", "commitLsn": 41, "appliedLsn": 40,
           "nodes": [{"id": "n1", "role": "primary", "address": "h1:1", "lsn": 41},
                     {"id": "n2", "role": "replica", "address": "h2:1", "matchLsn": 41, "lastContactMs": 12.5},
                     {"id": "n3", "role": "replica", "address": "h3:1", "joining": True, "lastContactMs": None},
                     {"id": "n4", "role": "replica", "address": "h4:1", "lastContactMs": 0.0}]}
    assert cluster_dict(cluster_pb(doc)) == doc
    lone = {"nodeId": "n2", "role": "replica", "epoch": 0, "primary": None, "commitLsn": 0, "appliedLsn": 0,
            "nodes": [{"id": "n2", "role": "replica", "address": "h2:1"}]}
    assert cluster_dict(cluster_pb(lone)) == lone
