import itertools

from tests.grids import pairwise


def test_pairwise_covers_every_pair_with_few_cases():
    factors = {"a": (1, 2, 3), "b": "xy", "c": (True, False), "d": (0.1, 0.2, 0.3, 0.4)}
    cases = pairwise(factors)
    for first, second in itertools.combinations(factors, 2):
        seen = {(case[first], case[second]) for case in cases}
        assert seen == set(itertools.product(factors[first], factors[second]))
    assert len(cases) < len(list(itertools.product(*factors.values())))
    assert cases == pairwise(factors)
