"""The queue-name check remembers names that passed, and nothing else."""
import pytest

from node.api import service as service_mod
from node.api.service import Service
from node.engine import Engine
from spooler import errors


@pytest.fixture()
def svc(tmp_path):
    eng = Engine(str(tmp_path / "n"))
    try:
        yield Service(eng, ["k"])
    finally:
        eng.store.close()


BAD = ["", "a b", "x" * 81, "q/1", "é", "q\n", "x" * 81 + ".fail", "x" * 256 + ".failed"]


def test_a_remembered_name_is_still_the_only_kind_that_passes(svc, monkeypatch):
    monkeypatch.setattr(service_mod, "NAMES_OK_MAX", 3)
    good = ["q", "jobs.failed", "x" * 80 + ".failed.failed", "a-b_c.d", "z"]
    for _ in range(2):  # the second time from the memory (as far as it holds)
        for name in good:
            assert svc.check_name_any(name) == name
        for name in BAD:
            with pytest.raises(errors.InvalidArgument):
                svc.check_name_any(name)
    assert len(svc._names_ok) <= 3  # bounded: it starts over when full
    assert not svc._names_ok & set(BAD)


def test_a_str_subclass_is_checked_each_time_and_never_remembered(svc):
    class Sneaky(str):
        def __hash__(self):
            return hash("q")

        def __eq__(self, other):
            return True

    svc.check_name_any("q")  # remembered
    with pytest.raises(errors.InvalidArgument):
        svc.check_name_any(Sneaky("not a name"))
    for bad in (None, 7, b"q", ["q"]):
        with pytest.raises(errors.InvalidArgument):
            svc.check_name_any(bad)
