"""The one table of tolerances: relative RMS error, ||actual - expected|| / ||expected||, against
the float64 reference evaluated on the same (already rounded) inputs. Keyed by the dtype the op
computes its output in; never loosened to make a test pass."""

import torch

REL_RMS = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,   # fp32 accumulation
    torch.float16: 1e-3,   # output rounding (2^-11) plus fp32 accumulation
    torch.bfloat16: 8e-3,  # output rounding (2^-8) plus fp32 accumulation
}

# The CUDA KDA kernel computes in fp32 with its products on the tensor cores as 3xTF32 (each
# operand split into two tf32 halves, three MMAs): a product is exact to about 2^-21 instead of
# fp32's 2^-24, so its fp32 results are held to 8x the fp32 row (a hypothesis example with T = 1
# and two value heads per query head, whose dq is one cancelling sum of 256 products, measured
# 2.0e-6 against the plain fp32 row).
CUDA_KDA_REL_RMS = {**REL_RMS, torch.float32: 8 * REL_RMS[torch.float32]}
# With matmul_precision="medium" (the default for bf16 / fp16 inputs) the CUDA KDA kernels round
# the operands of their products to bf16 (fp32 accumulation and state, flash-linear-attention's
# precision): every output, gradient and the final state then carry that rounding (2^-9 per
# operand) and are held to the bf16 row, whatever their dtype.

# A whole model (many ops deep) against the same model on reference ops: each op is within
# REL_RMS, but a gradient summed over every token and layer (a decay rate, a norm weight) adds
# the ops' errors up and can cancel to a fraction of its terms.
MODEL_REL_RMS = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
}


# Our model on a real checkpoint against transformers' eager implementation of it (the judge), in
# float64: the judge itself rounds to fp32 inside (its RMS norms, rope tables, router and indexer
# cast to float32 whatever the model's dtype), so agreement stops near fp32's precision; bf16 runs
# of our kernels (GPU) against the float64 judge are held to the bf16 row.
JUDGE_REL_RMS = {
    torch.float64: 1e-6,
    torch.bfloat16: REL_RMS[torch.bfloat16],
}
# A model with KDA layers: the judge runs its whole chunked delta rule in float32 (q, k, v, g and
# beta cast down, fp32 state), ~5e-7 per KDA layer at unit-scale weights; over the 4-layer Kimi
# Linear checkpoint of the tests the judge in float32 differs from itself in float64 by 1.7e-6,
# and our float64 model differs from the float64 judge by up to 1.8e-6 (GLM-5.3's: 1.2e-6 with
# images). At transformers' own initialisation every family is held to the float64 row.
JUDGE_KDA_REL_RMS = {**JUDGE_REL_RMS, torch.float64: 2e-6}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    denom = e.norm().item()
    if scale is not None:
        denom = max(denom, scale.detach().to(torch.float64).norm().item())
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = "output",
                 scale: torch.Tensor | None = None, table: dict = REL_RMS) -> None:
    """Shapes equal, no NaN/inf where the reference is finite, relative RMS within table[dtype]
    (REL_RMS for an op, MODEL_REL_RMS for a composed model).

    scale: for outputs that cancel to (near) zero, the size of the terms that cancel; the error
    is then measured against max(||expected||, ||scale||).
    """
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values where the reference is finite"
    err = rel_rms(a, e, scale)
    tol = table[dtype]
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e} ({dtype})"
