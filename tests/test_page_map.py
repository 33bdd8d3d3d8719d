"""PageMap (open-addressing logical page -> page id map) against a plain dict."""
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv_c._page_map import PageMap


def test_table_length_is_a_power_of_two_at_least_twice_the_capacity():
    for capacity in (1, 2, 3, 5, 64, 100):
        length = PageMap(capacity).table_length
        assert length >= 2 * capacity
        assert length & (length - 1) == 0


def test_insert_find_discard():
    pages = PageMap(4)
    pages.assign(7, 0)
    pages.assign(2**63 - 1, 1)
    pages.assign(0, 2)
    assert len(pages) == 3
    assert pages.find(7) == 0 and pages.find(2**63 - 1) == 1 and pages.find(0) == 2
    assert pages.find(8) == -1
    pages.assign(7, 3)  # replaces, does not add
    assert len(pages) == 3 and pages.find(7) == 3
    assert pages.discard(7) is True
    assert pages.discard(7) is False
    assert pages.to_dict() == {2**63 - 1: 1, 0: 2}
    pages.check_invariants()
    pages.clear()
    assert len(pages) == 0 and pages.to_dict() == {}


def test_full_map_rejects_a_new_key_and_keeps_its_entries():
    pages = PageMap(2)
    pages.assign(1, 0)
    pages.assign(2, 1)
    with pytest.raises(OverflowError, match="capacity of 2"):
        pages.assign(3, 0)
    assert pages.to_dict() == {1: 0, 2: 1}


@pytest.mark.parametrize(
    "call, args, exc",
    [
        ("find", (-1,), ValueError),
        ("find", (1.0,), TypeError),
        ("assign", (-5, 0), ValueError),
        ("assign", (5, -1), ValueError),
        ("discard", (True,), TypeError),
    ],
)
def test_bad_arguments(call, args, exc):
    pages = PageMap(3)
    pages.assign(1, 1)
    with pytest.raises(exc):
        getattr(pages, call)(*args)
    assert pages.to_dict() == {1: 1}


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        PageMap(0)


# Keys drawn from a small set collide often in a small table (long probe runs,
# wrap-around at the table end), and huge keys exercise the 64-bit hashing.
keys = st.one_of(st.integers(0, 40), st.integers(2**62, 2**63 - 1))


class PageMapMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 12))
    def make(self, capacity):
        self.pages = PageMap(capacity)
        self.model = {}
        self.capacity = capacity

    @rule(key=keys, page_id=st.integers(0, 100))
    def assign(self, key, page_id):
        if key not in self.model and len(self.model) == self.capacity:
            with pytest.raises(OverflowError):
                self.pages.assign(key, page_id)
            return
        self.pages.assign(key, page_id)
        self.model[key] = page_id

    @rule(key=keys)
    def discard(self, key):
        assert self.pages.discard(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(key=keys)
    def find(self, key):
        assert self.pages.find(key) == self.model.get(key, -1)

    @rule()
    def clear(self):
        self.pages.clear()
        self.model.clear()

    @invariant()
    def matches_model(self):
        self.pages.check_invariants()
        assert len(self.pages) == len(self.model)
        assert self.pages.to_dict() == self.model
        for key, page_id in self.model.items():
            assert self.pages.find(key) == page_id


TestPageMapMachine = PageMapMachine.TestCase
TestPageMapMachine.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
