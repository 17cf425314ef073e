"""Trust between members: optional mTLS for the gRPC port (node-to-node traffic
and gRPC clients alike), and the cluster's key.

With --tls-cert, --tls-key and --tls-ca every gRPC connection must present a
certificate signed by that CA (client auth required), and this node's own
streams, votes and forwarded calls to its peers present its certificate.
A node or client with an unknown certificate fails the handshake.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Optional

import grpc

# The cluster's key (--cluster-key): every call one member makes to another
# carries it in this metadata (replication streams, votes, TimeoutNow, snapshots,
# forwarded client calls); a member given a key refuses replication calls without
# it, and takes a call's claim to be forwarded only with it.
CLUSTER_KEY_MD = "spooler-cluster-key"


# The cluster's identity (EpochBegin.cluster_id, adopted from the applied log):
# every call one member makes to another carries it once this node has one; a
# member that has one refuses replication calls naming another. It tells apart
# two clusters that use the same ids and reach each other's addresses (a
# member of one left running at an address the other now uses); it is no
# secret and proves nothing, the key above does that.
CLUSTER_ID_MD = "spooler-cluster-id"
ANOTHER_CLUSTER = "another cluster"  # in a refusal's details: what the caller's log names


def another_cluster(metadata, cluster_id: str) -> Optional[str]:
    """The id of another cluster that a call with ``metadata`` names, or None:
    the call names this node's cluster, or one side has no id yet (a new
    cluster before its first epoch is committed, an empty replacement, a build
    before 0.4.31), and then nothing can tell."""
    if not cluster_id:
        return None
    got = [str(v) for k, v in metadata or () if k == CLUSTER_ID_MD]
    if not got or got == [cluster_id]:
        return None
    return ",".join(got)


def peer_metadata(cluster_key: str) -> tuple:
    """What this node adds to its calls to other members."""
    return ((CLUSTER_KEY_MD, cluster_key),) if cluster_key else ()


def from_a_member(metadata, cluster_key: str) -> bool:
    """Does a call with ``metadata`` come from a member? Without a cluster key
    configured nothing can tell, and every caller is taken for one (DESIGN.md,
    "Trust between nodes"); with one, the call must carry it, once."""
    if not cluster_key:
        return True
    got = [v for k, v in metadata or () if k == CLUSTER_KEY_MD]
    return len(got) == 1 and hmac.compare_digest(str(got[0]).encode(), cluster_key.encode())


@dataclass
class TLS:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> "TLS":
        def read(p):
            with open(p, "rb") as f:
                return f.read()
        return cls(read(cert), read(key), read(ca))

    def server_credentials(self):
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self):
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def aio_channel(address: str, options, tls: Optional[TLS]):
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
