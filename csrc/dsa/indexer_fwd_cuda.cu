// The lightning indexer's forward on sm_90a (TMA, wgmma), and the row sort of its results.
//   I[t, s] = sum_j w[t, j] ReLU(q[t, j] . k[s]) over the keys s visible to t; top-k by I.
#include <c10/cuda/CUDAGuard.h>
#include "common/pipeline.cuh"
#include "common/tma.h"

#include "common/dispatch.h"
#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa {

namespace {

// Forward (sm_90a). A block scores 4 consecutive queries against the keys any of them sees, in
// tiles of 64 keys that a producer thread streams by TMA into a 3-stage ring (128B-swizzled,
// 64 keys x 128 dims of 16-bit values). Two consumer warpgroups own two queries each: wgmma
// m64n128k16 gives keys x (2 queries x 64 heads), tiles in pairs (two accumulator sets: one
// tile's wgmmas run while the other's scores are reduced).
// ReLU, the weights and the sum over heads stay in registers (16 heads per thread, then across
// the 4 lanes of a quad); a key whose candidate beats its query's threshold enters the query's
// buffer. A buffer within one tile of full is cut back to its top-k by a radix select, which
// also sets the threshold to the k-th best; at the end the survivors are written, unsorted, and
// indexer_sort_kernel orders them.
// Candidates are (descending score bits << 32 | key): ascending order is score descending, ties
// to the lower key.
struct IdxFwd : sm90::WarpSpecialized<2, 40, 232> {
  static constexpr int kQueries = 4, kQueriesPerGroup = kQueries / kConsumers;
  static constexpr int kStages = 3;
  using Ring = sm90::StageRing<kStages>;
  static constexpr int kChunkBytes = kIdxKeys * 128;                         // 64 keys x 64 dims
  static constexpr int kStageBytes = 2 * kChunkBytes;                        // x 128 dims
  static constexpr int kQChunkBytes = kQueriesPerGroup * kIdxRows * 128;     // 128 columns x 64 dims
  static constexpr int kQBytes = kConsumers * 2 * kQChunkBytes;
  static constexpr int kSlack = 1024;                                       // buffer room past topk
  static constexpr int kPerThread = (kMaxTopk + kSlack) / 128;               // of a cut, in registers
  static int capacity(int topk) { return topk + kSlack; }
};

// A forward block's shared state besides the tiles and the candidate buffers.
struct IdxFwdShared {
  IdxFwd::Ring ring;
  uint64_t threshold[IdxFwd::kQueries];  // a candidate enters below it
  uint64_t kept_max[IdxFwd::kConsumers];
  uint64_t range[IdxFwd::kConsumers][2];  // a cut's smallest and largest candidate
  int64_t key_start[IdxFwd::kQueries], visible[IdxFwd::kQueries];
  float w[IdxFwd::kQueries][kIdxRows];
  int hist[IdxFwd::kConsumers][256];
  int digit[IdxFwd::kConsumers][3];  // a radix pass's bin, the count before it, its count
  int count[IdxFwd::kQueries], kept[IdxFwd::kConsumers];
};

struct IndexerArgs {
  const void* q;
  const float* w;
  const int32_t* cu_q;
  const int32_t* cu_k;
  int64_t T, Tk;  // keys outside [0, Tk) (bad cu_seqlens values) are never selected
  int N, Hi, Di, topk, cap;
  int32_t* indices;
  float* scores;
};

__device__ __forceinline__ void group_sync(int group) { sm90::named_barrier_sync(1 + group, 128); }

// Cuts a query's candidates buf[0, n) (distinct, n > topk) back to the topk smallest, in any
// order, and sets *count = topk and *threshold = the largest kept. A radix select: the bits all
// candidates share (those of their minimum and maximum) are skipped, then 8-bit digits from the
// most significant narrow down the topk-th smallest. The 128 threads of consumer warpgroup `group`
// call it; sh.range, kept and kept_max hold their initial values on entry and again on return.
__device__ void cut_to_topk(uint64_t* buf, int n, int topk, IdxFwdShared& sh, int group, int* count,
                            uint64_t* threshold) {
  constexpr int kPer = IdxFwd::kPerThread;
  const int tid = threadIdx.x % 128, lane = threadIdx.x % 32;
  int* hist = sh.hist[group];
  uint64_t e[kPer];
  uint64_t smallest = ~uint64_t{0}, largest = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const bool valid = tid + 128 * j < n;
    e[j] = valid ? buf[tid + 128 * j] : ~uint64_t{0};
    smallest = e[j] < smallest ? e[j] : smallest;
    largest = valid && e[j] > largest ? e[j] : largest;
  }
  smallest = warp_reduce(smallest, MinOp{});
  largest = warp_reduce(largest, MaxOp{});
  if (lane == 0) {
    atomicMin(reinterpret_cast<unsigned long long*>(&sh.range[group][0]), smallest);
    atomicMax(reinterpret_cast<unsigned long long*>(&sh.range[group][1]), largest);
  }
  for (int b = tid; b < 256; b += 128) hist[b] = 0;
  group_sync(group);
  // The highest bit in which candidates differ; the bits above it are the prefix of them all.
  const int top = 63 - __clzll(static_cast<long long>(sh.range[group][0] ^ sh.range[group][1]));
  uint64_t mask = top == 63 ? 0 : ~uint64_t{0} << (top + 1);
  uint64_t prefix = sh.range[group][0] & mask;
  int need = topk;
  for (int shift = max(top - 7, 0);; shift = max(shift - 8, 0)) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (tid + 128 * j < n && (e[j] & mask) == prefix) atomicAdd(hist + (static_cast<uint32_t>(e[j] >> shift) & 255u), 1);
    }
    group_sync(group);
    if (tid < 32) {  // the bin holding the need-th smallest: lane l scans bins 8l..8l+7
      int h[8], sum = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) sum += (h[b] = hist[8 * tid + b]);
      const int inclusive = warp_inclusive_scan(sum, SumOp{});
      int run = inclusive - sum;
      if (run < need && need <= inclusive) {
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          if (run + h[b] >= need) {
            sh.digit[group][0] = 8 * tid + b;
            sh.digit[group][1] = run;
            sh.digit[group][2] = h[b];
            break;
          }
          run += h[b];
        }
      }
    }
    group_sync(group);
    const int bin = sh.digit[group][0], cnt = sh.digit[group][2];
    need -= sh.digit[group][1];
    prefix |= uint64_t(bin) << shift;
    mask |= uint64_t{255} << shift;
    if (cnt == need || shift == 0) break;  // the whole bin is kept (distinct keys: by the last digit)
    for (int b = tid; b < 256; b += 128) hist[b] = 0;
    group_sync(group);
  }
  largest = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const bool keep = tid + 128 * j < n && (e[j] & mask) <= prefix;
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    int base = 0;
    if (lane == 0 && ballot != 0) base = atomicAdd(&sh.kept[group], __popc(ballot));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (keep) {
      buf[base + __popc(ballot & ((1u << lane) - 1))] = e[j];
      largest = e[j] > largest ? e[j] : largest;
    }
  }
  largest = warp_reduce(largest, MaxOp{});
  if (lane == 0) atomicMax(reinterpret_cast<unsigned long long*>(&sh.kept_max[group]), largest);
  group_sync(group);
  if (tid == 0) {
    *count = topk;
    *threshold = sh.kept_max[group];
    sh.kept[group] = 0;
    sh.kept_max[group] = 0;
    sh.range[group][0] = ~uint64_t{0};
    sh.range[group][1] = 0;
  }
  group_sync(group);
}

// Writes result r of a row: candidate e's key and score, or -1 / -inf where there is none.
__device__ __forceinline__ void store_result(int32_t* indices, float* scores, int r, uint64_t e, bool keep) {
  indices[r] = keep ? static_cast<int32_t>(e & 0xffffffffu) : -1;
  scores[r] = keep ? from_descending_bits(static_cast<uint32_t>(e >> 32)) : -INFINITY;
}

// kChunks: 64-dim halves of the keys (1 for Di <= 64, else 2).
template <typename T, int kChunks>
__global__ void __launch_bounds__(IdxFwd::kThreads, 1)
    indexer_fwd_kernel(const __grid_constant__ IndexerArgs a, const __grid_constant__ CUtensorMap map_k) {
#ifdef KDA_SM90A_ENABLED
  using F = IdxFwd;
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  uint8_t* ktiles = smem;                                                   // [kStages] key tiles
  uint8_t* qtile = ktiles + F::kStages * F::kStageBytes;                    // [group][dim chunk] (128 x 64)
  uint64_t* cand = reinterpret_cast<uint64_t*>(qtile + F::kQBytes);         // [kQueries][cap]
  IdxFwdShared& sh = *reinterpret_cast<IdxFwdShared*>(cand + F::kQueries * a.cap);

  const int64_t t0 = (gridDim.x - 1 - int64_t{blockIdx.x}) * F::kQueries;  // the longest rows first
  if (threadIdx.x < F::kQueries) {
    // Query t's sequence: the last n with cu_q[n] <= t; its keys start at cu_k[n].
    const int64_t t = t0 + threadIdx.x;
    int64_t start = 0, visible = 0;
    if (t < a.T) {
      int lo = 0, hi = a.N;
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (a.cu_q[mid] <= t) lo = mid; else hi = mid;
      }
      const int64_t qs = a.cu_q[lo], Lq = a.cu_q[lo + 1] - qs, Lk = a.cu_k[lo + 1] - a.cu_k[lo];
      start = a.cu_k[lo];
      visible = min(min(t - qs + Lk - Lq + 1, Lk), a.Tk - start);
      if (visible < 0 || start < 0) visible = 0;
    }
    sh.key_start[threadIdx.x] = start;
    sh.visible[threadIdx.x] = visible;
    sh.count[threadIdx.x] = 0;
    sh.threshold[threadIdx.x] = ~uint64_t{0};
  }
  if (threadIdx.x < F::kConsumers) {
    sh.kept[threadIdx.x] = 0;
    sh.kept_max[threadIdx.x] = 0;
    sh.range[threadIdx.x][0] = ~uint64_t{0};
    sh.range[threadIdx.x][1] = 0;
  }
  if (threadIdx.x == 0) sh.ring.init(1, F::kConsumers * 4);  // the TMA bytes; every consumer warp
  // Weights and the query tile (zeros past Hi, Di and T): column n = query x 64 + head of a
  // warpgroup's 128, K-major, 128B-swizzled like the TMA key tiles.
  const T* q = static_cast<const T*>(a.q);
  for (int i = threadIdx.x; i < F::kQueries * kIdxRows; i += blockDim.x) {
    const int64_t t = t0 + i / kIdxRows;
    const int h = i % kIdxRows;
    sh.w[i / kIdxRows][h] = t < a.T && h < a.Hi ? a.w[t * a.Hi + h] : 0.f;
  }
  for (int i = threadIdx.x; i < F::kQueries * kIdxRows * 16; i += blockDim.x) {
    const int row = i / 16, piece = i % 16, h = row % kIdxRows;
    const int64_t t = t0 + row / kIdxRows;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (t < a.T && h < a.Hi && piece * 8 < a.Di) v = *reinterpret_cast<const uint4*>(q + (t * a.Hi + h) * a.Di + piece * 8);
    const int group = row / (F::kQueriesPerGroup * kIdxRows), n = row % (F::kQueriesPerGroup * kIdxRows);
    *reinterpret_cast<uint4*>(qtile + (group * 2 + piece / 8) * F::kQChunkBytes + sw128_offset(n, piece % 8)) = v;
  }
  fence_proxy_async();
  __syncthreads();

  int64_t lo = INT64_MAX, hi = 0;  // the keys any of the block's queries sees
#pragma unroll
  for (int i = 0; i < F::kQueries; ++i) {
    if (sh.visible[i] > 0) {
      lo = min(lo, sh.key_start[i]);
      hi = max(hi, sh.key_start[i] + sh.visible[i]);
    }
  }
  // An even number of tiles (the consumers take them in pairs; keys past hi are masked).
  const int tiles = lo < hi ? static_cast<int>(ceil_div(hi - lo, 2 * kIdxKeys)) * 2 : 0;

  if (F::is_producer()) {
    F::producer_registers();
    if (threadIdx.x == F::kConsumers * 128) {
      tma_prefetch_descriptor(&map_k);
      for (int i = 0; i < tiles; ++i) {
        const int s = F::Ring::stage(i);
        sh.ring.wait_empty(i);
        mbar_arrive_expect_tx(sh.ring.full_bar(i), kChunks * F::kChunkBytes);
        for (int c = 0; c < kChunks; ++c) {
          tma_load_2d(ktiles + s * F::kStageBytes + c * F::kChunkBytes, &map_k, sh.ring.full_bar(i), 64 * c,
                      static_cast<int>(lo + int64_t{i} * kIdxKeys));
        }
      }
    }
    return;
  }

  F::consumer_registers();
  const int group = F::warpgroup(), warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, c = lane % 4;
  // After the sums, lane c holds query 2 group + c / 2 at key row 16 warp + lane / 4 + 8 (c % 2).
  const int my_query = 2 * group + c / 2, my_row = 16 * warp + lane / 4 + 8 * (c % 2);
  const int64_t my_start = sh.key_start[my_query], my_end = my_start + sh.visible[my_query];
  uint64_t* my_buf = cand + my_query * a.cap;
  const uint32_t q_base = smem_addr(qtile + group * 2 * F::kQChunkBytes);

  auto issue = [&](float(&acc)[64], int i) {
    const int s = F::Ring::stage(i);
#pragma unroll
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    sh.ring.wait_full(i);
    const uint32_t k_base = smem_addr(ktiles + s * F::kStageBytes);
    fence_accumulators(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4 * kChunks; ++kk) {
      const uint64_t da = sw128_descriptor(k_base + (kk / 4) * F::kChunkBytes + (kk % 4) * 32, 16);
      const uint64_t db = sw128_descriptor(q_base + (kk / 4) * F::kQChunkBytes + (kk % 4) * 32, 16);
      wgmma_m64n128k16<T, 0, 0>(acc, da, db);
    }
    wgmma_commit();
  };
  // Tile i's scores into the candidate buffers once its wgmmas are done (`pending`: how many of
  // this group's later wgmma batches may still run).
  auto finish = [&](float(&acc)[64], int i, auto pending) {
    wgmma_wait<decltype(pending)::value>();
    fence_accumulators(acc);
    if (lane == 0) sh.ring.release(i);
    float part[2][2] = {};  // [query][row g, g + 8]
#pragma unroll
    for (int qi = 0; qi < 2; ++qi) {
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {  // heads 8 jj + 2c (+1)
        const float* d = acc + 4 * (8 * qi + jj);
        const float2 wv = *reinterpret_cast<const float2*>(&sh.w[2 * group + qi][8 * jj + 2 * c]);
        part[qi][0] += relu(d[0]) * wv.x + relu(d[1]) * wv.y;
        part[qi][1] += relu(d[2]) * wv.x + relu(d[3]) * wv.y;
      }
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      float& v = part[x / 2][x % 2];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
    }
    const float score = c == 0 ? part[0][0] : c == 1 ? part[0][1] : c == 2 ? part[1][0] : part[1][1];
    const int64_t key = lo + int64_t{i} * kIdxKeys + my_row;
    const uint64_t candidate = uint64_t{descending_bits(score)} << 32 | static_cast<uint32_t>(key);
    const bool enter = key >= my_start && key < my_end && isfinite(score) && candidate < sh.threshold[my_query];
    const uint32_t ballot = __ballot_sync(0xffffffffu, enter);
#pragma unroll
    for (int qi = 0; qi < 2; ++qi) {
      const uint32_t m = ballot & (qi == 0 ? 0x33333333u : 0xCCCCCCCCu);  // lanes c = 2 qi, 2 qi + 1
      if (m == 0) continue;
      const int leader = __ffs(m) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(&sh.count[2 * group + qi], __popc(m));
      base = __shfl_sync(0xffffffffu, base, leader);
      if (enter && c / 2 == qi) my_buf[base + __popc(m & ((1u << lane) - 1))] = candidate;
    }
    group_sync(group);
    const int counts[2] = {sh.count[2 * group], sh.count[2 * group + 1]};
    group_sync(group);  // read by all before the next tile's candidates arrive
#pragma unroll 1
    for (int qi = 0; qi < 2; ++qi) {
      const int query = 2 * group + qi;
      if (counts[qi] > a.cap - kIdxKeys) {
        cut_to_topk(cand + query * a.cap, counts[qi], a.topk, sh, group, &sh.count[query], &sh.threshold[query]);
      }
    }
  };

  // Tiles in pairs: tile i + 1's wgmmas run while tile i's scores are reduced. Nothing is left in
  // flight across the loop's back edge: ptxas serialises every wgmma of a loop that does (C7514).
  using One = std::integral_constant<int, 1>;
  using None = std::integral_constant<int, 0>;
  float acc0[64], acc1[64];
  for (int i = 0; i < tiles; i += 2) {
    issue(acc0, i);
    issue(acc1, i + 1);
    finish(acc0, i, One{});
    finish(acc1, i + 1, None{});
  }

#pragma unroll 1
  for (int qi = 0; qi < 2; ++qi) {
    const int query = 2 * group + qi;
    if (sh.count[query] > a.topk) {
      cut_to_topk(cand + query * a.cap, sh.count[query], a.topk, sh, group, &sh.count[query], &sh.threshold[query]);
    }
  }
  // The survivors, unsorted (indexer_sort_kernel orders each row afterwards), then -1 padding.
  for (int qi = 0; qi < 2; ++qi) {
    const int64_t t = t0 + 2 * group + qi;
    if (t >= a.T) continue;
    const int n = sh.count[2 * group + qi];
    const uint64_t* buf = cand + (2 * group + qi) * a.cap;
    for (int r = threadIdx.x % 128; r < a.topk; r += 128) {
      store_result(a.indices + t * a.topk, a.scores + t * a.topk, r, r < n ? buf[r] : 0, r < n);
    }
  }
#endif
}

// Orders each row of the forward's results by score descending, ties to the lower key: a block
// per row sorts its candidates (descending score bits << 32 | key; the -1 padding as the largest
// key) with a bitonic network over 256 kE keys held in registers, kE consecutive ones per thread.
// Partners in the same thread are exchanged in registers, in another lane by shuffles, in
// another warp through shared memory (the 6 of 66 stages at 2048 keys whose distance is 256 kE /
// 8 or more), so that shared memory, which bounds a network run there entirely, carries little;
// there key e sits in slot (e % kE) * 256 + e / kE, so that no stage's accesses meet in a bank.
constexpr int kSortThreads = 256;

// One stage of partner distance J < kE between a thread's keys (key base + r in v[r]), ascending
// where (key & k) == 0.
template <int kE, int J>
__device__ __forceinline__ void sort_stage_in_thread(uint64_t (&v)[kE], int base, int k) {
#pragma unroll
  for (int r = 0; r < kE; ++r) {
    if ((r & J) == 0 && r + J < kE) {
      const uint64_t x = v[r], y = v[r + J];
      const bool swap = (x > y) == (((base + r) & k) == 0);
      v[r] = swap ? y : x;
      v[r + J] = swap ? x : y;
    }
  }
}

// What key e keeps of itself and its partner at distance j: the smaller where e is the lower of
// the pair in an ascending run or the upper in a descending one.
__device__ __forceinline__ uint64_t sort_keep(uint64_t mine, uint64_t partner, int e, int j, int k) {
  const bool smaller = ((e & j) == 0) == ((e & k) == 0);
  return smaller == (mine < partner) ? mine : partner;
}

template <int kE>
__global__ void __launch_bounds__(kSortThreads) indexer_sort_kernel(IndexerArgs a) {
  constexpr int kSize = kSortThreads * kE;
  __shared__ uint64_t keys[kSize];
  int32_t* indices = a.indices + int64_t{blockIdx.x} * a.topk;
  float* scores = a.scores + int64_t{blockIdx.x} * a.topk;
  const int base = threadIdx.x * kE;
  uint64_t v[kE];
#pragma unroll
  for (int r = 0; r < kE; ++r) {
    const int32_t key = base + r < a.topk ? indices[base + r] : -1;
    v[r] = key >= 0 ? uint64_t{descending_bits(scores[base + r])} << 32 | static_cast<uint32_t>(key) : ~uint64_t{0};
  }
  for (int k = 2; k <= kSize; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      if (j >= 32 * kE) {  // partner in another warp
#pragma unroll
        for (int r = 0; r < kE; ++r) keys[r * kSortThreads + threadIdx.x] = v[r];
        __syncthreads();
#pragma unroll
        for (int r = 0; r < kE; ++r) {
          v[r] = sort_keep(v[r], keys[r * kSortThreads + (threadIdx.x ^ (j / kE))], base + r, j, k);
        }
        __syncthreads();
      } else if (j >= kE) {  // partner in lane ^ (j / kE)
#pragma unroll
        for (int r = 0; r < kE; ++r) {
          v[r] = sort_keep(v[r], __shfl_xor_sync(0xffffffffu, v[r], j / kE), base + r, j, k);
        }
      } else if (j == 4) {
        sort_stage_in_thread<kE, 4>(v, base, k);
      } else if (j == 2) {
        sort_stage_in_thread<kE, 2>(v, base, k);
      } else {
        sort_stage_in_thread<kE, 1>(v, base, k);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kE; ++r) {
    if (base + r < a.topk) store_result(indices, scores, base + r, v[r], v[r] != ~uint64_t{0});
  }
}

}  // namespace

void indexer_fwd_cuda(const IndexerProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                      at::Tensor& indices, at::Tensor& scores) {
  if (p.T == 0) return;
  check_sm90(q, "lightning_indexer");
  if (p.Tk == 0) {  // no keys: nothing to select (and no tensor map over an empty k)
    indices.fill_(-1);
    scores.fill_(-INFINITY);
    return;
  }
  const c10::cuda::CUDAGuard guard(q.device());
  using F = IdxFwd;
  const IndexerArgs a{q.data_ptr(), w.data_ptr<float>(), p.cu_q.data_ptr<int32_t>(), p.cu_k.data_ptr<int32_t>(),
                      p.T, p.Tk, static_cast<int>(p.N), static_cast<int>(p.Hi), static_cast<int>(p.Di),
                      static_cast<int>(p.topk), F::capacity(static_cast<int>(p.topk)), indices.data_ptr<int32_t>(),
                      scores.data_ptr<float>()};
  const CUtensorMap map_k = make_tensor_map_sw128<2>(k, {static_cast<uint64_t>(p.Di), static_cast<uint64_t>(p.Tk)},
                                                     {static_cast<uint64_t>(p.Di)}, {64, kIdxKeys}, "k");
  const size_t smem = sm90::kSwizzleAlign + F::kStages * F::kStageBytes + F::kQBytes +
                      size_t{F::kQueries} * a.cap * sizeof(uint64_t) + sizeof(IdxFwdShared);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "lightning_indexer", [&] {
    const auto kernel = p.Di > 64 ? indexer_fwd_kernel<scalar_t, 2> : indexer_fwd_kernel<scalar_t, 1>;
    set_smem(kernel, smem);
    kernel<<<ceil_div(p.T, F::kQueries), F::kThreads, smem, stream>>>(a, map_k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (p.topk > 1) {  // kE keys per thread: 256 kE >= topk (kMaxTopk = 2048)
    static_assert(kMaxTopk <= 8 * kSortThreads);
    const auto sort = p.topk <= 256 ? indexer_sort_kernel<1>
                      : p.topk <= 512 ? indexer_sort_kernel<2>
                      : p.topk <= 1024 ? indexer_sort_kernel<4>
                                       : indexer_sort_kernel<8>;
    launch(sort, dim3(p.T), kSortThreads, 0, a);
  }
}

}  // namespace kda_dsa_ops::dsa
