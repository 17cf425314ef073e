"""Older builds of this repository, for drills that upgrade a running cluster.

``previous_release(root)`` finds, in the git history of the checkout at ``root``, the
last commit of the release before the one checked out (the parent of the commit that
changed ``version`` in pyproject.toml from it), ``release_end(root, "0.4.41")`` that
of a named release; ``extract(rev, dest, root)``
writes that revision's ``node/`` and ``spooler/`` packages into ``dest`` (``git
archive``: the working tree is not touched); ``entry(tree)`` is the interpreter's
arguments that run ``node.main`` from such a tree (``NodeProc(entry=...)``), ahead of
the installed build. The test's own interpreter and installed dependencies serve both
builds, as one machine's Python does for an operator who upgrades in place.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
from typing import Optional

_VERSION = re.compile(r'^version\s*=\s*"([^"]+)"', re.M)


def _git(root: str, *args: str, binary: bool = False):
    out = subprocess.run(["git", "-C", root, *args], check=True, capture_output=True, timeout=60).stdout
    return out if binary else out.decode()


def version_at(root: str, rev: str) -> Optional[str]:
    """The version pyproject.toml names at ``rev`` (None: it names none)."""
    m = _VERSION.search(_git(root, "show", f"{rev}:./pyproject.toml"))  # (./: relative to root)
    return m.group(1) if m else None


def release_end(root: str, version: str, rev: str = "HEAD") -> str:
    """The newest commit, up to ``rev``, whose pyproject.toml names ``version``: the
    parent of the commit that moved it on (``rev`` itself if it still names it).
    Raises LookupError when the history holds no such commit (a shallow clone)."""
    newer = None  # the commit seen just before (newer), one that changed pyproject.toml
    for commit in _git(root, "log", "--format=%H", rev, "--", "pyproject.toml").split():
        if version_at(root, commit) == version:
            return _git(root, "rev-parse", f"{newer}^").strip() if newer else _git(root, "rev-parse", rev).strip()
        newer = commit
    raise LookupError(f"no commit of {version} in this checkout's history")


def previous_release(root: str, rev: str = "HEAD") -> tuple[str, str]:
    """(version, commit): the release before ``rev``'s, at its last commit (the one
    before the version moved on). Raises LookupError when the history holds none."""
    now = version_at(root, rev)
    for commit in _git(root, "log", "--format=%H", rev, "--", "pyproject.toml").split():
        v = version_at(root, commit)
        if v != now:
            return v, release_end(root, v, rev)
    raise LookupError(f"no release before {now} in this checkout's history")


def extract(rev: str, dest: str, root: str) -> str:
    """``node/`` and ``spooler/`` of ``rev`` into ``dest`` (made if missing) -> dest."""
    os.makedirs(dest, exist_ok=True)
    data = _git(root, "archive", "--format=tar", rev, "node", "spooler", binary=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # a Python without extraction filters (before 3.11.4): our own archive
            tar.extractall(dest)
    return dest


def entry(tree: str) -> list[str]:
    """The interpreter's arguments that run ``node.main`` from ``tree`` (its packages
    first on the path, before the installed build's), its flags following."""
    code = ("import runpy, sys; sys.path.insert(0, %r); sys.argv[0] = 'spooler-node'; "
            "runpy.run_module('node.main', run_name='__main__', alter_sys=True)" % tree)
    return ["-c", code]


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
