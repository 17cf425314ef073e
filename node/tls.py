"""Optional mTLS for the gRPC port (node-to-node traffic and gRPC clients alike).

With --tls-cert, --tls-key and --tls-ca every gRPC connection must present a
certificate signed by that CA (client auth required), and this node's own
streams, votes and forwarded calls to its peers present its certificate.
A node or client with an unknown certificate fails the handshake.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import grpc


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
