// Queries packed into the attention kernels' blocks (QueryPack, dsa_cuda.cuh): the union of a block
// of `group` queries' selections on a kv head, with each slot's queries and each entry's slot.
// Where the keys fit in shared memory one CTA a block marks each key's queries in a word per key
// and numbers the marked keys (count_kernel; a block that the split leaves unpacked only counts
// them); a block in which a query chose a key twice, or any block past that many keys, sorts its
// group x topk entries (key, query) instead (sort_kernel).
// The kernels take the packed blocks longest first (longest_first: deal_kernel).
#include <c10/cuda/CUDAGuard.h>

#include <cub/block/block_discontinuity.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/functional>
#include <cuda/std/functional>

#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

// A CTA's threads, and the entries (group x topk) of a block at most: 512 threads x 32 (instances
// for 8 and 16 entries a thread take the smaller blocks).
constexpr int kPackThreads = 512;
constexpr int64_t kPackEntries = kPackThreads * 32;
// count_kernel's words (one a key, 32 a warp at least): 192 KB of shared memory at most; the entries
// a thread loads at once (8: 31 registers, so four CTAs an SM where their words fit; 16 took 64
// registers, two CTAs an SM, and at 2 queries a block, Tk 8192, 0.230 ms against 0.182 now, H200).
constexpr int64_t kCountWords = 48 * 1024;
constexpr int kBatch = 8;
// The slots past a union's length that a kernel reads (its last tile's, as -1 and 0): up to a
// multiple of 128, the Hopper MLA forward's tile pairs and the GQA packed forward's tiles (the
// deterministic backward's sum masks the slots past each length). The rest stay unwritten.
constexpr int kPackTail = 128;

__device__ __forceinline__ int filled_slots(int length, int n) {
  return static_cast<int>(min(int64_t{n}, ceil_div(length, kPackTail) * kPackTail));
}

struct PackArgs {
  const int32_t* indices;  // [T, Hkv, topk]
  int64_t T, Tk;
  int Hkv, topk, group, bits;  // bits: of the largest sort key, group x Tk (an entry without a key)
  int chunk;                   // count_kernel: keys a warp numbers (a multiple of 32)
  bool repeats_only;           // sort_kernel: only the blocks count_kernel left (lengths -1)
  int split_limit;             // count_kernel: a longer union is only measured (QueryPack's split)
  // per CTA b: block b / Hkv's queries on kv head b % Hkv
  int32_t* union_idx;  // [blocks x Hkv, group x topk]
  uint8_t* member;     // [blocks x Hkv, group x topk]
  int32_t* lengths;    // [blocks x Hkv]
  int64_t* slot_of;    // [T, Hkv, topk], nullptr: not asked for
};

// CTA b's entries in indices (and slot_of): query g's j-th at base + g stride + j, for the
// queries g < queries (the last block's may be fewer than group).
struct Entries {
  int64_t base;
  int stride, queries;
  __device__ __forceinline__ Entries(const PackArgs& a, int64_t b) {
    const int64_t t0 = b / a.Hkv * a.group;
    base = (t0 * a.Hkv + b % a.Hkv) * a.topk;
    stride = a.Hkv * a.topk;
    queries = static_cast<int>(min(int64_t{a.group}, a.T - t0));
  }
  // Entry `place` (query g, slot s as g topk + s): its offset, -1 for none.
  __device__ __forceinline__ int64_t at(const PackArgs& a, uint32_t place) const {
    const int g = place / a.topk;
    return g < queries ? base + g * stride + place % a.topk : -1;
  }
};

// Entry `place` of CTA b: its key, -1 without one.
__device__ __forceinline__ int32_t key_of(const PackArgs& a, const Entries& es, uint32_t place) {
  const int64_t e = es.at(a, place);
  const int32_t k = e >= 0 ? a.indices[e] : -1;
  return k >= 0 && k < a.Tk ? k : -1;
}

// words[k]: bits 0-7 the block's queries that chose key k (group <= 8), from bit 8 the key's slot.
// The slots go in key order, as sort_kernel lays them out: warp w numbers keys w chunk .., 32 at a
// time, so that its stores of a run of slots are one request.
__global__ void __launch_bounds__(kPackThreads, 4) count_kernel(const PackArgs a) {
  constexpr int kWarps = kPackThreads / 32;
  __shared__ int marked_by[kWarps];  // marked keys per warp
  extern __shared__ uint4 words4[];
  uint32_t* words = reinterpret_cast<uint32_t*>(words4);
  const int64_t b = blockIdx.x, row = b * a.group * a.topk;
  const Entries es(a, b);
  const int32_t* first = a.indices + es.base;
  const int n = a.group * a.topk, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < a.chunk * kWarps / 4; i += kPackThreads) words4[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  // f(its offset from es.base, its query, its key) over the block's entries (g topk + j: query g's
  // j-th key; offset -1: past the last query), kBatch loads a thread in flight at once
  const auto each_entry = [&](auto&& f) {
    int g = threadIdx.x / a.topk, j = threadIdx.x % a.topk;
    for (int e0 = threadIdx.x; e0 < n; e0 += kBatch * kPackThreads) {
      int32_t k[kBatch];
      int at[kBatch], gk[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        at[i] = e0 + i * kPackThreads < n && g < es.queries ? g * es.stride + j : -1;
        k[i] = at[i] >= 0 ? first[at[i]] : -1;
        gk[i] = g;
        for (j += kPackThreads; j >= a.topk; j -= a.topk) ++g;
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) f(at[i], gk[i], k[i] >= 0 && k[i] < a.Tk ? k[i] : -1);
    }
  };
  bool repeat = false;
  each_entry([&](int, int g, int32_t k) {
    if (k >= 0) repeat |= (atomicOr(words + k, 1u << g) >> g & 1u) != 0;
  });
  if (__syncthreads_or(repeat)) {
    if (threadIdx.x == 0) a.lengths[b] = -1;
    return;
  }
  const int k0 = warp * a.chunk;
  int count = 0;
  for (int k = k0 + lane; k < k0 + a.chunk; k += 32) count += words[k] != 0;
  count = __reduce_add_sync(~0u, count);
  if (lane == 0) marked_by[warp] = count;
  __syncthreads();
  int slot = 0, length = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    slot += w < warp ? marked_by[w] : 0;
    length += marked_by[w];
  }
  if (length > a.split_limit) {  // the block's queries run unpacked
    if (threadIdx.x == 0) a.lengths[b] = length;
    return;
  }
  for (int k = k0 + lane; k < k0 + a.chunk; k += 32) {
    const uint32_t w = words[k], marked = __ballot_sync(~0u, w != 0);
    if (w != 0) {
      const int s = slot + __popc(marked & ((1u << lane) - 1));
      a.union_idx[row + s] = k;
      a.member[row + s] = static_cast<uint8_t>(w);
      words[k] = w | static_cast<uint32_t>(s) << 8;
    }
    slot += __popc(marked);
  }
  __syncthreads();
  if (a.slot_of != nullptr) {
    each_entry([&](int at, int, int32_t k) {
      if (at >= 0) a.slot_of[es.base + at] = k >= 0 ? static_cast<int64_t>(words[k] >> 8) : -1;
    });
  }
  for (int s = length + threadIdx.x; s < filled_slots(length, n); s += kPackThreads) {
    a.union_idx[row + s] = -1;
    a.member[row + s] = 0;
  }
  if (threadIdx.x == 0) a.lengths[b] = length;
}

// Each entry as key x group + query (group x Tk: no key), sorted: a key's entries are consecutive,
// and among them one query's copies of it. Per entry, in the sorted order: copy, which of its
// query's copies of the key it is (0, 1, ..); the key takes as many union slots as the most copies a
// query has of it, in key order, so the entry's slot is the key's first slot + copy. An entry whose
// copy exceeds every earlier copy of the key in the sorted order opens the slot (writes the key).
// Each thread holds kItems consecutive entries; after the sort, an entry's word carries its
// place (query g, slot s as g topk + s: bits 0-13), copy (bits 14-27), whether it opens its slot
// (bit 28) and has a key (bit 29), so that few arrays stay in registers.
template <int kItems>
union PackShared {
  typename cub::BlockRadixSort<uint32_t, kPackThreads, kItems, uint32_t>::TempStorage sort;
  typename cub::BlockDiscontinuity<uint32_t, kPackThreads>::TempStorage heads;
  typename cub::BlockScan<int, kPackThreads>::TempStorage scan;
  uint32_t member[kPackThreads * kItems];  // per slot, bit g: query g has the slot
};

template <int kItems>
__global__ void __launch_bounds__(kPackThreads, 1) sort_kernel(const PackArgs a) {
  if (a.repeats_only && a.lengths[blockIdx.x] >= 0) return;
  using Heads = cub::BlockDiscontinuity<uint32_t, kPackThreads>;
  using Scan = cub::BlockScan<int, kPackThreads>;
  extern __shared__ uint8_t smem_raw[];
  PackShared<kItems>& sh = *reinterpret_cast<PackShared<kItems>*>(smem_raw);
  constexpr uint32_t kPlace = (1u << 14) - 1, kOpens = 1u << 28, kHasKey = 1u << 29;
  const int64_t b = blockIdx.x;
  const Entries es(a, b);
  const int n = a.group * a.topk, pos0 = threadIdx.x * kItems;
  const uint32_t none = static_cast<uint32_t>(a.group * a.Tk);
  uint32_t key[kItems], word[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int32_t k = key_of(a, es, pos0 + i);
    key[i] = k >= 0 ? static_cast<uint32_t>(k) * a.group + (pos0 + i) / a.topk : none;
    word[i] = pos0 + i;
  }
  cub::BlockRadixSort<uint32_t, kPackThreads, kItems, uint32_t>(sh.sort).Sort(key, word, 0, a.bits);
  __syncthreads();
  int x[kItems], y[kItems];
  bool head[kItems];
  // copy = position - the start of the entry's (key, query) run
  Heads(sh.heads).FlagHeads(head, key, cuda::std::not_equal_to<>{});
#pragma unroll
  for (int i = 0; i < kItems; ++i) x[i] = head[i] ? pos0 + i : 0;
  __syncthreads();
  Scan(sh.scan).InclusiveScan(x, x, cuda::maximum<>{});
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    word[i] |= uint32_t(pos0 + i - x[i]) << 14 | (key[i] != none ? kHasKey : 0u);
    key[i] /= a.group;
  }
  Heads(sh.heads).FlagHeads(head, key, cuda::std::not_equal_to<>{});
  uint32_t key_head = 0;  // bit i: entry i starts a key's run
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    key_head |= uint32_t{head[i]} << i;
    y[i] = head[i];
  }
  __syncthreads();
  Scan(sh.scan).InclusiveSum(y, y);  // the key's run, 1..
  __syncthreads();
  // the most copies of the key before the entry (its copy + 1 maxima): a max scan of (run, copy + 1)
#pragma unroll
  for (int i = 0; i < kItems; ++i) x[i] = y[i] << 15 | int((word[i] >> 14) & kPlace) + 1;
  Scan(sh.scan).ExclusiveScan(x, x, 0, cuda::maximum<>{});
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int most = (x[i] >> 15) == y[i] ? x[i] & 0x7fff : 0;
    const bool opens = (word[i] & kHasKey) && int((word[i] >> 14) & kPlace) + 1 > most;
    word[i] |= opens ? kOpens : 0u;
    y[i] = opens;
  }
  int length;
  Scan(sh.scan).ExclusiveSum(y, x, length);  // x: the slots opened before the entry
  __syncthreads();
  // the key's first slot: the slots opened before its run (non-decreasing, so a max scan)
#pragma unroll
  for (int i = 0; i < kItems; ++i) x[i] = (key_head >> i) & 1 ? x[i] : 0;
  Scan(sh.scan).InclusiveScan(x, x, cuda::maximum<>{});
  __syncthreads();
  for (int s = threadIdx.x; s < n; s += kPackThreads) sh.member[s] = 0;
  __syncthreads();
  const int64_t row = b * n;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const uint32_t place = word[i] & kPlace;
    const bool has = word[i] & kHasKey;
    const int slot = x[i] + static_cast<int>((word[i] >> 14) & kPlace);
    if (has) {
      atomicOr(sh.member + slot, 1u << (place / a.topk));
      if (word[i] & kOpens) a.union_idx[row + slot] = key_of(a, es, place);
    }
    const int64_t at = es.at(a, place);
    if (a.slot_of != nullptr && at >= 0) a.slot_of[at] = has ? slot : -1;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < filled_slots(length, n); s += kPackThreads) {
    a.member[row + s] = static_cast<uint8_t>(sh.member[s]);
    if (s >= length) a.union_idx[row + s] = -1;
  }
  if (threadIdx.x == 0) a.lengths[b] = length;
}

// longest_first's deal: item i's rank among the lengths, longest first (in index order among
// equals), and its place in the order: rank, in reverse within each odd round of `round` ranks. A
// warp an item.
constexpr int kDealThreads = 256;
struct DealArgs {
  const int32_t* lengths;
  int items, round;
  int32_t* order;
};

__global__ void __launch_bounds__(kDealThreads) deal_kernel(const DealArgs a) {
  const int i = blockIdx.x * (kDealThreads / 32) + threadIdx.x / 32;
  if (i >= a.items) return;
  const int32_t mine = a.lengths[i];
  int rank = 0;
  for (int j = threadIdx.x % 32; j < a.items; j += 32) rank += a.lengths[j] > mine || (a.lengths[j] == mine && j < i);
  rank = __reduce_add_sync(~0u, rank);
  const int first = rank / a.round * a.round, last = min(first + a.round, a.items) - 1;
  if (threadIdx.x % 32 == 0) a.order[rank / a.round % 2 == 1 ? first + last - rank : rank] = i;
}

}  // namespace

at::Tensor longest_first(const at::Tensor& lengths, int64_t round) {
  const int64_t items = lengths.numel();
  at::Tensor order = at::empty({items}, lengths.options());
  if (items == 0) return order;
  const DealArgs deal{lengths.data_ptr<int32_t>(), static_cast<int>(items),
                      static_cast<int>(std::min(round, items)), order.data_ptr<int32_t>()};
  launch(deal_kernel, dim3(ceil_div(items, kDealThreads / 32)), kDealThreads, 0, deal);
  return order;
}

QueryPack pack_queries(const AttnProblem& p, const at::Tensor& q, const at::Tensor& indices, bool slots,
                       double split) {
  QueryPack pk;
  pk.problem = p;
  pk.rows_total = p.T * p.H;
  pk.indices = indices;
  const int64_t G = p.Hkv > 0 ? p.H / p.Hkv : 0;
  const int64_t group = p.topk > 0 && G > 0 ? std::min<int64_t>(64 / G, kPackEntries / p.topk) : 0;
  // (the portable forward sums p over a block's rows, not per query: unpacked when p is asked for)
  const bool mla = mla_fwd_takes(p, q);
  if ((G != 8 && G != 16 && G != 32) || p.T < 2 || group < 2 || (slots && !mla) ||
      (p.Tk + 1) * group > std::numeric_limits<uint32_t>::max()) {
    return pk;
  }
  const int64_t n = group * p.topk, blocks = ceil_div(p.T, group);
  const bool splits = split > 0 && !mla && G < 32;
  const int split_limit = splits ? static_cast<int>(split * n) : std::numeric_limits<int>::max();
  const at::TensorOptions opt = indices.options();
  pk.indices = at::empty({blocks, p.Hkv, n}, opt);
  pk.member = at::empty({blocks, p.Hkv, n}, opt.dtype(at::kByte));
  pk.lengths = at::empty({blocks, p.Hkv}, opt);
  if (slots) pk.slot_of = at::empty({p.T, p.Hkv, p.topk}, opt.dtype(at::kLong));
  const int chunk = static_cast<int>(ceil_div(p.Tk, kPackThreads) * 32);
  PackArgs a{indices.data_ptr<int32_t>(),
             p.T,
             p.Tk,
             static_cast<int>(p.Hkv),
             static_cast<int>(p.topk),
             static_cast<int>(group),
             0,
             chunk,
             false,
             split_limit,
             pk.indices.data_ptr<int32_t>(),
             pk.member.data_ptr<uint8_t>(),
             pk.lengths.data_ptr<int32_t>(),
             slots ? pk.slot_of.data_ptr<int64_t>() : nullptr};
  while ((uint64_t{1} << a.bits) <= static_cast<uint64_t>(group * p.Tk)) ++a.bits;
  const c10::cuda::CUDAGuard guard(q.device());
  if (int64_t{chunk} * (kPackThreads / 32) <= kCountWords) {
    launch(count_kernel, dim3(blocks * p.Hkv), kPackThreads, sizeof(uint32_t) * chunk * (kPackThreads / 32), a);
    a.repeats_only = true;
  }
  const auto sort = [&](auto items) {
    constexpr int kItems = decltype(items)::value;
    launch(sort_kernel<kItems>, dim3(blocks * p.Hkv), kPackThreads, sizeof(PackShared<kItems>), a);
  };
  if (n <= kPackThreads * 8) {
    sort(std::integral_constant<int, 8>{});
  } else if (n <= kPackThreads * 16) {
    sort(std::integral_constant<int, 16>{});
  } else {
    sort(std::integral_constant<int, 32>{});
  }
  pk.group = group;
  pk.query_rows = static_cast<int>(G);
  if (splits) {
    pk.split_lengths = pk.lengths;
    pk.split_limit = split_limit;
    pk.call = p;
    pk.call_indices = indices;
  }
  pk.problem.T = blocks;
  pk.problem.H = group * p.H;
  pk.problem.topk = n;
  return pk;
}

}  // namespace kda_dsa_ops::dsa
