"""Checks of what the code holds can never happen, kept under ``python -O``.

A bare ``assert`` is compiled away when Python runs optimized (``-O``, or
``PYTHONOPTIMIZE`` set in a service's environment), and the checks in Spooler's
node guard its data: a log gap, an epoch going back, a truncation reaching an
applied record. So the node writes them as ``if ...: raise BrokenInvariant(...)``,
which no interpreter flag removes. ``BrokenInvariant`` is an ``AssertionError``: whoever
handled a failed assertion before handles these the same way (the node stops,
exit 71, rather than write on from a state it cannot explain).

``tests/unit/test_invariants.py`` runs them under ``-O`` and keeps product code
free of ``assert`` statements.
"""


class BrokenInvariant(AssertionError):
    """A record, a loaded state or the node's own bookkeeping breaks what the code
    relies on: a bug or a damaged store, never a client's doing (bad input gets
    one of the contract's error kinds). The node stops (exit 71), since going on
    would lose or duplicate messages unseen."""
