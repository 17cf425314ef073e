"""The cluster's identity on calls between members (node/tls.py): who is of
another cluster, and who cannot be told."""
from node.tls import CLUSTER_ID_MD, another_cluster


def test_a_call_naming_another_cluster_is_told_apart_and_one_that_cannot_be_told_is_not():
    mine = "c0ffee"
    assert another_cluster(((CLUSTER_ID_MD, "beef"),), mine) == "beef"
    assert another_cluster((("other", "x"), (CLUSTER_ID_MD, "beef")), mine) == "beef"
    # twice, even once with ours: not a member's call (a member sends it once)
    assert another_cluster(((CLUSTER_ID_MD, mine), (CLUSTER_ID_MD, "beef")), mine) == "c0ffee,beef"
    assert another_cluster(((CLUSTER_ID_MD, mine),), mine) is None
    # the caller names none (a new cluster, an empty replacement, an older build)
    assert another_cluster((), mine) is None and another_cluster(None, mine) is None
    # this node has none yet: it cannot tell, and adopts the id from the log it is sent
    assert another_cluster(((CLUSTER_ID_MD, "beef"),), "") is None
