"""Every test that docs/guarantees.md names exists (a claim never points at nothing)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_guarantees_name_real_tests():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    refs = set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text))
    assert len(refs) >= 20
    missing = []
    for path, name in sorted(refs):
        f = ROOT / path
        if not f.exists() or not re.search(rf"def {name}\b", f.read_text()):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
    for path in set(re.findall(r"`(tests/[\w/]+\.py)`", text)):
        assert (ROOT / path).exists(), path
    # a bare `::test_name` continues the file named before it: it must exist in some test file
    sources = "\n".join(f.read_text() for f in (ROOT / "tests").rglob("test_*.py"))
    bare = set(re.findall(r"`::(test_\w+)`", text))
    lost = sorted(n for n in bare if not re.search(rf"def {n}\b", sources))
    assert not lost, f"docs/guarantees.md names tests that do not exist: {lost}"


def test_limits_and_operations_name_real_tests():
    """limits.md, operations.md and upgrades.md name tests as their evidence too."""
    sources = {f.relative_to(ROOT).as_posix(): f.read_text() for f in (ROOT / "tests").rglob("test_*.py")}
    everything = "\n".join(sources.values())
    missing = []
    for doc in ("limits.md", "operations.md", "upgrades.md"):
        text = (ROOT / "docs" / doc).read_text()
        for path, name in set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text)):
            if not re.search(rf"def {name}\b", sources.get(path, "")):
                missing.append(f"{doc}: {path}::{name}")
        for name in set(re.findall(r"`::(test_\w+)`", text)):
            if not re.search(rf"def {name}\b", everything):
                missing.append(f"{doc}: ::{name}")
    assert not missing, missing
