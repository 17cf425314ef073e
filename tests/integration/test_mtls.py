"""Node-to-node mTLS: a cluster with certificates from one CA replicates; a
node or client whose certificate comes from another CA is refused."""
import shutil
import subprocess

import grpc
import pytest

from integration.test_cluster import primary_of, send_until_ok, until_ok
from nodeproc import start_cluster, wait_until
from spooler import Client, errors
from spooler.http import HttpClient
from spooler.pb import replication_pb2 as rpb
from spooler.pb import replication_pb2_grpc as rpb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def make_ca(d, name):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", d / f"{name}.key", "-out", d / f"{name}.pem", "-days", "2",
                    "-subj", f"/CN={name}"], check=True, capture_output=True)


def make_cert(d, ca, name):
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", d / f"{name}.key", "-out", d / f"{name}.csr", "-subj", f"/CN={name}"],
                   check=True, capture_output=True)
    ext = d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-in", d / f"{name}.csr", "-CA", d / f"{ca}.pem", "-CAkey",
                    d / f"{ca}.key", "-CAcreateserial", "-out", d / f"{name}.pem", "-days", "2", "-extfile", ext],
                   check=True, capture_output=True)


def creds(d, ca, name):
    return grpc.ssl_channel_credentials(root_certificates=(d / f"{ca}.pem").read_bytes(),
                                        private_key=(d / f"{name}.key").read_bytes(),
                                        certificate_chain=(d / f"{name}.pem").read_bytes())


def test_mtls_cluster_refuses_unknown_certificates(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    make_ca(pki, "ca")
    make_ca(pki, "rogue-ca")
    for n in ("n1", "n2", "n3", "client"):
        make_cert(pki, "ca", n)
    make_cert(pki, "rogue-ca", "rogue")
    ids = ["n1", "n2", "n3"]
    nodes = start_cluster(str(tmp_path), 3, 1.0, per_node_args=lambda i: [
        "--tls-cert", str(pki / f"{i}.pem"), "--tls-key", str(pki / f"{i}.key"), "--tls-ca", str(pki / "ca.pem")])
    ports = {i: n.grpc_port for i, n in nodes.items()}
    try:
        p, _ = wait_until(lambda: primary_of(nodes), 15, what="a primary elected over mTLS")
        replica = next(i for i in ids if i != p)
        c = HttpClient(nodes[replica].http_url, nodes[replica].admin_key)  # forwarded over mTLS
        until_ok(lambda: c.put_queue("q"))
        send_until_ok(c, "q", b"over tls")
        # a client with a certificate of the cluster's CA is served over gRPC
        with Client(f"127.0.0.1:{ports[p]}", nodes[p].admin_key, credentials=creds(pki, "ca", "client")) as good:
            assert good.get_queue("q")["stats"]["sentTotal"] == 1
        # a "node" with a certificate from another CA cannot even vote
        # (it trusts the cluster's CA, so only its own certificate is wrong)
        rogue = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes(),
                                             private_key=(pki / "rogue.key").read_bytes(),
                                             certificate_chain=(pki / "rogue.pem").read_bytes())
        ch = grpc.secure_channel(f"127.0.0.1:{ports[replica]}", rogue)
        with pytest.raises(grpc.RpcError) as e:
            rpb_grpc.ReplicationStub(ch).Vote(rpb.VoteRequest(epoch=99, candidate="n1", last_epoch=99,
                                                              last_lsn=10**9), timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
        ch.close()
        # plaintext is refused too
        with Client(f"127.0.0.1:{ports[p]}", nodes[p].admin_key, retry_attempts=1, timeout_s=3) as plain:
            with pytest.raises(errors.SpoolerError):
                plain.get_queue("q")
        # and nothing changed: same primary, same epoch
        assert primary_of(nodes)[0] == p
    finally:
        for n in nodes.values():
            n.kill()


def test_tls_files_that_cannot_serve_are_one_line_at_start_and_nothing_is_made(tmp_path, capsys):
    """A key that is not the certificate's made gRPC say only that it could not
    bind the port ("in use by another process?"); a missing file was a
    traceback, after the data directory had been made. Both are one line now,
    before anything is made; good files pass."""
    from node.main import parse_args

    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "ca", "n1")
    make_cert(tmp_path, "ca", "n2")
    data = tmp_path / "data"
    cases = [
        ((tmp_path / "n1.pem", tmp_path / "n2.key", tmp_path / "ca.pem"), "are not a certificate and its private key"),
        ((tmp_path / "nope.pem", tmp_path / "n1.key", tmp_path / "ca.pem"), "--tls-cert"),
        ((tmp_path / "n1.pem", tmp_path / "n1.key", tmp_path / "nope.pem"), "--tls-ca"),
        ((tmp_path / "n1.pem", tmp_path / "n1.key", tmp_path / "n1.key"), "--tls-ca"),
    ]
    for (cert, key, ca), words in cases:
        with pytest.raises(SystemExit) as e:
            parse_args(["--data", str(data), "--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err, err
        assert err.strip().count("\n") == 0, err
        assert not data.exists()
    a = parse_args(["--data", str(data), "--tls-cert", str(tmp_path / "n1.pem"), "--tls-key",
                    str(tmp_path / "n1.key"), "--tls-ca", str(tmp_path / "ca.pem")])
    assert a.tls_cert.endswith("n1.pem")
    # what gRPC itself takes is taken (a 1024-bit RSA key signed with SHA-1: Python's
    # own TLS defaults refuse it); an encrypted key is refused, never a pass phrase prompt
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:1024", "-nodes", "-sha1", "-keyout",
                    tmp_path / "weak.key", "-out", tmp_path / "weak.pem", "-days", "2", "-subj", "/CN=weak"],
                   check=True, capture_output=True)
    parse_args(["--data", str(data), "--tls-cert", str(tmp_path / "weak.pem"), "--tls-key",
                str(tmp_path / "weak.key"), "--tls-ca", str(tmp_path / "weak.pem")])
    subprocess.run(["openssl", "genrsa", "-aes128", "-passout", "pass:x", "-out", tmp_path / "enc.key", "2048"],
                   check=True, capture_output=True)
    with pytest.raises(SystemExit):
        parse_args(["--data", str(data), "--tls-cert", str(tmp_path / "n1.pem"), "--tls-key",
                    str(tmp_path / "enc.key"), "--tls-ca", str(tmp_path / "ca.pem")])
    err = capsys.readouterr().err
    assert "is encrypted" in err and err.strip().count("\n") == 0, err
    assert not data.exists()
