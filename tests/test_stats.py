"""`experiments.stats`: Holm's correction and bootstrap intervals against values by hand."""

import numpy as np
import pytest

from experiments.stats import bootstrap_mean_ci, holm


def test_holm_by_hand():
    # sorted: 0.01 (x3 = 0.03), 0.02 (x2 = 0.04), 0.04 (x1 = 0.04); back in the given order.
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    # monotone: a later rank never gets a smaller adjusted p than an earlier one
    assert holm([0.01, 0.011, 0.5]) == pytest.approx([0.03, 0.03, 0.5])
    assert holm([0.6, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible():
    values = {"a": [0.0, 1.0] * 20, "b": [1.0] * 10}
    mean, low, high = bootstrap_mean_ci(values)
    assert mean == pytest.approx((0.5 + 1.0) / 2)  # mean over datasets of dataset means
    assert low < mean < high and high <= 1.0
    # b has no variance: the interval is a's halved; a's sd of the mean is 0.5/sqrt(40)
    assert high - low == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(40) / 2, rel=0.25)
    assert bootstrap_mean_ci(values) == (mean, low, high)
    assert bootstrap_mean_ci({"a": [2.0, 2.0]}) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_mean_ci({})
