"""Hypothesis strategies for op inputs: shapes that include the awkward cases (zero-token
experts, counts not a multiple of 8, one-token batches, all-dropped experts)."""

from hypothesis import strategies as st

# Every test that draws tensors from torch's generator takes a seed from hypothesis, so that a
# failing example replays with the same tensors.
SEEDS = st.integers(0, 2**32 - 1)


@st.composite
def expert_counts(draw, max_experts=9, max_count=70):
    """Rows per expert, zeros and odd counts included."""
    E = draw(st.integers(1, max_experts))
    counts = draw(st.lists(st.one_of(st.just(0), st.integers(1, max_count)), min_size=E, max_size=E))
    return counts


@st.composite
def gemm_dims(draw, multiple_of=1, max_dim=200):
    """(K, N), each a multiple of `multiple_of` (8 for the CUDA kernel's 16-byte rows)."""
    k = draw(st.integers(1, max_dim // multiple_of)) * multiple_of
    n = draw(st.integers(1, max_dim // multiple_of)) * multiple_of
    return k, n


@st.composite
def routing_case(draw, max_tokens=40, max_experts=40):
    """(T, E, k): at least one token, k <= E."""
    T = draw(st.integers(1, max_tokens))
    E = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, min(E, 8)))
    return T, E, k


@st.composite
def seqlens(draw, max_seqs=4, max_len=20, min_len=1):
    return draw(st.lists(st.integers(min_len, max_len), min_size=1, max_size=max_seqs))
