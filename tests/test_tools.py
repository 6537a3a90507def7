"""The analysis tools' counts on blocks small enough to count by hand."""

import lzma
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import mla_floors as mf  # noqa: E402
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


def _four_queries():
    # 16 heads: a block of 4 queries; q0 and q1 chose keys 0..63, q2 64..95, q3 96..127 (-1 after)
    none = torch.full((32,), -1)
    return torch.stack([torch.arange(64), torch.arange(64), torch.cat([torch.arange(64, 96), none]),
                        torch.cat([torch.arange(96, 128), none])])


def test_floors_block_counts():
    c = mf.block_counts(_four_queries(), 16)
    # pattern order: q3's 32 slots, q2's 32 (a tile: 2 queries), q0 and q1's 64 (a tile: 2 queries)
    assert c == {"entries": 192, "union": 128, "query_tiles": 4, "tiles": 2, "rows": 4 * 16}
    # 64 heads: a query a block, its own slots its union
    assert mf.block_counts(_four_queries(), 64)["union"] == 192


@pytest.mark.parametrize("ceiling", [1e12, 1e15])
def test_floors_bounds(ceiling):
    c = mf.block_counts(_four_queries(), 16)
    got = mf.floors(c, c, 16, ceiling)
    fwd, bwd = 2 * (576 + 512), 2 * (3 * 576 + 2 * 512)
    assert got["packed"]["fwd"] == pytest.approx((128 * 64 * fwd / ceiling, "tensor"))
    l2 = 128 * (4 * 576 / 3.84e12 + 2 * 576 / 8.52e12)  # dkv adds and gathers, once a union slot
    tensor = 128 * 64 * bwd / ceiling
    assert got["packed"]["bwd"] == pytest.approx((max(tensor, l2), "tensor" if tensor > l2 else "L2"))
    smem = 128 * 132 * 1.98e9
    per_query = (192 * (1152 + 2176) + 4 * 16 * 2176) / smem  # 4 tiles of 16 rows
    assert got["keys along the rows"]["fwd"] == pytest.approx(max((4 * 64 * 16 * fwd / ceiling, "tensor"),
                                                                   (per_query, "shared memory")))
    pattern_l2 = l2 + 64 * 4 * 576 / 3.84e12  # and dq's 64 rows (2 tiles of 32) added
    pattern = max((2 * 64 * 32 * bwd / ceiling, "tensor"), (pattern_l2, "L2"))
    assert got["pattern tiles"]["bwd"] == pytest.approx(pattern)
    # split: dkv over the same blocks' pattern tiles, dq a query at a time (4 tiles of 16 rows)
    split_tensor = (2 * 64 * 32 * 2 * (2 * 576 + 2 * 512) + 4 * 64 * 16 * 2 * (2 * 576 + 512)) / ceiling
    split_l2 = l2 + 192 * 2 * 576 / 8.52e12  # and each query's rows gathered again
    assert got["split backward"]["bwd"] == pytest.approx(max((split_tensor, "tensor"), (split_l2, "L2")))
    assert "fwd" not in got["split backward"]


def test_ab_dsa_runs_each_build(tmp_path, capsys):
    # three builds (a library, the same xz-compressed, each in a copy of this package; a package
    # directory), a round each, on the CPU: every case and pass timed in each, each from its own library
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import ab_dsa
    import index_sets

    import kda_dsa_ops

    library = kda_dsa_ops._C.__file__
    with open(library, "rb") as src, lzma.open(tmp_path / "c.so.xz", "wb", preset=0) as dst:
        shutil.copyfileobj(src, dst)
    sets = torch.stack([torch.randperm(48)[:16] for _ in range(48)]).int()
    index_sets.save(str(tmp_path / "sets.pt"), {0: sets}, "test")
    ab_dsa.main(["--build", f"lib={library}", "--build", f"xz={tmp_path / 'c.so.xz'}",
                 "--build", f"pkg={os.path.dirname(os.path.dirname(library))}",
                 "--cases", "gqa:8", "mla:16:m:d:p", "gqa:8:c", "--size", "32", "64", "16", "--device", "cpu", "--rounds", "1",
                 "--index-sets", str(tmp_path / "sets.pt")])
    out = capsys.readouterr().out.splitlines()
    assert os.path.join("lib", "kda_dsa_ops") in out[0] and os.path.join("xz", "kda_dsa_ops") in out[1]
    assert out[2].endswith(library)
    assert out[3] == "| case | lib | xz | pkg | xz / lib | pkg / lib |"
    rows = out[5:]
    assert [r.split(" | ")[0] for r in rows] == ["| gqa:8 fwd", "| gqa:8 sfag", "| mla:16:m:d:p fwd",
                                              "| mla:16:m:d:p sfag", "| gqa:8:c fwd", "| gqa:8:c sfag"]
    for r in rows:
        assert all(float(cell) > 0 for cell in r.strip("| ").split(" | ")[1:])


@pytest.mark.parametrize("case", ["gqa", "gqa:8:x", "gmm:8", "mla:eight", "gqa:8:r:d:d", "gqa:8:p", "mla:8:p:p",
                                  "mla:8:p:r"])
def test_ab_dsa_rejects_bad_cases(case):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import ab_dsa

    with pytest.raises(SystemExit, match="LAYOUT:HEADS"):
        ab_dsa.parse_case(case)


def test_ab_dsa_reads_flags_in_either_order():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import ab_dsa

    for case in ("mla:8:d:p", "mla:8:p:d", "mla:8:r:p:d"):
        assert ab_dsa.parse_case(case) == {"layout": "mla", "heads": 8, "sets": "r", "deterministic": True,
                                           "portable": True}
    assert ab_dsa.parse_case("gqa:16:w") == {"layout": "gqa", "heads": 16, "sets": "w", "deterministic": False,
                                             "portable": False}


def test_causal_sets():
    # query t: min(topk, t + 1) distinct keys of 0 .. t, then -1
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import index_sets

    T, topk = 40, 16
    idx = index_sets.causal_sets(T, topk, device="cpu")
    assert idx.shape == (T, 1, topk) and idx.dtype == torch.int32
    for t in range(T):
        row = idx[t, 0]
        keys = row[row >= 0]
        assert len(keys) == min(topk, t + 1) and bool((row[len(keys):] == -1).all())
        assert len(keys.unique()) == len(keys) and int(keys.max()) <= t
