"""DAPO dynamic sampling's group filter (algos/filter_groups.py) on hand-built reward tables."""

from __future__ import annotations

import numpy as np

from rlfoundry.algos.filter_groups import first_groups, informative_rows


def test_groups_whose_metric_varies_survive():
    #         a    a    b    b    c    d    d    d
    uids = ["a", "a", "b", "b", "c", "d", "d", "d"]
    acc = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5]
    keep = informative_rows(uids, acc)
    # a varies, b is all 1 (no signal), c has one sample (kept: nothing to compare), d varies
    assert keep.tolist() == [True, True, False, False, True, True, True, True]
    assert not informative_rows(["x"] * 4, [0.3] * 4).any()  # all-equal: dropped whatever the value


def test_the_first_groups_in_order_of_appearance_are_taken_whole():
    uids = np.array(["b", "a", "b", "c", "a", "c"], dtype=object)
    assert first_groups(uids, 2).tolist() == [True, True, True, False, True, False]
    assert first_groups(uids, 5).all()
    assert not first_groups(uids, 0).any()
