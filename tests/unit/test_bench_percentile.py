"""The benchmarks' percentile: numpy's default (linear) method, through statistics.quantiles."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from moonserve.pipeline.bench.client import percentile


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 1001])
@pytest.mark.parametrize("q", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_percentile_is_numpys_linear_percentile(n, q):
    values = [random.Random(n).expovariate(1 / 50) for _ in range(n)]
    assert percentile(values, q) == pytest.approx(np.percentile(values, 100 * q), rel=1e-12)


def test_percentile_of_nothing_is_nan_and_q_is_a_whole_percent():
    assert math.isnan(percentile([], 0.5))
    with pytest.raises(ValueError, match="not a whole percent"):
        percentile([1.0, 2.0], 0.995)
