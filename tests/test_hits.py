"""Hit classification (offload/hits.py): `classify`'s Hits against the rules written out plainly, on inputs that tell
the cases apart (whole, top hit, miss; a staged segment that covers the need, starts too late, or serves no active
expert; repeated and unsorted experts; empty staging)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.offload.hits import Hits, classify

EXPERTS = 8


def classified_plainly(active, cached, top_neurons, intermediate, staged) -> tuple:
    """The module doc's rules, one expert at a time, lists turned into tuples at the end."""
    whole, top_hits, misses, covered, loads = [], [], [], [], []
    for e in sorted(set(active)):
        if e in cached and top_neurons == intermediate:
            whole.append(e)
            continue
        start = top_neurons if e in cached else 0
        (top_hits if e in cached else misses).append(e)
        first = staged.get(e)
        (covered if first is not None and first <= start else loads).append((e, start))
    usable = {e for e, _ in covered}
    dropped = sorted(e for e in staged if e not in usable)
    return tuple(whole), tuple(top_hits), tuple(misses), tuple(covered), tuple(loads), tuple(dropped)


@settings(max_examples=400, deadline=None)
@given(active=st.lists(st.integers(0, EXPERTS - 1), max_size=6),
       cached=st.sets(st.integers(0, EXPERTS - 1)),
       split=st.booleans(),
       staged=st.dictionaries(st.integers(0, EXPERTS - 1), st.sampled_from([0, 4, 8])))
def test_classify_gives_the_rules_hits(active, cached, split, staged):
    intermediate = 8
    top_neurons = 4 if split else intermediate
    hits = classify(active, cached, top_neurons, intermediate, staged)
    assert type(hits) is Hits and tuple(hits) == classified_plainly(active, cached, top_neurons, intermediate, staged)
    assert hits.needed == len(hits.top_hits) + len(hits.misses)
    assert all(type(part) is tuple for part in hits)
