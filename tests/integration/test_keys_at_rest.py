"""API keys are stored hashed: the secret never reaches the disk."""
import glob
import os

from spooler.http import HttpClient


def test_key_secret_is_never_stored(node):
    admin = HttpClient(node.http_url, node.admin_key)
    admin.put_queue("k1")
    k = admin.create_key("k1", ["send", "receive"])
    secret = k["key"][4:].partition("_")[2]  # spk_<id>_<secret>
    assert len(secret) >= 32
    HttpClient(node.http_url, k["key"]).send("k1", b"works")  # the key is live
    node.stop()  # graceful: the checkpoint writes the keys table too
    # every file the node keeps or writes in its data directory: the store, its
    # WAL, the node's own log, the admin key file if any
    files = [f for f in glob.glob(os.path.join(node.data_dir, "**"), recursive=True) if os.path.isfile(f)]
    assert any(os.path.basename(f) == "spool.db" for f in files) and any(f.endswith(".log") for f in files), files
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        assert secret.encode() not in data, f"plaintext key secret found in {os.path.basename(f)}"
        if os.path.basename(f) == "spool.db":
            assert k["id"].encode() in data  # the key id itself is stored
    node.start()
    HttpClient(node.http_url, k["key"]).send("k1", b"still works after restart")
