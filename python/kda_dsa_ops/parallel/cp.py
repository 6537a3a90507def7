"""Context parallelism: one packed batch split along T over the ranks of a group, each rank
holding an equal contiguous share of the tokens (sequences that cross a share's bounds included).
Per-token layers run on the share as they are; the layers that mix tokens exchange what crosses
a bound:

  ShortConv   the last size - 1 rows before the share (halo)
  KDA         each rank's boundary segment (the sequence running past its share's end) gives its
              transition M and its final state from a zero start (kda_dsa_ops.segments), all
              gathered; a share's first sequence starts from the composition of its predecessors'
  MLA, DSA    the key rows (MLA latents and rope keys, indexer keys) all gathered; the share's
              queries attend to their sequences' keys from each sequence's start (the ops'
              bottom-right causal alignment), indices are rows of that key span

Every collective is autograd-aware: a row's gradient flows back to the rank that owns it (every
rank runs the same collectives in the same order, forward and backward). The losses are
normalised by the global counts, so that their mean over the ranks is the unsplit batch's loss
(and the mean of the gradients its gradient).
"""

from __future__ import annotations

import bisect

import torch
import torch.distributed as dist
from torch import Tensor

from ..segments import segment_start_states


class _Gather(torch.autograd.Function):
    """all_gather of same-shaped tensors, concatenated along dim 0; the backward sums the
    gradient over the ranks and keeps this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = grad.new_empty(ctx.rows, *grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def gather(x: Tensor, group=None) -> Tensor:
    """Every rank's x (same shapes) concatenated along dim 0 in rank order; differentiable."""
    return _Gather.apply(x, group)


class ContextParallel:
    """The split of one packed batch (cu_seqlens [N + 1], the same on every rank of `group`) into
    equal contiguous shares of T / world tokens, share r on rank r; the model takes
    cp.local(tokens) and cp.local(labels) with the global cu_seqlens and this object."""

    def __init__(self, cu_seqlens: Tensor | list[int], group=None):
        cu = [int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        total = cu[-1] if cu else 0
        if total == 0 or total % self.world:
            raise ValueError(f"context parallelism splits the batch's tokens ({total}) into {self.world} equal "
                             "shares: pack a multiple of the cp size")
        self.cu, self.share = cu, total // self.world
        self.lo, self.hi = self.rank * self.share, (self.rank + 1) * self.share
        self.first, self.last = self._sequences(self.rank)

    def _sequences(self, r: int) -> tuple[int, int]:
        """The first and last sequence with tokens in share r."""
        lo, hi = r * self.share, (r + 1) * self.share
        return bisect.bisect_right(self.cu, lo) - 1, bisect.bisect_right(self.cu, hi - 1) - 1

    @property
    def carries_in(self) -> bool:
        """This share's first sequence began in an earlier share."""
        return self.cu[self.first] < self.lo

    def local(self, x: Tensor) -> Tensor:
        """This rank's rows of a [T, ...] tensor of the whole batch."""
        return x[self.lo:self.hi]

    def matches(self, cu_seqlens: Tensor) -> bool:
        return cu_seqlens.tolist() == self.cu

    def cu_seqlens(self, device) -> Tensor:
        """The share's own packing: its part of each sequence it holds."""
        ends = [min(self.cu[n + 1], self.hi) - self.lo for n in range(self.first, self.last + 1)]
        return torch.tensor([0] + ends, dtype=torch.int32, device=device)

    def key_cu_seqlens(self, device) -> Tensor:
        """The packing of key_rows: each of the share's sequences from its start to the share's
        last token of it (Lk >= Lq: bottom-right aligned with cu_seqlens)."""
        start = self.cu[self.first]
        ends = [min(self.cu[n + 1], self.hi) - start for n in range(self.first, self.last + 1)]
        return torch.tensor([0] + ends, dtype=torch.int32, device=device)

    def positions(self, device) -> Tensor:
        """Each of the share's tokens' position within its (whole) sequence, int64."""
        t = torch.arange(self.lo, self.hi)
        starts = torch.tensor(self.cu[:-1])[torch.bucketize(t, torch.tensor(self.cu[1:]), right=True)]
        return (t - starts).to(device)

    def counts(self, count: int, device) -> tuple[int, int]:
        """(the sum of `count` over the earlier shares, over all shares): e.g. the image placeholders
        before this share's and in the batch."""
        counts = gather(torch.tensor([count], device=device), self.group)
        return int(counts[:self.rank].sum()), int(counts.sum())

    def halo(self, x: Tensor, rows: int) -> Tensor:
        """The `rows` rows of the whole batch just before this share (zeros before the first
        token), from the previous rank; differentiable."""
        if rows > self.share:
            raise ValueError(f"a halo of {rows} rows needs shares of at least that many tokens, got {self.share}")
        if rows == 0:
            return x[:0]
        tails = gather(x[-rows:], self.group)
        if self.rank == 0:
            return _zero_reaching(tails) + x.new_zeros(rows, *x.shape[1:])
        return tails[(self.rank - 1) * rows:self.rank * rows]

    def key_rows(self, x: Tensor) -> Tensor:
        """Rows of the whole batch from this share's first sequence's start to the share's end
        (key_cu_seqlens packs them): the keys its queries may see; differentiable."""
        return gather(x, self.group)[self.cu[self.first]:self.hi]

    def chunk_kda(self, backend, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, **options) -> Tensor:
        """backend.chunk_kda over the share (q, k, v, g, beta [1, share, ...]; options: chunk_kda's
        keywords but cu_seqlens, initial_state and output_final_state), each sequence continued
        from where the earlier shares left it. Returns o."""
        if k.shape[0] != 1:
            raise ValueError("context parallelism runs KDA on packed batches (B = 1)")
        HV, K, V = v.shape[2], k.shape[3], v.shape[3]
        # every rank: its last sequence's part (the boundary segment when it runs on), M and S_end(0)
        seg = [x[:, max(self.cu[self.last], self.lo) - self.lo:] for x in (q, k, v, g, beta)]
        M = backend.segment_transition(seg[1], seg[3], seg[4], **options)
        E = backend.chunk_kda(*seg, output_final_state=True, **options)[1]
        both = gather(torch.cat([M, E], dim=-1), self.group)  # [world, HV, K, K + V]
        state = _zero_reaching(both) + E.new_zeros(HV, K, V)
        if self.carries_in:  # the first sequence's segments on the earlier shares, composed in order
            pairs = both[self.cu[self.first] // self.share:self.rank + 1]
            state = state + segment_start_states(list(pairs[..., :K]), list(pairs[..., K:]))[-1]
        starts = torch.cat([state[None], state.new_zeros(self.last - self.first, HV, K, V)])
        return backend.chunk_kda(q, k, v, g, beta, initial_state=starts, cu_seqlens=self.cu_seqlens(q.device),
                                 **options)[0]


def _zero_reaching(x: Tensor) -> Tensor:
    """0 (exactly, whatever x holds) with a gradient path to x: the backward of a gather is a
    collective, so every rank's graph must reach every gather, used or not, in the same order."""
    return torch.where(x.new_zeros((), dtype=torch.bool), x, 0).sum()
