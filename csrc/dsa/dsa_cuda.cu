// DSA on CUDA, bf16/fp16 operands on the tensor cores with fp32 accumulation.
//   LI forward    (sm_90a: TMA, wgmma) four queries per block scored against the keys they see
//                 in tiles of 64, ReLU and the weighted sum over heads in registers; the scores go
//                 straight into per-query shared-memory candidate buffers (the [T, Tk] matrix
//                 never exists), past a threshold (the k-th best so far); a full buffer is cut
//                 back to top-k by a radix select.
//   LI backward   one block per query over its selected keys: dq and dw in registers, dk added to
//                 an fp32 buffer.
//   SFA forward   one block per (query, kv head, block of up to 64 heads) over the selected keys in
//                 tiles of 64: online softmax, P V, the output gate in the epilogue, lse; with
//                 return_p a second pass sums the final probabilities over the heads.
//   SFA backward  the same blocks: dq in registers, dkv added to an fp32 buffer (atomically, or,
//                 with deterministic, stored per (query, slot) and summed in index order).
// The others run mma.sync m16n8k16; their warps are 16-row groups x 2 halves of the columns (keys
// or values).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "common/hopper.cuh"
#include "common/mma.cuh"
#include "common/tma.h"
#include "dsa/dsa.h"

namespace kda_dsa_ops::dsa {

namespace {

using namespace kda_dsa_ops::mma;

constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + __expf(-x)); }
// max(x, 0) that keeps NaN (fmaxf drops it), as torch's relu: a NaN score is never selected.
__device__ __forceinline__ float relu(float x) { return x < 0.f ? 0.f : x; }
// The running maximum that the softmax subtracts: 0 while it is -inf (no key yet), so that a -inf
// logit gives p = 0 and a NaN one p = NaN (a row of NaN logits is not a row without keys).
__device__ __forceinline__ float finite_or_zero(float m) { return m == -INFINITY ? 0.f : m; }

__device__ __forceinline__ int round16(int x) { return (x + 15) / 16 * 16; }

// s += Q K^T for rows row0.. (16) and keys key0.. (32) of row-major shared tiles (leading
// dimension ld), over the first kd columns (a multiple of 16): four 16 x 8 accumulator tiles.
template <typename T>
__device__ __forceinline__ void warp_qk_16x32(float (&s)[4][4], const T* sQ, const T* sK, int ld, int row0, int key0,
                                              int kd) {
  for (int kk = 0; kk < kd; kk += 16) {
    uint32_t af[4];
    load_a(af, sQ, ld, row0, kk);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t bf[4];
      load_b_nk(bf, sK, ld, key0 + np * 16, kk);
      mma_16816<T>(s[2 * np], af, bf[0], bf[1]);
      mma_16816<T>(s[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

template <typename Kernel, typename Args>
void launch(Kernel kernel, dim3 grid, int threads, size_t smem, const Args& args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  set_smem(kernel, smem);
  kernel<<<grid, threads, smem, c10::cuda::getCurrentCUDAStream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

constexpr size_t kMaxSmem = 227 * 1024;  // dynamic shared memory per block (sm_90)

// Key tiles in shared memory. With kStages = 2 the next tile's rows are in flight (cp.async)
// while the current one is used. Src (per thread): slots(b, k0) fills buffer b's per-slot data
// for the tile of keys k0.. (shared arrays: no sync inside), row(b, r) is the global row of
// slot r (nullptr: zeros).
template <typename T, int kStages, int kKeys, typename Src>
struct KeyTiles {
  T* buf;  // kStages tiles of kKeys x ld
  int ld, width, cols;
  int64_t total;  // keys
  Src src;
  __device__ T* tile(int b) const { return buf + b * kKeys * ld; }
  __device__ void fetch(int b) {
    gather_rows(tile(b), ld, kKeys, width, cols, [&](int r) { return src.row(b, r); });
    cp_async_commit();
  }
  // Before the loop (every thread).
  __device__ void start() {
    if constexpr (kStages == 2) {
      src.slots(0, 0);
      __syncthreads();
      fetch(0);
    }
  }
  // Tile it (keys k0..) in shared memory: returns its buffer. Every thread calls it, and calls
  // __syncthreads() after its last use of the tile, before the next ready().
  __device__ int ready(int it, int64_t k0) {
    if constexpr (kStages == 1) {
      src.slots(0, k0);
      __syncthreads();
      fetch(0);
      cp_async_wait<0>();
      __syncthreads();
      return 0;
    } else {
      const int cur = it & 1;
      const bool more = k0 + kKeys < total;
      if (more) src.slots(cur ^ 1, k0 + kKeys);
      __syncthreads();
      if (more) {
        fetch(cur ^ 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      return cur;
    }
  }
};

// Selected rows kv[sel[slot], kvh] (attention): slot -> key in idx[b][slot], -1 for none or
// out of range.
template <typename T, int kKeys>
struct SelectedRows {
  int* idx;  // [stages][kKeys], shared
  const int32_t* sel;
  int topk;
  int64_t Tk, Hkv;
  int kvh, D;
  const T* kv;
  __device__ void slots(int b, int64_t k0) {
    for (int i = threadIdx.x; i < kKeys; i += blockDim.x) {
      const int64_t j = k0 + i;
      idx[b * kKeys + i] = j < topk && sel[j] < Tk ? sel[j] : -1;
    }
  }
  __device__ const T* row(int b, int r) const {
    const int j = idx[b * kKeys + r];
    return j >= 0 ? kv + (int64_t{j} * Hkv + kvh) * D : nullptr;
  }
};

// ---- lightning indexer ------------------------------------------------------------------

constexpr int kIdxRows = 64;  // indexer heads (Hi <= 64, padded)
constexpr int kIdxKeys = 64;  // keys per tile
constexpr int kIdxDim = 128;  // Di <= 128
constexpr int kIdxLd = kIdxDim + 8;
constexpr int kIdxThreads = 256;  // backward

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
struct IdxFwd {
  static constexpr int kQueries = 4, kConsumers = 2, kQueriesPerGroup = kQueries / kConsumers;
  static constexpr int kThreads = 128 * (kConsumers + 1);  // + the producer warpgroup
  static constexpr int kStages = 3;
  static constexpr int kChunkBytes = kIdxKeys * 128;                         // 64 keys x 64 dims
  static constexpr int kStageBytes = 2 * kChunkBytes;                        // x 128 dims
  static constexpr int kQChunkBytes = kQueriesPerGroup * kIdxRows * 128;     // 128 columns x 64 dims
  static constexpr int kQBytes = kConsumers * 2 * kQChunkBytes;
  static constexpr int kSlack = 1024;                                       // buffer room past topk
  static constexpr int kPerThread = (kMaxTopk + kSlack) / 128;               // of a cut, in registers
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static constexpr int kAlign = 1024;                                       // swizzle atoms
  static int capacity(int topk) { return topk + kSlack; }
};
// setmaxnreg.inc waits for registers the CTA's pool (168 a thread at 384 threads) does not have.
static_assert(IdxFwd::kProducerRegs + IdxFwd::kConsumers * IdxFwd::kConsumerRegs <= 3 * 168);

// A forward block's shared state besides the tiles and the candidate buffers.
struct IdxFwdShared {
  uint64_t full[IdxFwd::kStages], empty[IdxFwd::kStages];
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
  uint8_t* smem = smem_raw + ((F::kAlign - (smem_addr(smem_raw) & (F::kAlign - 1))) & (F::kAlign - 1));
  uint8_t* ktiles = smem;                                                   // [kStages] key tiles
  uint8_t* qtile = ktiles + F::kStages * F::kStageBytes;                    // [group][dim chunk] (128 x 64)
  uint64_t* cand = reinterpret_cast<uint64_t*>(qtile + F::kQBytes);         // [kQueries][cap]
  IdxFwdShared& sh = *reinterpret_cast<IdxFwdShared*>(cand + F::kQueries * a.cap);

  const int64_t t0 = (gridDim.x - 1 - int64_t{blockIdx.x}) * F::kQueries;  // the longest rows first
  const int warpgroup = threadIdx.x / 128;
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
  if (threadIdx.x == 0) {
    for (int s = 0; s < F::kStages; ++s) {
      mbar_init(sh.full + s, 1);
      mbar_init(sh.empty + s, F::kConsumers * 4);  // every consumer warp
    }
    mbar_init_fence();
  }
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

  if (warpgroup == F::kConsumers) {
    warpgroup_reg_dealloc<F::kProducerRegs>();
    if (threadIdx.x == F::kConsumers * 128) {
      tma_prefetch_descriptor(&map_k);
      for (int i = 0; i < tiles; ++i) {
        const int s = i % F::kStages;
        mbar_wait(sh.empty + s, ((i / F::kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(sh.full + s, kChunks * F::kChunkBytes);
        for (int c = 0; c < kChunks; ++c) {
          tma_load_2d(ktiles + s * F::kStageBytes + c * F::kChunkBytes, &map_k, sh.full + s, 64 * c,
                      static_cast<int>(lo + int64_t{i} * kIdxKeys));
        }
      }
    }
    return;
  }

  warpgroup_reg_alloc<F::kConsumerRegs>();
  const int group = warpgroup, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32, c = lane % 4;
  // After the sums, lane c holds query 2 group + c / 2 at key row 16 warp + lane / 4 + 8 (c % 2).
  const int my_query = 2 * group + c / 2, my_row = 16 * warp + lane / 4 + 8 * (c % 2);
  const int64_t my_start = sh.key_start[my_query], my_end = my_start + sh.visible[my_query];
  uint64_t* my_buf = cand + my_query * a.cap;
  const uint32_t q_base = smem_addr(qtile + group * 2 * F::kQChunkBytes);

  auto issue = [&](float(&acc)[64], int i) {
    const int s = i % F::kStages;
#pragma unroll
    for (int x = 0; x < 64; ++x) acc[x] = 0.f;
    mbar_wait(sh.full + s, (i / F::kStages) & 1);
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
    if (lane == 0) mbar_arrive(sh.empty + i % F::kStages);
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

// ---- lightning indexer, backward --------------------------------------------------------

// The indexer's selected keys with their score gradients (0 where no key).
template <typename T>
struct IndexedRows {
  SelectedRows<T, kIdxKeys> keys;
  float* grad;  // [2][kIdxKeys], shared
  const float* g;
  __device__ void slots(int b, int64_t k0) {
    keys.slots(b, k0);
    for (int i = threadIdx.x; i < kIdxKeys; i += blockDim.x) {
      grad[b * kIdxKeys + i] = keys.idx[b * kIdxKeys + i] >= 0 ? g[k0 + i] : 0.f;
    }
  }
  __device__ const T* row(int b, int r) const { return keys.row(b, r); }
};

struct IndexerBwdArgs {
  const void* q;
  const void* k;
  const float* w;
  const int32_t* indices;
  const float* grad;
  int64_t Tk;  // indices outside [0, Tk) count as -1
  int Hi, Di, topk;
  void* dq;
  float* dk;
  float* dw;
};

constexpr int kIdxLdC = kIdxKeys + 8;

template <typename T>
__global__ void __launch_bounds__(kIdxThreads) indexer_bwd_kernel(IndexerBwdArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kIdxRows * kIdxLd;  // 2 key tiles
  T* sC = sK + 2 * kIdxKeys * kIdxLd;
  float* sW = reinterpret_cast<float*>(sC + kIdxRows * kIdxLdC);
  float* sG = sW + kIdxRows;           // [2][kIdxKeys]
  float* dw_part = sG + 2 * kIdxKeys;  // [2][kIdxRows]
  int* sIdx = reinterpret_cast<int*>(dw_part + 2 * kIdxRows);  // [2][kIdxKeys]

  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wr = warp / 2, wc = warp % 2;
  const int kd = round16(a.Di);

  gather_rows(sQ, kIdxLd, kIdxRows, a.Di, kIdxDim,
              [&](int r) { return r < a.Hi ? q + (t * a.Hi + r) * a.Di : static_cast<const T*>(nullptr); });
  for (int r = threadIdx.x; r < kIdxRows; r += blockDim.x) sW[r] = r < a.Hi ? a.w[t * a.Hi + r] : 0.f;

  float dq[8][4] = {};
  float dw[2] = {0.f, 0.f};
  KeyTiles<T, 2, kIdxKeys, IndexedRows<T>> tiles{
      sK, kIdxLd, a.Di, kIdxDim, a.topk,
      IndexedRows<T>{{sIdx, a.indices + t * a.topk, a.topk, a.Tk, 1, 0, a.Di, k}, sG, a.grad + t * a.topk}};
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < a.topk; k0 += kIdxKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    const int* sIdxt = sIdx + b * kIdxKeys;
    const float* sGt = sG + b * kIdxKeys;

    float s[4][4] = {};
    warp_qk_16x32(s, sQ, sKt, kIdxLd, wr * 16, wc * 32, kd);
    // d score / d (q.k) = g w [q.k > 0]; d score / d w = g relu(q.k).
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = wc * 32 + j * 8 + 2 * c;
      float coef[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float gk = sGt[col + (e & 1)], d = s[j][e];
        const bool active = d > 0.f;
        dw[e / 2] += active ? gk * d : 0.f;
        coef[e] = active ? gk * sW[wr * 16 + g + 8 * (e / 2)] : 0.f;
      }
      *reinterpret_cast<uint32_t*>(sC + (wr * 16 + g) * kIdxLdC + col) = pack2<T>(coef[0], coef[1]);
      *reinterpret_cast<uint32_t*>(sC + (wr * 16 + g + 8) * kIdxLdC + col) = pack2<T>(coef[2], coef[3]);
    }
    __syncthreads();
    // dq += C K (rows wr * 16.., cols wc * 64..).
#pragma unroll
    for (int kk = 0; kk < kIdxKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sC, kIdxLdC, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, kIdxLd, wc * 64 + np * 16, kk);
        mma_16816<T>(dq[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(dq[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    // dk[key] += (C^T Q)[key]: keys (warp % 4) * 16.., cols (warp / 4) * 64...
    {
      const int kg = warp % 4, n_base = warp / 4 * 64;
      uint32_t at[4][4];
#pragma unroll
      for (int ks2 = 0; ks2 < 4; ++ks2) load_a_trans(at[ks2], sC, kIdxLdC, kg * 16, ks2 * 16);
      for (int u = 0; u < 4; ++u) {
        const int n0 = n_base + u * 16;
        if (n0 >= kd) break;
        float acc[2][4] = {};
#pragma unroll
        for (int ks2 = 0; ks2 < 4; ++ks2) {
          uint32_t bf[4];
          load_b_kn(bf, sQ, kIdxLd, n0, ks2 * 16);
          mma_16816<T>(acc[0], at[ks2], bf[0], bf[1]);
          mma_16816<T>(acc[1], at[ks2], bf[2], bf[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = sIdxt[kg * 16 + g + 8 * h];
          if (key < 0) continue;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = n0 + j * 8 + 2 * c;
            if (col < a.Di) {
              atomicAdd(reinterpret_cast<float2*>(a.dk + int64_t{key} * a.Di + col),
                        make_float2(acc[j][2 * h], acc[j][2 * h + 1]));
            }
          }
        }
      }
    }
    __syncthreads();
  }
  T* dq_out = static_cast<T*>(a.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = wr * 16 + g + 8 * h;
    if (row >= a.Hi) continue;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      store_pair_within(dq_out + (t * a.Hi + row) * a.Di, wc * 64 + n * 8 + 2 * c, a.Di, dq[n][2 * h], dq[n][2 * h + 1]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dw[h] += __shfl_xor_sync(0xffffffffu, dw[h], 1);
    dw[h] += __shfl_xor_sync(0xffffffffu, dw[h], 2);
    if (c == 0) dw_part[wc * kIdxRows + wr * 16 + g + 8 * h] = dw[h];
  }
  __syncthreads();
  for (int r = threadIdx.x; r < a.Hi; r += blockDim.x) a.dw[t * a.Hi + r] = dw_part[r] + dw_part[kIdxRows + r];
}

// ---- sparse attention ---------------------------------------------------------------------

struct AttnArgs {
  const void* q;
  const void* kv;
  const int32_t* indices;
  const void* gate;  // nullptr: no gate
  int64_t T, H, Hkv, Tk;  // indices outside [0, Tk) count as -1
  int Dqk, dv, topk, G, head_blocks;
  float scale;
  // forward
  void* o;
  float* lse;
  float* probs;  // nullptr: not asked for
  // backward
  const void* grad_o;
  const void* o_in;
  const float* lse_in;
  void* dq;
  float* dkv;      // atomics into [Tk, Hkv, Dqk]; nullptr: contributions into contrib
  float* contrib;  // [(t - t0), Hkv, head_blocks, topk, Dqk]
  void* dgate;
  int64_t t0;
};

// One block's share of the attention: query t, kv head kvh, query heads head0.. (rows of them
// valid), the selected keys sel of (t, kvh); the thread's place: warp, lane, accumulator row g
// and column pair c of its fragments, row group wr, column half wc, rows r0 and r0 + 8; kd the
// head dim rounded up to 16, sl2 the scale in log2 units.
struct AttnBlock {
  int64_t t;
  int kvh, head0, rows, warp, lane, g, c, wr, wc, r0, kd;
  float sl2;
  const int32_t* sel;
};

// The block's place, and its query rows sent to shared memory (cp.async, committed with the first
// key tile).
template <typename T, int kRows, int kCols>
__device__ AttnBlock attn_block(const AttnArgs& a, T* sQ, int ld) {
  AttnBlock b;
  b.t = a.t0 + blockIdx.x;
  b.kvh = blockIdx.y;
  b.head0 = b.kvh * a.G + blockIdx.z * kRows;
  b.rows = min(kRows, a.G - static_cast<int>(blockIdx.z) * kRows);
  b.warp = threadIdx.x / 32;
  b.lane = threadIdx.x % 32;
  b.g = b.lane / 4;
  b.c = b.lane % 4;
  b.wr = b.warp / 2;
  b.wc = b.warp % 2;
  b.r0 = b.wr * 16 + b.g;
  b.kd = round16(a.Dqk);
  b.sl2 = a.scale * kLog2e;
  b.sel = a.indices + (b.t * a.Hkv + b.kvh) * a.topk;
  const T* q = static_cast<const T*>(a.q);
  gather_rows(sQ, ld, kRows, a.Dqk, kCols, [&](int r) {
    return r < b.rows ? q + (b.t * a.H + b.head0 + r) * a.Dqk : static_cast<const T*>(nullptr);
  });
  return b;
}

// What the forward and backward blocks share: kRows query heads in 16-row groups x 2 column
// halves of warps, key tiles of kKeys, shared rows padded by 8 (ldmatrix without bank
// conflicts). Two key tiles are in flight when the shared memory holds them beside `extra`
// bytes of the kernel's other arrays.
template <int kDqk, int kRows, int kKeys_>
struct AttnShape {
  static constexpr int kKeys = kKeys_;
  static constexpr int kWarps = kRows / 16 * 2;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLd = kDqk + 8;
  static constexpr int kLdP = kKeys + 8;
  // Q, the key tiles and their slots (16-bit operands).
  static constexpr size_t tile_bytes(int stages) {
    return (kRows + stages * kKeys) * kLd * 2 + stages * kKeys * sizeof(int);
  }
  static constexpr int stages_for(size_t extra) { return tile_bytes(2) + extra <= kMaxSmem ? 2 : 1; }
};

template <int kDqk, int kDv, int kRows>
struct FwdShape : AttnShape<kDqk, kRows, 64> {
  using Base = AttnShape<kDqk, kRows, 64>;
  static constexpr int kVTiles = kDv / 2 / 8;  // value tiles per warp
  // P, the softmax reductions and the probability column sums.
  static constexpr size_t kExtra =
      kRows * Base::kLdP * 2 + (4 * kRows + kRows / 16 * Base::kKeys) * sizeof(float);
  static constexpr int kStages = Base::stages_for(kExtra);  // key tiles in flight
  static constexpr size_t kSmem = Base::tile_bytes(kStages) + kExtra;
};

template <typename T, int kDqk, int kDv, int kRows>
__global__ void __launch_bounds__(FwdShape<kDqk, kDv, kRows>::kThreads) attn_fwd_kernel(AttnArgs a) {
  using S = FwdShape<kDqk, kDv, kRows>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kRows * S::kLd;  // kStages key tiles
  T* sP = sK + S::kStages * S::kKeys * S::kLd;
  float* red_max = reinterpret_cast<float*>(sP + kRows * S::kLdP);  // [2][kRows]
  float* red_sum = red_max + 2 * kRows;                             // [2][kRows]
  float* colsum = red_sum + 2 * kRows;                              // [kRows / 16][kKeys]
  int* sIdx = reinterpret_cast<int*>(colsum + kRows / 16 * S::kKeys);  // [kStages][kKeys]

  const T* kv = static_cast<const T*>(a.kv);
  const auto [t, kvh, head0, rows, warp, lane, g, c, wr, wc, r0, kd, sl2, idx] =
      attn_block<T, kRows, kDqk>(a, sQ, S::kLd);
  using Tiles = KeyTiles<T, S::kStages, S::kKeys, SelectedRows<T, S::kKeys>>;
  const Tiles tiles0{sK, S::kLd, a.Dqk, kDqk, a.topk,
                     SelectedRows<T, S::kKeys>{sIdx, idx, a.topk, a.Tk, a.Hkv, kvh, a.Dqk, kv}};
  // Logits in log2 units for rows r0, r0 + 8 and keys wc * 32.. of tile buffer b (masked keys -inf).
  const auto logits = [&](float (&s)[4][4], const Tiles& tiles, int b) {
    for (int j = 0; j < 4; ++j) {
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
    }
    warp_qk_16x32(s, sQ, tiles.tile(b), S::kLd, wr * 16, wc * 32, kd);
    const int* slot = sIdx + b * S::kKeys;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = slot[wc * 32 + j * 8 + 2 * c + (e & 1)] >= 0 ? s[j][e] * sl2 : -INFINITY;
    }
  };

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float o_acc[S::kVTiles][4] = {};
  Tiles tiles = tiles0;
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < a.topk; k0 += S::kKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    float s[4][4];
    logits(s, tiles, b);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (c == 0) red_max[wc * kRows + r0 + 8 * h] = mx[h];
    }
    __syncthreads();
    float m_new[2], alpha[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = r0 + 8 * h;
      m_new[h] = fmaxf(m_run[h], fmaxf(red_max[rr], red_max[kRows + rr]));
      alpha[h] = m_new[h] == -INFINITY ? 1.f : exp2f(m_run[h] - m_new[h]);
    }
    const float m_sub[2] = {finite_or_zero(m_new[0]), finite_or_zero(m_new[1])};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[j][e] - m_sub[e / 2]);
        s[j][e] = p;
        sum[e / 2] += p;
      }
      const int col = wc * 32 + j * 8 + 2 * c;
      *reinterpret_cast<uint32_t*>(sP + r0 * S::kLdP + col) = pack2<T>(s[j][0], s[j][1]);
      *reinterpret_cast<uint32_t*>(sP + (r0 + 8) * S::kLdP + col) = pack2<T>(s[j][2], s[j][3]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
      if (c == 0) red_sum[wc * kRows + r0 + 8 * h] = sum[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = r0 + 8 * h;
      l_run[h] = l_run[h] * alpha[h] + (red_sum[rr] + red_sum[kRows + rr]);
      m_run[h] = m_new[h];
    }
#pragma unroll
    for (int n = 0; n < S::kVTiles; ++n) {
      o_acc[n][0] *= alpha[0];
      o_acc[n][1] *= alpha[0];
      o_acc[n][2] *= alpha[1];
      o_acc[n][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < S::kKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sP, S::kLdP, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < S::kVTiles / 2; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, S::kLd, wc * (kDv / 2) + np * 16, kk);
        mma_16816<T>(o_acc[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(o_acc[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    __syncthreads();
  }

  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
  float lse2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + 8 * h;
    lse2[h] = l_run[h] != 0.f ? m_run[h] + log2f(l_run[h]) : INFINITY;
    if (rr >= rows) continue;
    const int64_t row = t * a.H + head0 + rr;
    const float inv = l_run[h] != 0.f ? 1.f / l_run[h] : 0.f;
    // The gate eight value tiles at a time, loaded before their stores (which could alias it, as
    // far as the compiler knows; sigmoid(inf) = 1 where there is no gate).
    constexpr int kBatch = S::kVTiles < 8 ? S::kVTiles : 8;
#pragma unroll
    for (int n0 = 0; n0 < S::kVTiles; n0 += kBatch) {
      float gv[kBatch][2];
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int col = wc * (kDv / 2) + (n0 + n) * 8 + 2 * c;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          gv[n][e] = gate != nullptr && col + e < a.dv ? to_float(gate[row * a.dv + col + e]) : INFINITY;
        }
      }
#pragma unroll
      for (int n = 0; n < kBatch; ++n) {
        const int col = wc * (kDv / 2) + (n0 + n) * 8 + 2 * c;
        store_pair_within(out + row * a.dv, col, a.dv, o_acc[n0 + n][2 * h] * inv * sigmoidf(gv[n][0]),
                   o_acc[n0 + n][2 * h + 1] * inv * sigmoidf(gv[n][1]));
      }
    }
    if (wc == 0 && c == 0) a.lse[row] = l_run[h] != 0.f ? lse2[h] * kLn2 : -INFINITY;
  }
  if (a.probs == nullptr) return;

  // Second pass: the final probabilities summed over the block's heads.
  Tiles again = tiles0;
  again.start();
  it = 0;
  for (int k0 = 0; k0 < a.topk; k0 += S::kKeys, ++it) {
    const int b = again.ready(it, k0);
    float s[4][4];
    logits(s, again, b);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = (r0 < rows ? exp2f(s[j][e] - lse2[0]) : 0.f) + (r0 + 8 < rows ? exp2f(s[j][2 + e] - lse2[1]) : 0.f);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) colsum[wr * S::kKeys + wc * 32 + j * 8 + 2 * c + e] = v;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < S::kKeys && k0 + i < a.topk; i += blockDim.x) {
      float v = 0.f;
      for (int r = 0; r < kRows / 16; ++r) v += colsum[r * S::kKeys + i];
      float* dst = a.probs + (t * a.Hkv + kvh) * a.topk + k0 + i;
      if (a.head_blocks == 1) {
        *dst = v;
      } else {
        atomicAdd(dst, v);
      }
    }
  }
}

// ---- sparse attention forward, MLA layout on Hopper -----------------------------------------

// One block per (query, block of up to 64 heads) of the MLA layout (Hkv 1, Dqk 576, dv 512). A
// producer warpgroup gathers the selected rows, 64 keys a tile, into a 2-stage ring of
// 128B-swizzled tiles (cp.async, zeros for slots without a key). Two consumer warpgroups each take
// 32 of a tile's keys for S = Q K^T (wgmma m64n32k16 over the 576 columns) and half of the value
// columns for O += P V (wgmma m64n256k16: P from shared memory, V the tile's first 512 columns read
// N-major). The row maxima cross between the groups every tile; each group keeps its own row sums,
// added at the end. Where probabilities are asked for, a second pass over the tiles recomputes S
// and sums the final probabilities over the heads.
struct MlaFwd {
  static constexpr int kDqk = 576, kDv = 512, kRows = 64, kKeys = 64;
  static constexpr int kChunks = kDqk / 64;                 // 64-column swizzled chunks of a row
  static constexpr int kChunkBytes = 64 * 128;              // 64 rows x 64 columns
  static constexpr int kTileBytes = kChunks * kChunkBytes;  // Q, or a key tile: 72 KB
  static constexpr int kStages = 2;
  static constexpr int kSplit = 5;  // S starts on a tile's first chunks while the rest arrive
  static constexpr int kPBytes = kRows * kKeys * 2;
  // Two consumer warpgroups and the producer one. Registers go by warpgroups, so a producer warp
  // alone would cost as much; setmaxnreg moves the producer's to the consumers.
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static constexpr int kAlign = 1024;
};
// The same register pool bound as for IdxFwd.
static_assert(MlaFwd::kProducerRegs + 2 * MlaFwd::kConsumerRegs <= 3 * 168);

struct MlaFwdShared {
  uint64_t full[MlaFwd::kStages][2], empty[MlaFwd::kStages];  // full: a tile's first kSplit chunks, the rest
  // Bit k of word w: slot 32 w + k of the selection has a key. Written once, in the first pass,
  // before the tile's first barrier arrival: the second pass reads it again, nothing rewrites it.
  uint32_t valid[kMaxTopk / 32];
  float row_max[2][MlaFwd::kRows];            // per consumer group, this tile
  float row_sum[2][MlaFwd::kRows];            // per consumer group, at the end
};

constexpr size_t kMlaFwdSmem = MlaFwd::kAlign + (1 + MlaFwd::kStages) * MlaFwd::kTileBytes + MlaFwd::kPBytes +
                               sizeof(MlaFwdShared);
static_assert(kMlaFwdSmem <= kMaxSmem);

template <typename T>
__global__ void __launch_bounds__(MlaFwd::kThreads, 1) mla_fwd_kernel(const __grid_constant__ AttnArgs a) {
#ifdef KDA_SM90A_ENABLED
  using M = MlaFwd;
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((M::kAlign - (smem_addr(smem_raw) & (M::kAlign - 1))) & (M::kAlign - 1));
  uint8_t* sQ = smem;
  uint8_t* sK = sQ + M::kTileBytes;  // kStages key tiles
  uint8_t* sP = sK + M::kStages * M::kTileBytes;
  MlaFwdShared& sh = *reinterpret_cast<MlaFwdShared*>(sP + M::kPBytes);

  const int64_t t = blockIdx.x;
  const int head0 = blockIdx.z * M::kRows, rows = min(M::kRows, a.G - head0);
  const int32_t* sel = a.indices + t * a.topk;
  const T* q = static_cast<const T*>(a.q);
  const T* kv = static_cast<const T*>(a.kv);
  if (threadIdx.x < 256) {  // the consumers bring Q (cp.async, all in flight at once) while the producer starts
    constexpr int kPieces = M::kDqk / 8;  // 16-byte pieces per row
    for (int i = threadIdx.x; i < M::kRows * kPieces; i += 256) {
      const int r = i / kPieces, p = i % kPieces;
      cp_async_16_or_zero(sQ + (p / 8) * M::kChunkBytes + sw128_offset(r, p % 8),
                          r < rows ? q + (t * a.H + head0 + r) * M::kDqk + p * 8 : nullptr);
    }
    cp_async_commit();
  }
  for (int w = threadIdx.x; w < kMaxTopk / 32; w += blockDim.x) sh.valid[w] = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < M::kStages; ++s) {
      mbar_init(&sh.full[s][0], 128);  // every producer thread
      mbar_init(&sh.full[s][1], 128);
      mbar_init(sh.empty + s, 8);  // every consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int tiles = static_cast<int>(ceil_div(a.topk, M::kKeys));

  if (threadIdx.x >= 256) {
    // Producer warpgroup: eight threads copy a row's 128-byte chunks (rows g, g + 16, .. of a tile
    // for the threads 8g .. 8g + 7), so that each request covers whole cache lines.
    warpgroup_reg_dealloc<M::kProducerRegs>();
    const int piece = threadIdx.x % 8, g = (threadIdx.x - 256) / 8;
    const int loads = a.probs != nullptr ? 2 * tiles : tiles;  // the second pass reads the tiles again
    for (int i = 0; i < loads; ++i) {
      const int s = i % M::kStages;
      mbar_wait(sh.empty + s, ((i / M::kStages) & 1) ^ 1);
      int keys[M::kKeys / 16];
#pragma unroll
      for (int m = 0; m < M::kKeys / 16; ++m) {
        const int64_t j = int64_t{i % tiles} * M::kKeys + g + 16 * m;
        keys[m] = j < a.topk ? sel[j] : -1;
        if (keys[m] >= a.Tk) keys[m] = -1;
        if (piece == 0 && i < tiles && keys[m] >= 0) atomicOr(sh.valid + j / 32, 1u << (j % 32));
      }
      uint8_t* tile = sK + s * M::kTileBytes;
      auto copy = [&](int from, int to) {  // chunks [from, to)
        for (int ch = from; ch < to; ++ch) {
#pragma unroll
          for (int m = 0; m < M::kKeys / 16; ++m) {
            cp_async_16_or_zero(tile + ch * M::kChunkBytes + sw128_offset(g + 16 * m, piece),
                                keys[m] >= 0 ? kv + int64_t{keys[m]} * M::kDqk + ch * 64 + piece * 8 : nullptr);
          }
        }
        cp_async_commit();
      };
      copy(0, M::kSplit);
      copy(M::kSplit, M::kChunks);
      cp_async_wait<1>();
      fence_proxy_async();  // the rows (and zeros) are read by wgmma
      mbar_arrive(&sh.full[s][0]);
      cp_async_wait<0>();
      fence_proxy_async();
      mbar_arrive(&sh.full[s][1]);
      if (i == tiles - 1 && a.gate != nullptr && threadIdx.x == 256) {  // the epilogue reads the gate from L2
        bulk_prefetch_l2(static_cast<const T*>(a.gate) + (t * a.H + head0) * M::kDv, rows * M::kDv * sizeof(T));
      }
    }
    return;
  }
  warpgroup_reg_alloc<M::kConsumerRegs>();
  const int group = threadIdx.x / 128, warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4, r0 = 16 * warp + g;
  const float sl2 = a.scale * kLog2e;
  const uint32_t q_base = smem_addr(sQ), p_base = smem_addr(sP);
  float o[128];
#pragma unroll
  for (int x = 0; x < 128; ++x) o[x] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l_run: this thread's columns
  float sc[16];
  cp_async_wait<0>();
  fence_proxy_async();  // Q is read by wgmma
  named_barrier_sync(1, 256);
  // S = Q K^T over this group's 32 keys of the tile loaded i-th, once its chunks arrive.
  auto logits = [&](int i) {
    const int s = i % M::kStages;
    const uint32_t k_base = smem_addr(sK + s * M::kTileBytes);
#pragma unroll
    for (int x = 0; x < 16; ++x) sc[x] = 0.f;
    fence_accumulators(sc);
    mbar_wait(&sh.full[s][0], (i / M::kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < M::kDqk / 16; ++kk) {
      if (kk == 4 * M::kSplit) mbar_wait(&sh.full[s][1], (i / M::kStages) & 1);
      const uint32_t off = (kk / 4) * M::kChunkBytes + (kk % 4) * 32;
      wgmma_m64n32k16<T, 0, 0>(sc, sw128_descriptor(q_base + off, 16),
                               sw128_descriptor(k_base + off + group * 32 * 128, 16));
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulators(sc);
  };
  for (int i = 0; i < tiles; ++i) {
    const int s = i % M::kStages;
    const uint32_t k_base = smem_addr(sK + s * M::kTileBytes);
    if (i > 0) {  // the previous P V is done: its tile can be refilled while S runs
      wgmma_wait<0>();
      fence_accumulators(o);
      if (lane == 0) mbar_arrive(sh.empty + (i - 1) % M::kStages);
    }
    logits(i);
    const uint32_t valid_bits = sh.valid[i % tiles * 2 + group];  // this group's 32 slots

    // Logits in log2 units (no key: -inf); thread columns 32 group + 8 j + 2c (+1), rows r0, r0 + 8.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool valid = (valid_bits >> (8 * j + 2 * c + (e & 1))) & 1;
        sc[4 * j + e] = valid ? sc[4 * j + e] * sl2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], sc[4 * j + e]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (c == 0) sh.row_max[group][r0 + 8 * h] = mx[h];
    }
    named_barrier_sync(1, 256);  // both groups' maxima; both groups' previous P V are done
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const float m_new = fmaxf(m_run[h], fmaxf(sh.row_max[0][r], sh.row_max[1][r]));
      alpha[h] = m_new == -INFINITY ? 1.f : exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = exp2f(sc[4 * j + e] - finite_or_zero(m_run[e / 2]));
        l_run[e / 2] += pr[e];
      }
      const int col = 32 * group + 8 * j + 2 * c;
      *reinterpret_cast<uint32_t*>(sP + sw128_offset(r0, col / 8) + (col % 8) * 2) = pack2<T>(pr[0], pr[1]);
      *reinterpret_cast<uint32_t*>(sP + sw128_offset(r0 + 8, col / 8) + (col % 8) * 2) = pack2<T>(pr[2], pr[3]);
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the maxima rose (rarer by the tile)
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        o[4 * n] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }
    fence_proxy_async();
    named_barrier_sync(1, 256);  // P complete
    fence_accumulators(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < M::kKeys / 16; ++kk) {  // O += P V over this group's 256 value columns
      wgmma_m64n256k16<T, 0, 1>(o, sw128_descriptor(p_base + kk * 32, 16),
                                sw128_descriptor(k_base + 4 * group * M::kChunkBytes + kk * 2048, M::kChunkBytes));
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_accumulators(o);
  if (a.probs != nullptr && tiles > 0 && lane == 0) mbar_arrive(sh.empty + (tiles - 1) % M::kStages);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
    if (c == 0) sh.row_sum[group][r0 + 8 * h] = l_run[h];
  }
  named_barrier_sync(1, 256);
  T* out = static_cast<T*>(a.o);
  const T* gate = static_cast<const T*>(a.gate);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= rows) continue;
    const float l = sh.row_sum[0][r] + sh.row_sum[1][r];
    const float inv = l != 0.f ? 1.f / l : 0.f;
    const int64_t row = t * a.H + head0 + r;
    uint32_t gv[32];  // the row's gate pairs, all loads issued before the first store
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      gv[n] = gate != nullptr ? __ldg(reinterpret_cast<const unsigned int*>(gate + row * M::kDv + 256 * group + 8 * n + 2 * c))
                              : 0u;
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int col = 256 * group + 8 * n + 2 * c;
      float v0 = o[4 * n + 2 * h] * inv, v1 = o[4 * n + 2 * h + 1] * inv;
      if (gate != nullptr) {
        const float2 gf = unpack2<T>(gv[n]);
        v0 *= sigmoidf(gf.x);
        v1 *= sigmoidf(gf.y);
      }
      *reinterpret_cast<uint32_t*>(out + row * M::kDv + col) = pack2<T>(v0, v1);
    }
    if (group == 0 && c == 0) a.lse[row] = l != 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
  }
  if (a.probs == nullptr) return;

  // Second pass: exp(S - lse) summed over the block's heads, per key (rows without a key, and the
  // padding rows past `rows`, add nothing).
  float lse2[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const float l = sh.row_sum[0][r] + sh.row_sum[1][r];
    lse2[h] = r < rows && l != 0.f ? m_run[h] + log2f(l) : INFINITY;
  }
  float* colsum = reinterpret_cast<float*>(sP);  // [group][warp][32 keys]; P is done with
  for (int i = tiles; i < 2 * tiles; ++i) {
    const int s = i % M::kStages;
    logits(i);
    const uint32_t valid_bits = sh.valid[i % tiles * 2 + group];  // this group's 32 slots
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * c + e;
        float v = (valid_bits >> col) & 1
                      ? exp2f(sc[4 * j + e] * sl2 - lse2[0]) + exp2f(sc[4 * j + 2 + e] * sl2 - lse2[1])
                      : 0.f;
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) colsum[(4 * group + warp) * 32 + col] = v;
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(sh.empty + s);
    named_barrier_sync(2 + group, 128);
    if (warp == 0) {
      const int64_t k = int64_t{i - tiles} * M::kKeys + 32 * group + lane;
      const float* cs = colsum + 4 * group * 32 + lane;
      const float v = cs[0] + cs[32] + cs[64] + cs[96];
      if (k < a.topk) {
        if (a.head_blocks == 1) {
          a.probs[t * a.topk + k] = v;
        } else {
          atomicAdd(a.probs + t * a.topk + k, v);
        }
      }
    }
    named_barrier_sync(2 + group, 128);  // the sums are read before the next tile's
  }
#endif
}

template <int kDqk, int kDv, int kRows>
struct BwdShape : AttnShape<kDqk, kRows, 32> {
  using Base = AttnShape<kDqk, kRows, 32>;
  static constexpr int kLdO = kDv + 8;
  static constexpr int kQTiles = kDqk / 2 / 8;                         // dq tiles per warp
  static constexpr int kUnitsPerWarp = kDqk / 16 / (Base::kWarps / 2);  // 16-column dkv units per warp
  static_assert(kDqk / 16 % (Base::kWarps / 2) == 0, "dkv columns must split evenly over the warps");
  // d(attention output), P, dS, delta and lse.
  static constexpr size_t kExtra = (kRows * kLdO + 2 * kRows * Base::kLdP) * 2 + 2 * kRows * sizeof(float);
  static constexpr int kStages = Base::stages_for(kExtra);  // key tiles in flight
  static constexpr size_t kSmem = Base::tile_bytes(kStages) + kExtra;
};

template <typename T, int kDqk, int kDv, int kRows>
__global__ void __launch_bounds__(BwdShape<kDqk, kDv, kRows>::kThreads) attn_bwd_kernel(AttnArgs a) {
  using S = BwdShape<kDqk, kDv, kRows>;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kRows * S::kLd;                // kStages key tiles
  T* sO = sK + S::kStages * S::kKeys * S::kLd;  // d(attention output) = grad_o * sigmoid(gate)
  T* sP = sO + kRows * S::kLdO;
  T* sDS = sP + kRows * S::kLdP;
  float* delta = reinterpret_cast<float*>(sDS + kRows * S::kLdP);
  float* lse2 = delta + kRows;
  int* sIdx = reinterpret_cast<int*>(lse2 + kRows);  // [kStages][kKeys]

  const T* kv = static_cast<const T*>(a.kv);
  const T* gate = static_cast<const T*>(a.gate);
  const T* grad_o = static_cast<const T*>(a.grad_o);
  const T* o = static_cast<const T*>(a.o_in);
  const auto [t, kvh, head0, rows, warp, lane, g, c, wr, wc, r0, kd, sl2, idx] =
      attn_block<T, kRows, kDqk>(a, sQ, S::kLd);
  const int kdv = round16(a.dv);
  // delta = sum(grad_o * o) (o gated), dgate = grad_o * o * (1 - sigmoid(gate)).
  for (int r = warp; r < kRows; r += S::kWarps) {
    const bool valid = r < rows;
    const int64_t row = t * a.H + head0 + r;
    float dsum = 0.f;
    // Every load of the row before the first store (dgate could alias them as far as the compiler
    // knows: loads after a store would each wait for the previous round trip).
    constexpr int kPer = kDv / 32;
    float dd[kPer], od[kPer], sg[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int d = lane + 32 * k;
      const bool in = valid && d < a.dv;
      dd[k] = in ? to_float(grad_o[row * a.dv + d]) : 0.f;
      od[k] = in ? to_float(o[row * a.dv + d]) : 0.f;
      sg[k] = in && gate != nullptr ? to_float(gate[row * a.dv + d]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int d = lane + 32 * k;
      float s = 1.f;
      if (gate != nullptr) {
        s = sigmoidf(sg[k]);
        if (valid && d < a.dv) static_cast<T*>(a.dgate)[row * a.dv + d] = from_float<T>(dd[k] * od[k] * (1.f - s));
      }
      dsum += dd[k] * od[k];
      sO[r * S::kLdO + d] = from_float<T>(dd[k] * s);
    }
    dsum = warp_reduce(dsum, SumOp{});
    if (lane == 0) {
      delta[r] = dsum;
      const float l = valid ? a.lse_in[row] : -INFINITY;
      lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // no key: every p = 0; NaN stays NaN
    }
  }

  float dq[S::kQTiles][4] = {};
  KeyTiles<T, S::kStages, S::kKeys, SelectedRows<T, S::kKeys>> tiles{
      sK, S::kLd, a.Dqk, kDqk, a.topk, SelectedRows<T, S::kKeys>{sIdx, idx, a.topk, a.Tk, a.Hkv, kvh, a.Dqk, kv}};
  tiles.start();
  int it = 0;
  for (int k0 = 0; k0 < a.topk; k0 += S::kKeys, ++it) {
    const int b = tiles.ready(it, k0);
    const T* sKt = tiles.tile(b);
    const int* sIdxt = sIdx + b * S::kKeys;

    // Logits and dP = dO V^T for rows wr * 16.., keys wc * 16...
    float s[2][4] = {}, dp[2][4] = {};
    for (int kk = 0; kk < kd; kk += 16) {
      uint32_t af[4], bf[4];
      load_a(af, sQ, S::kLd, wr * 16, kk);
      load_b_nk(bf, sKt, S::kLd, wc * 16, kk);
      mma_16816<T>(s[0], af, bf[0], bf[1]);
      mma_16816<T>(s[1], af, bf[2], bf[3]);
    }
    for (int kk = 0; kk < kdv; kk += 16) {
      uint32_t af[4], bf[4];
      load_a(af, sO, S::kLdO, wr * 16, kk);
      load_b_nk(bf, sKt, S::kLd, wc * 16, kk);
      mma_16816<T>(dp[0], af, bf[0], bf[1]);
      mma_16816<T>(dp[1], af, bf[2], bf[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = wc * 16 + j * 8 + 2 * c;
      float p[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = r0 + 8 * (e / 2);
        p[e] = sIdxt[col + (e & 1)] >= 0 ? exp2f(s[j][e] * sl2 - lse2[rr]) : 0.f;
        ds[e] = p[e] * (dp[j][e] - delta[rr]) * a.scale;
      }
      *reinterpret_cast<uint32_t*>(sP + r0 * S::kLdP + col) = pack2<T>(p[0], p[1]);
      *reinterpret_cast<uint32_t*>(sP + (r0 + 8) * S::kLdP + col) = pack2<T>(p[2], p[3]);
      *reinterpret_cast<uint32_t*>(sDS + r0 * S::kLdP + col) = pack2<T>(ds[0], ds[1]);
      *reinterpret_cast<uint32_t*>(sDS + (r0 + 8) * S::kLdP + col) = pack2<T>(ds[2], ds[3]);
    }
    __syncthreads();
    // dq += dS K (rows wr * 16.., cols wc * kDqk / 2..).
#pragma unroll
    for (int kk = 0; kk < S::kKeys; kk += 16) {
      uint32_t af[4];
      load_a(af, sDS, S::kLdP, wr * 16, kk);
#pragma unroll
      for (int np = 0; np < S::kQTiles / 2; ++np) {
        uint32_t bf[4];
        load_b_kn(bf, sKt, S::kLd, wc * (kDqk / 2) + np * 16, kk);
        mma_16816<T>(dq[2 * np], af, bf[0], bf[1]);
        mma_16816<T>(dq[2 * np + 1], af, bf[2], bf[3]);
      }
    }
    // dkv[key] += dS^T Q + P^T dO (value columns): keys (warp % 2) * 16.., column units of the warp.
    {
      const int kg = warp % 2, u0 = warp / 2 * S::kUnitsPerWarp;
      uint32_t a_ds[kRows / 16][4], a_p[kRows / 16][4];
#pragma unroll
      for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
        load_a_trans(a_ds[ks2], sDS, S::kLdP, kg * 16, ks2 * 16);
        load_a_trans(a_p[ks2], sP, S::kLdP, kg * 16, ks2 * 16);
      }
      for (int u = u0; u < u0 + S::kUnitsPerWarp; ++u) {
        const int n0 = u * 16;
        if (n0 >= kd) break;
        float acc[2][4] = {};
#pragma unroll
        for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
          uint32_t bf[4];
          load_b_kn(bf, sQ, S::kLd, n0, ks2 * 16);
          mma_16816<T>(acc[0], a_ds[ks2], bf[0], bf[1]);
          mma_16816<T>(acc[1], a_ds[ks2], bf[2], bf[3]);
        }
        if (n0 < kdv) {
#pragma unroll
          for (int ks2 = 0; ks2 < kRows / 16; ++ks2) {
            uint32_t bf[4];
            load_b_kn(bf, sO, S::kLdO, n0, ks2 * 16);
            mma_16816<T>(acc[0], a_p[ks2], bf[0], bf[1]);
            mma_16816<T>(acc[1], a_p[ks2], bf[2], bf[3]);
          }
        }
        // Lanes c and c ^ 1 swap halves so that each holds four consecutive columns of one row
        // (even c: row g, odd c: row g + 8): one 16-byte atomic (or store) instead of two 8-byte.
        const int h = c % 2, slot = kg * 16 + g + 8 * h, key = sIdxt[slot];
        float4 v[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float send0 = h == 0 ? acc[j][2] : acc[j][0], send1 = h == 0 ? acc[j][3] : acc[j][1];
          const float got0 = __shfl_xor_sync(0xffffffffu, send0, 1), got1 = __shfl_xor_sync(0xffffffffu, send1, 1);
          v[j] = h == 0 ? make_float4(acc[j][0], acc[j][1], got0, got1) : make_float4(got0, got1, acc[j][2], acc[j][3]);
        }
        if (key >= 0) {
          float* dst = a.dkv != nullptr
                           ? a.dkv + (int64_t{key} * a.Hkv + kvh) * a.Dqk
                           : a.contrib + ((((t - a.t0) * a.Hkv + kvh) * a.head_blocks + blockIdx.z) * a.topk + k0 + slot) *
                                             int64_t{a.Dqk};
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int col = n0 + j * 8 + 4 * (c / 2);
            if (col >= a.Dqk) continue;
            if (a.dkv != nullptr) {
              atomicAdd(reinterpret_cast<float4*>(dst + col), v[j]);
            } else {
              *reinterpret_cast<float4*>(dst + col) = v[j];
            }
          }
        }
      }
    }
    __syncthreads();
  }
  T* dq_out = static_cast<T*>(a.dq);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + 8 * h;
    if (rr >= rows) continue;
    T* dst = dq_out + (t * a.H + head0 + rr) * a.Dqk;
#pragma unroll
    for (int n = 0; n < S::kQTiles; ++n) {
      store_pair_within(dst, wc * (kDqk / 2) + n * 8 + 2 * c, a.Dqk, dq[n][2 * h], dq[n][2 * h + 1]);
    }
  }
}

// The kernel instance for the problem: head dims padded to 128 or to 576 / 512 (MLA), 16 or 64
// heads per block. f(kernel, heads per block, threads, shared bytes) is called with the chosen
// instance.
template <typename T, bool kForward, typename F>
void with_attn_kernel(const AttnProblem& p, F&& f) {
  const bool wide = p.Dqk > 128;
  const bool tall = p.H / p.Hkv > 16;
  const auto pick = [&](auto dqk, auto dv, auto rows) {
    constexpr int kDqk = decltype(dqk)::value, kDv = decltype(dv)::value, kRows = decltype(rows)::value;
    if constexpr (kForward) {
      using S = FwdShape<kDqk, kDv, kRows>;
      f(attn_fwd_kernel<T, kDqk, kDv, kRows>, kRows, S::kThreads, S::kSmem);
    } else {
      using S = BwdShape<kDqk, kDv, kRows>;
      f(attn_bwd_kernel<T, kDqk, kDv, kRows>, kRows, S::kThreads, S::kSmem);
    }
  };
  using I128 = std::integral_constant<int, 128>;
  using I576 = std::integral_constant<int, 576>;
  using I512 = std::integral_constant<int, 512>;
  using R16 = std::integral_constant<int, 16>;
  using R64 = std::integral_constant<int, 64>;
  if (wide) {
    tall ? pick(I576{}, I512{}, R64{}) : pick(I576{}, I512{}, R16{});
  } else {
    tall ? pick(I128{}, I128{}, R64{}) : pick(I128{}, I128{}, R16{});
  }
}

AttnArgs attn_args(const AttnProblem& p, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                   const at::Tensor& gate, int rows) {
  AttnArgs a{};
  a.q = q.data_ptr();
  a.kv = kv.data_ptr();
  a.indices = indices.data_ptr<int32_t>();
  a.gate = gate.defined() ? gate.data_ptr() : nullptr;
  a.T = p.T;
  a.H = p.H;
  a.Hkv = p.Hkv;
  a.Tk = p.Tk;
  a.Dqk = static_cast<int>(p.Dqk);
  a.dv = static_cast<int>(p.dv);
  a.topk = static_cast<int>(p.topk);
  a.G = static_cast<int>(p.H / p.Hkv);
  a.head_blocks = static_cast<int>(ceil_div(a.G, rows));
  a.scale = static_cast<float>(p.scale);
  return a;
}

// Contiguous rows starting on a 16-byte boundary: the CUDA kernels copy rows in 16-byte pieces
// (a contiguous view at an odd element offset is copied).
at::Tensor rows16(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

// The CUDA kernels take 16-bit operands (fp32 accumulation) and these head sizes.
void check_cuda_dtype(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, op,
              ": the CUDA kernel takes bfloat16 or float16 inputs, got ", q.scalar_type(),
              " (float32/float64 run on CPU tensors or through kda_dsa_ops.reference)");
}

void check_indexer_cuda(const IndexerShapes& s, const at::Tensor& q, const char* op) {
  check_cuda_dtype(q, op);
  TORCH_CHECK(s.Hi <= 64, op, ": the CUDA kernel takes up to 64 indexer heads, got Hi = ", s.Hi);
  TORCH_CHECK(s.Di % 8 == 0 && s.Di >= 8 && s.Di <= 128, op,
              ": the CUDA kernel takes Di a multiple of 8 from 8 to 128, got Di = ", s.Di);
}

void check_attn_cuda(const AttnProblem& p, const at::Tensor& q, const char* op) {
  check_cuda_dtype(q, op);
  TORCH_CHECK(p.Dqk % 8 == 0 && (p.Dqk <= 128 || (p.Dqk <= 576 && p.dv <= 512)), op,
              ": the CUDA kernel takes Dqk a multiple of 8, up to 128 (GQA) or up to 576 with dv <= 512 (MLA), "
              "got Dqk = ", p.Dqk, ", dv = ", p.dv);
}

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
  const size_t smem = F::kAlign + F::kStages * F::kStageBytes + F::kQBytes +
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

void indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                      const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw) {
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  IndexerBwdArgs a{q.data_ptr(),
                   k.data_ptr(),
                   w.data_ptr<float>(),
                   indices.data_ptr<int32_t>(),
                   grad_scores.data_ptr<float>(),
                   k.size(0),
                   static_cast<int>(q.size(1)),
                   static_cast<int>(q.size(2)),
                   static_cast<int>(indices.size(1)),
                   dq.data_ptr(),
                   dk.data_ptr<float>(),
                   dw.data_ptr<float>()};
  const size_t smem = ((kIdxRows + 2 * kIdxKeys) * kIdxLd + kIdxRows * kIdxLdC) * q.element_size() +
                      (3 * kIdxRows + 2 * kIdxKeys) * sizeof(float) + 2 * kIdxKeys * sizeof(int);
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "lightning_indexer_bwd", [&] {
    launch(indexer_bwd_kernel<scalar_t>, dim3(q.size(0)), kIdxThreads, smem, a);
  });
}

void attn_fwd_cuda(const AttnProblem& p, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
                   const at::Tensor& gate, at::Tensor& o, at::Tensor& lse, at::Tensor& probs) {
  const c10::cuda::CUDAGuard guard(q.device());
  // The portable_sfa switch keeps the MLA layout on the portable kernel, the one other GPUs take
  // (the tests compare both on Hopper).
  const bool mla_hopper = p.Dqk == MlaFwd::kDqk && p.dv == MlaFwd::kDv && p.Hkv == 1 && is_sm90(q) &&
                          !switch_on(Switch::kPortableSfa);
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_fwd", [&] {
    if (mla_hopper) {
      AttnArgs a = attn_args(p, q, kv, indices, gate, MlaFwd::kRows);
      a.o = o.data_ptr();
      a.lse = lse.data_ptr<float>();
      a.probs = probs.defined() ? probs.data_ptr<float>() : nullptr;  // zeros (atomics over head blocks)
      const auto kernel = mla_fwd_kernel<scalar_t>;
      set_smem(kernel, kMlaFwdSmem);
      kernel<<<dim3(p.T, 1, a.head_blocks), MlaFwd::kThreads, kMlaFwdSmem, c10::cuda::getCurrentCUDAStream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    with_attn_kernel<scalar_t, true>(p, [&](auto kernel, int rows, int threads, size_t smem) {
      AttnArgs a = attn_args(p, q, kv, indices, gate, rows);
      a.o = o.data_ptr();
      a.lse = lse.data_ptr<float>();
      a.probs = probs.defined() ? probs.data_ptr<float>() : nullptr;
      launch(kernel, dim3(p.T, p.Hkv, a.head_blocks), threads, smem, a);
    });
  });
}

void attn_bwd_cuda(const AttnProblem& p, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& indices, const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate,
                   bool deterministic, at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate) {
  const c10::cuda::CUDAGuard guard(q.device());
  KDA_DISPATCH_CUDA_HALF(q.scalar_type(), "sparse_attn_bwd", [&] {
    with_attn_kernel<scalar_t, false>(p, [&](auto kernel, int rows, int threads, size_t smem) {
      AttnArgs a = attn_args(p, q, kv, indices, gate, rows);
      a.grad_o = grad_o.data_ptr();
      a.o_in = o.data_ptr();
      a.lse_in = lse.data_ptr<float>();
      a.dq = dq.data_ptr();
      a.dgate = dgate.defined() ? dgate.data_ptr() : nullptr;
      if (!deterministic) {
        a.dkv = dkv.data_ptr<float>();
        launch(kernel, dim3(p.T, p.Hkv, a.head_blocks), threads, smem, a);
        return;
      }
      // Deterministic: each (query, slot) contribution is stored, then summed into dkv in index
      // order by a sort-based accumulate, a chunk of queries at a time. dkv has one extra row that
      // takes the slots without a key.
      const int64_t per_query = p.Hkv * a.head_blocks * p.topk * p.Dqk;
      const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 27) / std::max<int64_t>(per_query, 1));
      at::Tensor contrib = at::empty({std::min(chunk, p.T) * per_query}, q.options().dtype(at::kFloat));
      const at::Tensor rows_of = at::where(indices.ge(0).logical_and(indices.lt(p.Tk)), indices * p.Hkv + at::arange(p.Hkv, indices.options()).view({1, -1, 1}),
                                           at::full({}, p.Tk * p.Hkv, indices.options()))
                                     .to(at::kLong);
      at::Tensor dkv_rows = dkv.view({-1, p.Dqk});
      for (int64_t t0 = 0; t0 < p.T; t0 += chunk) {
        const int64_t n = std::min(chunk, p.T - t0);
        a.t0 = t0;
        a.contrib = contrib.data_ptr<float>();
        launch(kernel, dim3(n, p.Hkv, a.head_blocks), threads, smem, a);
        const at::Tensor keys =
            rows_of.narrow(0, t0, n).unsqueeze(2).expand({n, p.Hkv, a.head_blocks, p.topk}).reshape({-1});
        dkv_rows.index_put_({keys}, contrib.narrow(0, 0, n * per_query).view({-1, p.Dqk}), /*accumulate=*/true);
      }
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> lightning_indexer_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& w, const at::Tensor& cu_seqlens_q,
                                                              const at::Tensor& cu_seqlens_k, int64_t topk) {
  const IndexerProblem p = check_indexer_fwd(q, k, w, cu_seqlens_q, cu_seqlens_k, topk);
  check_indexer_cuda(IndexerShapes{p.T, p.Tk, p.Hi, p.Di}, q, "lightning_indexer");
  at::Tensor indices = at::empty({p.T, topk}, q.options().dtype(at::kInt));
  at::Tensor scores = at::empty({p.T, topk}, q.options().dtype(at::kFloat));
  indexer_fwd_cuda(p, rows16(q), rows16(k), contiguous_as(w, at::kFloat), indices, scores);
  return {indices, scores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lightning_indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                          const at::Tensor& w,
                                                                          const at::Tensor& indices,
                                                                          const at::Tensor& grad_scores) {
  const IndexerShapes s = check_indexer_bwd(q, k, w, indices, grad_scores);
  check_indexer_cuda(s, q, "lightning_indexer_bwd");
  at::Tensor dq = at::empty({s.T, s.Hi, s.Di}, q.options());
  at::Tensor dk = at::zeros({s.Tk, s.Di}, q.options().dtype(at::kFloat));
  at::Tensor dw = at::zeros({s.T, s.Hi}, q.options().dtype(at::kFloat));
  indexer_bwd_cuda(rows16(q), rows16(k), contiguous_as(w, at::kFloat), indices.contiguous(),
                   contiguous_as(grad_scores, at::kFloat), dq, dk, dw);
  return {dq, dk.to(k.scalar_type()), dw.to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_fwd_cuda(const at::Tensor& q, const at::Tensor& kv,
                                                                    const at::Tensor& indices, double scale,
                                                                    int64_t dv, const std::optional<at::Tensor>& gate,
                                                                    bool return_p, bool deterministic) {
  const AttnProblem p = check_attn_fwd(q, kv, indices, scale, dv, gate);
  (void)deterministic;  // a flag for the backward (autograd keeps it); the forward always is
  check_attn_cuda(p, q, "sparse_attn_fwd");
  at::Tensor o = at::empty({p.T, p.H, dv}, q.options());
  at::Tensor lse = at::empty({p.T, p.H}, q.options().dtype(at::kFloat));
  at::Tensor probs = return_p ? at::zeros({p.T, p.Hkv, p.topk}, q.options().dtype(at::kFloat)) : at::Tensor();
  attn_fwd_cuda(p, rows16(q), rows16(kv), indices.contiguous(),
                gate.has_value() ? gate->to(q.scalar_type()).contiguous() : at::Tensor(), o, lse, probs);
  return {o, lse, return_p ? probs : at::empty({0}, q.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_attn_bwd_cuda(const at::Tensor& grad_o, const at::Tensor& q,
                                                                    const at::Tensor& kv, const at::Tensor& indices,
                                                                    const at::Tensor& o, const at::Tensor& lse,
                                                                    double scale, int64_t dv,
                                                                    const std::optional<at::Tensor>& gate,
                                                                    bool deterministic) {
  const AttnProblem p = check_attn_bwd(grad_o, q, kv, indices, o, lse, scale, dv, gate);
  check_attn_cuda(p, q, "sparse_attn_bwd");
  const auto half = q.scalar_type();
  at::Tensor dq = at::empty({p.T, p.H, p.Dqk}, q.options());
  at::Tensor dkv = at::zeros({p.Tk * p.Hkv + 1, p.Dqk}, q.options().dtype(at::kFloat));
  at::Tensor dgate = gate.has_value() ? at::empty({p.T, p.H, dv}, q.options()) : at::Tensor();
  attn_bwd_cuda(p, grad_o.to(half).contiguous(), rows16(q), rows16(kv), indices.contiguous(), o.to(half).contiguous(),
                lse.to(at::kFloat).contiguous(), gate.has_value() ? gate->to(half).contiguous() : at::Tensor(),
                deterministic, dq, dkv, dgate);
  return {dq, dkv.narrow(0, 0, p.Tk * p.Hkv).view({p.Tk, p.Hkv, p.Dqk}).to(kv.scalar_type()),
          gate.has_value() ? dgate.to(gate->scalar_type()) : at::empty({0}, q.options())};
}

}  // namespace kda_dsa_ops::dsa
