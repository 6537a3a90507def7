"""How the bf16 rounding of the KDA backward's pair operands reaches the gate's gradients (CPU,
float64 emulation; python tools/kda_pair_rounding.py).

A pair (t, s <= t) of one chunk enters dg's per-step terms twice, as P_ts at step t and -P_ts at
step s (P_ts = (beta dA_ts k_t + dAqk_ts q_t) k_s exp(G_t - G_s) per channel). dg's reverse cumsum
is then weighted by the cumulative log-decay from the sequence start in the in-kernel gate's
gradients (dA_log = sum_u term_u Gw_u for the softplus gate), so the two entries must round alike:
otherwise the difference is multiplied by |Gw|, which grows along the sequence. Printed per scheme:
the RMS over random chunks of the weighted sum's error, over the size of its terms.

  kernel:         the bf16 backward as it is: pairs inside a diagonal 16 x 16 block exact, pairs
                  across blocks as products through block references (G of the block's first row
                  for its rows' terms, of the next block's first row for its columns'), operands
                  rounded to bf16, the factors outside the products not
  block midpoints: the tried variant (991ae06): the mild diagonal blocks' own pairs as products too,
                  every reference of a mild block its midpoint, its rows' factors rounded as its
                  operands are
  exponent split: every operand a bf16 mantissa rounded once per element (k_t 2^(G_t - e_t),
                  e_t = floor(G_t)) times an exact power of two for any integer reference, so each
                  pair has one product wherever it enters
  one midpoint:   a whole chunk through one reference (where its range allows), the factors
                  rounded as the operands are
"""

import math

import torch

F = torch.float64


def bf(x):
    return x.to(torch.bfloat16).to(F)


def chunk(gate, K, generator):
    kn, qn = (torch.nn.functional.normalize(torch.randn(64, K, dtype=F, generator=generator), dim=-1) for _ in range(2))
    x = torch.randn(64, K, dtype=F, generator=generator)
    g = -math.exp(0.5) * torch.nn.functional.softplus(x - 1.0) if gate == "softplus" else -5.0 * torch.sigmoid(x)
    dA = 0.1 * torch.randn(64, 64, dtype=F, generator=generator).tril(-1)  # beta_t dA_ts, s < t
    dQ = 0.1 * torch.randn(64, 64, dtype=F, generator=generator).tril(0)   # dAqk_ts, s <= t
    return kn, qn, g, dA, dQ


def pair_terms(dA, dQ, ku, qu, kd):
    """Each pair's A and Aqk parts from row factors (ku, qu of step t) and key factors (kd of s)."""
    return dA[:, :, None] * ku[:, None, :] * kd[None, :, :] + dQ[:, :, None] * qu[:, None, :] * kd[None, :, :]


def schemes(kn, qn, G, dA, dQ):
    """Per scheme: the pair terms (row entry, column entry), each [t, s, channel]."""
    t = torch.arange(64)
    blk = t // 16
    lower = (t[:, None] >= t[None, :])[..., None]
    same = (blk[:, None] == blk[None, :])[..., None]
    exact = pair_terms(dA, dQ, kn, qn, kn) * torch.exp2(G[:, None, :] - G[None, :, :])
    out = {}

    def by_references(R, C, own, rounded):
        """Row entries through R (per row step), column entries through C (per column step);
        pairs in the blocks marked own as products, other in-block pairs exact."""
        def rnd(x):
            return torch.where(rounded[:, None], bf(x), x)

        key = bf(kn[None, :, :] * torch.exp2(R[:, None, :] - G[None, :, :]))  # k_s 2^(R_t - G_s)
        up = torch.exp2(G - R)
        row = (dA[:, :, None] * rnd(kn * up)[:, None, :] + dQ[:, :, None] * rnd(qn * up)[:, None, :]) * key
        down = torch.exp2(G[:, None, :] - C[None, :, :])  # 2^(G_t - C_s)
        col = (dA[:, :, None] * bf(kn[:, None, :] * down) + dQ[:, :, None] * bf(qn[:, None, :] * down)) \
            * rnd(kn * torch.exp2(C - G))[None, :, :]
        products = lower & (~same | own[:, None, None])
        return (torch.where(products, row, exact), torch.where(products, col, exact))

    first, after = G[blk * 16], G[torch.clamp(blk * 16 + 16, max=63)]
    never = torch.zeros(64, dtype=torch.bool)
    out["kernel"] = by_references(first, after, never, never)
    mid = 0.5 * (G[blk * 16] + G[blk * 16 + 15])
    mild = (G[blk * 16] - G[blk * 16 + 15] <= 96).all(dim=-1)
    out["block midpoints"] = by_references(torch.where(mild[:, None], mid, first),
                                           torch.where(mild[:, None], mid, after), mild, mild)
    e = torch.floor(G)
    split = pair_terms(dA, dQ, bf(kn * torch.exp2(G - e)), bf(qn * torch.exp2(G - e)), bf(kn * torch.exp2(e - G))) \
        * torch.exp2(e[:, None, :] - e[None, :, :])
    out["exponent split"] = (split, split)
    if bool((G[0] - G[63] <= 96).all()):
        Gm = 0.5 * (G[0] + G[63])
        one = pair_terms(dA, dQ, bf(kn * torch.exp2(G - Gm)), bf(qn * torch.exp2(G - Gm)), bf(kn * torch.exp2(Gm - G)))
        out["one midpoint"] = (one, one)
    return exact, out


def main(trials=20, K=128):
    generator = torch.Generator().manual_seed(0)
    for gate in ("softplus", "bounded"):
        for start in (0.0, -300.0):  # the cumulative log-decay at the chunk's start
            errors = {}
            for _ in range(trials):
                kn, qn, g, dA, dQ = chunk(gate, K, generator)
                G = torch.cumsum(g, 0) / math.log(2)  # log2 units, from the chunk's start
                Gw = start + torch.cumsum(g, 0)        # natural log, from the sequence's start
                exact, out = schemes(kn, qn, G, dA, dQ)
                size = ((exact.abs().sum(1) + exact.abs().sum(0)) * Gw.abs()).sum()
                for name, (row, col) in out.items():
                    err = ((row.sum(1) - col.sum(0) - exact.sum(1) + exact.sum(0)) * Gw).sum() / size
                    errors.setdefault(name, []).append(err.item() ** 2)
            print(f"{gate} gate, cumulative log-decay {start:g} at the chunk's start:")
            for name, sq in errors.items():
                print(f"  {math.sqrt(sum(sq) / len(sq)):.2e}  {name} ({len(sq)} chunks)")


if __name__ == "__main__":
    main()
