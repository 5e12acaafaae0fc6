"""The gateway's bounded memory of compiled-grammar keys (plain Python)."""

import pytest

from gateway.grammar_refs import GrammarRefs


def test_a_remembered_constraint_is_a_hit_and_others_miss():
    refs = GrammarRefs(max_entries=4)
    assert refs.get(b"a") is None
    refs.put(b"a", "ref-a")
    assert refs.get(b"a") == "ref-a" and refs.get(b"b") is None
    assert (refs.hits, refs.misses) == (1, 2)


def test_oldest_unused_entry_leaves_first_when_entries_overflow():
    refs = GrammarRefs(max_entries=3)
    for k in (b"a", b"b", b"c"):
        refs.put(k, k.decode())
    refs.get(b"a")  # now the newest
    refs.put(b"d", "d")
    assert len(refs) == 3 and refs.get(b"b") is None
    assert [refs.get(k) for k in (b"a", b"c", b"d")] == ["a", "c", "d"]


def test_bytes_bound_evicts_and_an_oversized_constraint_is_not_kept():
    refs = GrammarRefs(max_entries=100, max_bytes=10)
    refs.put(b"x" * 6, 1)
    refs.put(b"y" * 6, 2)  # 12 bytes > 10: the first leaves
    assert refs.get(b"x" * 6) is None and refs.get(b"y" * 6) == 2
    refs.put(b"z" * 11, 3)
    assert refs.get(b"z" * 11) is None and len(refs) == 1


def test_putting_a_key_again_replaces_it_without_double_counting_bytes():
    refs = GrammarRefs(max_entries=10, max_bytes=8)
    refs.put(b"abcd", 1)
    refs.put(b"abcd", 2)
    refs.put(b"efgh", 3)
    assert refs.get(b"abcd") == 2 and refs.get(b"efgh") == 3


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        GrammarRefs(max_entries=-1)
