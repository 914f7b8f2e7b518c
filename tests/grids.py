"""Test grids: pairwise coverings, so that kernel tests (slow in the Triton interpreter) cover every pair of
factor values without the full product."""
from __future__ import annotations

import itertools


def pairwise(factors: dict) -> list[dict]:
    """Greedy all-pairs covering, deterministic: each case starts from the first uncovered pair and
    takes, factor by factor, the value that covers most still-uncovered pairs (first value on ties)."""
    names = list(factors)
    sizes = [len(factors[name]) for name in names]
    uncovered = [
        (i, vi, j, vj)
        for i, j in itertools.combinations(range(len(names)), 2)
        for vi in range(sizes[i]) for vj in range(sizes[j])
    ]
    cases = []
    while uncovered:
        i, vi, j, vj = uncovered[0]
        chosen = {i: vi, j: vj}
        for k in range(len(names)):
            if k not in chosen:
                gain = [
                    sum((min(k, m), v if k < m else chosen[m], max(k, m), chosen[m] if k < m else v) in uncovered
                        for m in chosen)
                    for v in range(sizes[k])
                ]
                chosen[k] = gain.index(max(gain))
        uncovered = [
            pair for pair in uncovered if not (chosen[pair[0]] == pair[1] and chosen[pair[2]] == pair[3])
        ]
        cases.append({names[k]: factors[names[k]][chosen[k]] for k in range(len(names))})
    return cases


def case_ids(cases: list[dict]) -> list[str]:
    def short(value):
        return str(value).replace("torch.", "").replace(" ", "")
    return ["-".join(f"{name}={short(value)}" for name, value in case.items()) for case in cases]
