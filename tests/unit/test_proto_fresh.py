"""The generated protobuf code is what `make proto` makes from proto/ today."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTOS = ["spooler/pb/log.proto", "spooler/pb/api.proto", "spooler/pb/replication.proto"]


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", *[str(ROOT / "proto" / p) for p in PROTOS]],
                   check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(rel) for rel in generated if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"generated code is stale, run `make proto`: {stale}"
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "spooler" / "pb").glob("*_pb2*.py*"))
    assert committed == generated, "spooler/pb holds generated files that proto/ no longer makes"
