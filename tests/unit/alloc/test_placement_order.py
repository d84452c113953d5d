"""The node placement policies as a table (binpack, spread), and the one "largest pieces first"."""

from __future__ import annotations

import pytest

from deviceplugin.alloc.placement import UNIT_ORDER, choose_unit, largest_first


def test_the_table_holds_the_node_policies():
    assert set(UNIT_ORDER) == {"binpack", "spread"}
    assert sorted([3, 1, 2], key=UNIT_ORDER["binpack"]) == [1, 2, 3]  # the fullest first
    assert sorted([3, 1, 2], key=UNIT_ORDER["spread"]) == [3, 2, 1]  # the emptiest first


@pytest.mark.parametrize(
    "policy, free, totals, unit",
    [
        ("binpack", [4, 1, 2], [4, 4, 4], 2),  # wanted 2: the fullest that fits
        ("spread", [4, 1, 2], [4, 4, 4], 0),
        ("fgdstrand", [4, 1, 2], [4, 2, 4], 2),  # units of unequal sizes: binpack
        ("unknown", [4, 1, 2], [4, 4, 4], 2),  # the config refuses it; binpack, as before
        ("spread", [3, 3, 1], [4, 4, 4], 0),  # a tie: the lowest index
    ],
)
def test_choose_unit_orders_by_the_table(policy, free, totals, unit):
    assert choose_unit(policy, free, totals, 2) == unit


@pytest.mark.parametrize("free, order", [([2, 3, 1], [1, 0, 2]), ([1, 1, 0, 2], [3, 0, 1, 2]), ([], [])])
def test_largest_first_ties_to_the_lowest_index(free, order):
    assert largest_first(free) == order
