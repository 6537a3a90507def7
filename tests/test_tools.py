"""The analysis tools' counts on blocks small enough to count by hand."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import sfag_wavefronts as sw  # noqa: E402


def test_wavefronts_every_query_the_same_tile():
    # 8 queries, the same 32 keys: one tile, each query 2 steps of 4 conflict-free matrices a query
    block = torch.arange(32).repeat(8, 1)
    m = sw.members(block)
    assert m.shape == (32, 8) and bool(m.all())
    fixed = 8 * 24 * 4 + 64
    got = sw.block_counts(m).tolist()
    assert got[0] == 8 * 58 * 4
    assert got[1] == 8 * (32 * 4 + 16 * 2) + fixed  # slot order
    assert got[2] == got[3] == got[4] == 8 * 2 * (64 + 16) + fixed  # 4 rows a bank group: 2 full steps
    dq = 8 * 10 * 4
    assert got[5] == 8 * (16 * 4 + 16 * 2) + dq + fixed  # S, dP per query, slot order
    assert got[6] == got[7] == 8 * 2 * (32 + 16) + dq + fixed


@pytest.mark.parametrize("spread", [1, 8])
def test_wavefronts_bank_conflicts(spread):
    # query q chose 4 keys: rows q * 4 .. (spread 1: 4 bank groups, no conflict) or rows q + 8 j
    # (spread 8: all in bank group q % 8, a matrix of 4 rows costing 4); -1 entries ignored
    q = torch.arange(8)[:, None]
    rows = q * 4 + torch.arange(4) if spread == 1 else q + 8 * torch.arange(4)
    block = torch.cat([rows, torch.full((8, 3), -1)], 1)
    m = sw.members(block)
    assert m.shape == (32, 8) and int(m.sum()) == 32
    worst = 1 if spread == 1 else 4
    fixed = 8 * 24 * 4 + 64
    got = sw.block_counts(m).tolist()
    assert got[1] == 8 * (32 * (worst + 1) + 16) + fixed  # one step: its matrix and an empty one
    assert got[3] == 8 * (1 if spread == 1 else 2) * (64 + 16) + fixed  # the forward's queues: 2 a group a step
    assert got[4] == 8 * (64 + 16) + fixed  # the fewest steps: one
