// grouped_mm and grouped_mm_wgrad on Hopper (sm_90a): wgmma + TMA, warp-specialised, 2-CTA clusters.
//
//   forward: out[r, :] = a[r, :] @ b[e]               for the rows r of expert e
//   wgrad:   out[e]    = a[rows of e]^T @ dy[rows of e]
// Rows of expert e are [bounds[e], bounds[e+1]), bounds = offs clamped to be non-decreasing
// and within [0, M] (so bad offs never reach memory out of bounds).
//
// Tiling: a persistent grid of 2-CTA clusters walks 128 x 256 output tiles two at a time
// (forward: expert by expert, the 128-row tiles of an expert innermost so its weight tile stays
// in L2; wgrad: expert, N tile, K tile). The two tiles of a pair usually share an operand (the
// same weight columns in the forward, the same dy columns in wgrad): each CTA then loads half of
// it and multicasts it to both, halving that operand's L2 traffic. Each CTA has one producer
// warpgroup whose single thread issues the TMA loads of 64-deep reduction slices into a 4-stage
// ring of 128B-swizzled shared-memory tiles (48 KB a stage), and two consumer warpgroups, each
// holding a 64 x 256 fp32 accumulator in registers and issuing wgmma m64n256k16. A stage is refilled once the consumers
// of both CTAs have released it (full/empty mbarriers, the empty ones cluster-wide). The forward
// epilogue stages 64 output columns at a time in a swizzled shared-memory box per warpgroup and
// stores whole 16-byte row pieces from it, masked to the expert's rows and to N; the wgrad
// epilogue (whose output, E x K x N, can outweigh its inputs) stages 64 columns at a time in two
// boxes per warpgroup taken in turn and leaves them to TMA stores, so it costs the consumers
// little more than the shared-memory writes. Either way the producer already streams the next
// tile.
// In wgrad the last reduction slice of an expert can reach into the next expert's rows: the
// consumers zero those rows first. A wgrad tile's reduction starts at a slice set by its
// cluster's place in the schedule and wraps around (first_slice), so that tiles of one expert
// running together tend to read the same rows.
#include "common/checks.h"
#include "common/device.cuh"
#include "common/dispatch.h"
#include "common/hopper.cuh"
#include "common/pipeline.cuh"
#include "common/tma.h"
#include "moe/moe.h"

namespace kda_dsa_ops::moe {
namespace {

using namespace sm90;

enum class GemmMode {
  kForwardKN,  // b[e] is [K, N] with N contiguous (wgmma B operand N-major)
  kForwardNK,  // b[e] is the transpose view of an [N, K] matrix, K contiguous (B K-major)
  kWgrad,      // A = a^T (M-major), B = dy (N-major), reduction over the expert's rows
};

// Two consumer warpgroups of 64 output rows and the producer warpgroup.
struct GemmTraits : sm90::WarpSpecialized<2, 40, 232> {
  static constexpr int kBM = 128, kBN = 256, kBK = 64;
  static constexpr int kStages = 4;
  using Ring = sm90::StageRing<kStages>;
  static constexpr int kClusterSize = 2;
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = kBN * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kChunkBytes = 64 * 128;               // one 64 x 64 swizzled box
  static constexpr int kMaxExperts = 4096;

  // Epilogue staging per consumer warpgroup: the forward one 8 KB box (64 output columns), wgrad
  // two that its TMA stores read in turn.
  static constexpr int epilogue_bytes(GemmMode mode) {
    return kConsumers * (mode == GemmMode::kWgrad ? 2 : 1) * kChunkBytes;
  }
  static constexpr size_t smem_bytes(GemmMode mode, int tile_prefix_entries) {
    return sm90::kSwizzleAlign + kStages * kStageBytes + epilogue_bytes(mode) + sizeof(Ring) +
           static_cast<size_t>(tile_prefix_entries) * 4;
  }
};

struct GemmParams {
  void* out;
  const int* bounds;       // [E + 1] expert row bounds
  const int* tile_prefix;  // forward: [E + 1] cumulative 128-row tiles per expert
  int num_experts, M, N, K;
  int n_tiles;             // ceil(N / kBN)
  int k_row_tiles;         // wgrad: ceil(K / kBM)
};

// One output tile: rows [m0, m_end) of the output (tokens, or K in wgrad), columns from n0,
// reduction slices [r0, r0 + 64 * k_steps) with valid reduction indices below r_end.
struct Tile {
  int expert, m0, m_end, n0, r0, r_end, k_steps;
};

// Tiles are numbered in walk order and handed out in pairs, one pair per cluster at a time.
// A wgrad pair never spans two experts (both tiles then have the same reduction length); when
// a pair has only one tile, its second CTA computes the same tile again.
template <GemmMode kMode>
__device__ __forceinline__ int num_pairs(const GemmParams& p, const int* tile_prefix) {
  if constexpr (kMode == GemmMode::kWgrad) {
    return p.num_experts * ((p.k_row_tiles * p.n_tiles + 1) / 2);
  } else {
    return (tile_prefix[p.num_experts] * p.n_tiles + 1) / 2;
  }
}

template <GemmMode kMode>
__device__ __forceinline__ int pair_slot(const GemmParams& p, const int* tile_prefix, int pair, int rank) {
  if constexpr (kMode == GemmMode::kWgrad) {
    const int per_expert = p.k_row_tiles * p.n_tiles, pairs_per_expert = (per_expert + 1) / 2;
    const int expert = pair / pairs_per_expert;
    return expert * per_expert + min(2 * (pair - expert * pairs_per_expert) + rank, per_expert - 1);
  } else {
    return min(2 * pair + rank, tile_prefix[p.num_experts] * p.n_tiles - 1);
  }
}

template <GemmMode kMode>
__device__ __forceinline__ Tile decode_tile(const GemmParams& p, const int* tile_prefix, int tile) {
  using Tr = GemmTraits;
  Tile t;
  if constexpr (kMode == GemmMode::kWgrad) {
    const int per_expert = p.k_row_tiles * p.n_tiles;
    t.expert = tile / per_expert;
    const int rem = tile - t.expert * per_expert;
    // K tiles innermost: a pair (two K tiles of one N tile) shares its dy slice, 32 of the 48 KB
    // a stage holds (N tiles innermost shared the 16 KB a^T slice); the tiles running together
    // span all of K but a few N tiles, the smaller set of columns of a and dy per row.
    t.m0 = (rem % p.k_row_tiles) * Tr::kBM;
    t.m_end = p.K;
    t.n0 = (rem / p.k_row_tiles) * Tr::kBN;
    t.r0 = __ldg(p.bounds + t.expert);
    t.r_end = __ldg(p.bounds + t.expert + 1);
  } else {
    // The expert owning this tile: the last e with tile_prefix[e] * n_tiles <= tile.
    int lo = 0, hi = p.num_experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_prefix[mid] * p.n_tiles <= tile) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    t.expert = lo;
    const int m_tiles = tile_prefix[lo + 1] - tile_prefix[lo];
    const int local = tile - tile_prefix[lo] * p.n_tiles;
    t.m0 = __ldg(p.bounds + lo) + (local % m_tiles) * Tr::kBM;
    t.m_end = __ldg(p.bounds + lo + 1);
    t.n0 = (local / m_tiles) * Tr::kBN;
    t.r0 = 0;
    t.r_end = p.K;
  }
  t.k_steps = static_cast<int>(ceil_div(t.r_end - t.r0, Tr::kBK));
  return t;
}

// wgrad: which reduction slice a tile runs at its step ks. A cluster's `clock` counts the slices
// (plus an allowance per tile for its epilogue) it ran before the tile; the tile starts at slice
// clock % k_steps and wraps around. If tiles took exactly their slices' worth of time, tiles of
// one expert running at the same time would then read the same rows of a and dy whenever they
// started (one started later joins at the rows the others are reading), so those rows would come
// from L2 once per wave; all starting at slice 0, the tiles of a long expert on clusters that
// began it at different times read rows thousands apart, each from DRAM. Real tile times vary,
// so the alignment is partial (bench/NOTES.md). With equal loads all clusters keep the same
// clock. The order depends only on offs and the grid: the same on every run.
constexpr int kTileClockSlices = 2;

template <GemmMode kMode>
__device__ __forceinline__ int first_slice(const Tile& t, int clock) {
  return kMode == GemmMode::kWgrad && t.k_steps > 0 ? clock % t.k_steps : 0;
}

__device__ __forceinline__ int slice_at(int ks, int first, int k_steps) {
  return ks + first < k_steps ? ks + first : ks + first - k_steps;
}

// Loads one reduction slice of an operand made of `kChunks` equal boxes into `dst`. A shared
// operand is split between the two CTAs of the cluster, each multicasting its half to both.
template <int kChunks, int kChunkBytes, typename Load, typename Multicast>
__device__ __forceinline__ void load_operand(uint8_t* dst, bool shared, uint32_t rank, Load load,
                                             Multicast multicast) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (!shared) {
      load(dst + c * kChunkBytes, c);
    } else if (c % GemmTraits::kClusterSize == static_cast<int>(rank)) {
      multicast(dst + c * kChunkBytes, c);
    }
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const T l = from_float<T>(lo), h = from_float<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&l)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&h)) << 16);
}

// This thread's accumulator columns [64 c, 64 c + 64) of its rows (16 warp + lane / 4, + 8) into
// a box, as 16-bit pairs; c must be a compile-time constant after unrolling.
template <typename T>
__device__ __forceinline__ void stage_box(uint8_t* box, const float (&acc)[128], int c, int warp, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + lane / 4 + half * 8;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int j = c * 8 + q;
      *reinterpret_cast<uint32_t*>(box + sw128_offset(r, q) + (lane % 4) * 4) =
          pack_pair<T>(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
  }
}

// Rows [valid, 64) of every 64-row box of a wgrad stage belong to the next expert (or past M):
// zero them in both operands so they add nothing, then publish the writes to the async proxy.
__device__ __forceinline__ void zero_stage_tail(uint8_t* stage, int valid, int consumer_thread) {
  using Tr = GemmTraits;
  constexpr int kBoxes = Tr::kStageBytes / Tr::kChunkBytes;  // 2 boxes of a^T, 4 of dy
  const int rows = 64 - valid;
  const int per_box = rows * 8;                              // 16-byte pieces per box
  for (int i = consumer_thread; i < kBoxes * per_box; i += Tr::kConsumers * 128) {
    const int box = i / per_box, rem = i - box * per_box;
    uint8_t* p = stage + box * Tr::kChunkBytes + (valid + rem / 8) * 128 + (rem % 8) * 16;
    *reinterpret_cast<uint4*>(p) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(1, Tr::kConsumers * 128);
}

template <typename T, GemmMode kMode>
__global__ void __launch_bounds__(GemmTraits::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ GemmParams p, const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b, const __grid_constant__ CUtensorMap map_out) {
#ifdef KDA_SM90A_ENABLED
  using Tr = GemmTraits;
  constexpr int kStages = Tr::kStages;
  constexpr int kTransA = kMode == GemmMode::kWgrad ? 1 : 0;
  constexpr int kTransB = kMode == GemmMode::kForwardNK ? 0 : 1;
  constexpr uint16_t kBothCtas = 0b11;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = aligned_smem(smem_raw);
  // Epilogue staging, 128B-swizzled 64 x 64 boxes: wgrad [2 warpgroups][2 boxes], forward [2 warpgroups].
  uint8_t* staging = smem + kStages * Tr::kStageBytes;
  Tr::Ring& ring = *reinterpret_cast<Tr::Ring*>(staging + Tr::epilogue_bytes(kMode));
  int* tile_prefix = reinterpret_cast<int*>(&ring + 1);

  const int warpgroup = Tr::warpgroup();
  const uint32_t rank = cluster_cta_rank();
  const int cluster = blockIdx.x / Tr::kClusterSize, clusters = gridDim.x / Tr::kClusterSize;
  if (threadIdx.x == 0) ring.init(1, Tr::kClusterSize * Tr::kConsumers * 4);  // the TMA bytes; every consumer warp of the cluster
  if constexpr (kMode != GemmMode::kWgrad) {
    for (int i = threadIdx.x; i <= p.num_experts; i += blockDim.x) tile_prefix[i] = p.tile_prefix[i];
  }
  cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrival
  const int pairs = num_pairs<kMode>(p, tile_prefix);

  if (Tr::is_producer()) {
    // Producer: one thread streams every stage of every tile this CTA owns.
    Tr::producer_registers();
    if (threadIdx.x == Tr::kConsumers * 128) {
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      Tr::Ring::Cursor at;
      int clock = 0;
      for (int pair = cluster; pair < pairs; pair += clusters) {
        const Tile t = decode_tile<kMode>(p, tile_prefix, pair_slot<kMode>(p, tile_prefix, pair, rank));
        const Tile peer = decode_tile<kMode>(p, tile_prefix, pair_slot<kMode>(p, tile_prefix, pair, rank ^ 1));
        const bool same_expert = t.expert == peer.expert;
        const bool share_a = t.m0 == peer.m0 && (kMode != GemmMode::kWgrad || same_expert);
        const bool share_b = same_expert && t.n0 == peer.n0;
        const int first = first_slice<kMode>(t, clock);
        clock += t.k_steps + kTileClockSlices;
        for (int ks = 0; ks < t.k_steps; ++ks) {
          ring.wait_empty(at);
          uint8_t* sa = smem + at.stage * Tr::kStageBytes;
          uint8_t* sb = sa + Tr::kABytes;
          uint64_t* bar = &ring.full[at.stage][0];
          const int r = t.r0 + slice_at(ks, first, t.k_steps) * Tr::kBK;
          mbar_arrive_expect_tx(bar, Tr::kStageBytes);
          if constexpr (kMode == GemmMode::kWgrad) {
            load_operand<2, Tr::kChunkBytes>(
                sa, share_a, rank, [&](uint8_t* d, int c) { tma_load_2d(d, &map_a, bar, t.m0 + 64 * c, r); },
                [&](uint8_t* d, int c) { tma_load_2d_multicast(d, &map_a, bar, t.m0 + 64 * c, r, kBothCtas); });
            load_operand<4, Tr::kChunkBytes>(
                sb, share_b, rank, [&](uint8_t* d, int c) { tma_load_2d(d, &map_b, bar, t.n0 + 64 * c, r); },
                [&](uint8_t* d, int c) { tma_load_2d_multicast(d, &map_b, bar, t.n0 + 64 * c, r, kBothCtas); });
          } else {
            load_operand<2, Tr::kChunkBytes>(
                sa, share_a, rank, [&](uint8_t* d, int c) { tma_load_2d(d, &map_a, bar, r, t.m0 + 64 * c); },
                [&](uint8_t* d, int c) { tma_load_2d_multicast(d, &map_a, bar, r, t.m0 + 64 * c, kBothCtas); });
            if constexpr (kMode == GemmMode::kForwardNK) {
              load_operand<2, 2 * Tr::kChunkBytes>(
                  sb, share_b, rank,
                  [&](uint8_t* d, int c) { tma_load_3d(d, &map_b, bar, r, t.n0 + 128 * c, t.expert); },
                  [&](uint8_t* d, int c) {
                    tma_load_3d_multicast(d, &map_b, bar, r, t.n0 + 128 * c, t.expert, kBothCtas);
                  });
            } else {
              load_operand<4, Tr::kChunkBytes>(
                  sb, share_b, rank,
                  [&](uint8_t* d, int c) { tma_load_3d(d, &map_b, bar, t.n0 + 64 * c, r, t.expert); },
                  [&](uint8_t* d, int c) {
                    tma_load_3d_multicast(d, &map_b, bar, t.n0 + 64 * c, r, t.expert, kBothCtas);
                  });
            }
          }
          at.advance();
        }
      }
    }
    cluster_sync();  // no CTA leaves while its peer may still write into it
    return;
  }

  // Consumers.
  Tr::consumer_registers();
  const int consumer_thread = threadIdx.x;  // 0 .. 255
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  T* out = static_cast<T*>(p.out);

  if constexpr (kMode != GemmMode::kWgrad) {
    // Rows past the last expert are zero (torch._grouped_mm leaves them undefined).
    const int tail_start = __ldg(p.bounds + p.num_experts);
    const int64_t pieces = static_cast<int64_t>(p.M - tail_start) * (p.N / 8);
    for (int64_t i = blockIdx.x * 256ll + consumer_thread; i < pieces; i += gridDim.x * 256ll) {
      const int64_t row = tail_start + i / (p.N / 8), col = (i % (p.N / 8)) * 8;
      *reinterpret_cast<uint4*>(out + row * p.N + col) = make_uint4(0, 0, 0, 0);
    }
  }

  float acc[128];
  Tr::Ring::Cursor at;
  int clock = 0;
  for (int pair = cluster; pair < pairs; pair += clusters) {
    const Tile t = decode_tile<kMode>(p, tile_prefix, pair_slot<kMode>(p, tile_prefix, pair, rank));
    const int first = first_slice<kMode>(t, clock);
    clock += t.k_steps + kTileClockSlices;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    int previous = -1;
    for (int ks = 0; ks < t.k_steps; ++ks) {
      ring.wait_full(at);
      uint8_t* sa = smem + at.stage * Tr::kStageBytes;
      uint8_t* sb = sa + Tr::kABytes;
      if constexpr (kMode == GemmMode::kWgrad) {
        const int valid = t.r_end - (t.r0 + slice_at(ks, first, t.k_steps) * Tr::kBK);
        if (valid < Tr::kBK) zero_stage_tail(sa, valid, consumer_thread);
      }
      const uint32_t a_base = smem_addr(sa) + warpgroup * Tr::kChunkBytes;
      const uint32_t b_base = smem_addr(sb);
      fence_accumulators(acc);
      wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < Tr::kBK / 16; ++k16) {
        // K-major operands advance 32 bytes along the swizzled row; M/N-major ones 16 rows.
        const uint64_t da = kTransA ? sw128_descriptor(a_base + k16 * 2048, Tr::kChunkBytes)
                                    : sw128_descriptor(a_base + k16 * 32, 16);
        const uint64_t db = kTransB ? sw128_descriptor(b_base + k16 * 2048, Tr::kChunkBytes)
                                    : sw128_descriptor(b_base + k16 * 32, 16);
        wgmma_m64n256k16<T, kTransA, kTransB>(acc, da, db);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous slice's wgmmas are done: release its stage in both CTAs
      fence_accumulators(acc);
      if (previous >= 0 && lane == 0) {
        for (uint32_t cta = 0; cta < Tr::kClusterSize; ++cta) mbar_arrive_cluster(ring.empty + previous, cta);
      }
      previous = at.stage;
      at.advance();
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (previous >= 0 && lane == 0) {
      for (uint32_t cta = 0; cta < Tr::kClusterSize; ++cta) mbar_arrive_cluster(ring.empty + previous, cta);
    }

    // Epilogue: this thread's rows are m0 + 64*warpgroup + 16*warp + lane/4 (+8).
    if constexpr (kMode == GemmMode::kWgrad) {
      // 64 columns at a time into this warpgroup's two 64 x 64 boxes in turn, 128B-swizzled as
      // the TMA store expects them; a box is rewritten once the store of two boxes ago has read it.
      const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint8_t* box = staging + (warpgroup * 2 + c % 2) * Tr::kChunkBytes;
        if (leader) tma_store_wait_read<1>();
        named_barrier_sync(2 + warpgroup, 128);
        stage_box<T>(box, acc, c, warp, lane);
        fence_proxy_async();
        named_barrier_sync(2 + warpgroup, 128);
        if (leader) {
          tma_store_3d(&map_out, box, t.n0 + 64 * c, t.m0 + 64 * warpgroup, t.expert);
          tma_store_commit();
        }
      }
    } else {
      // 64 columns at a time through this warpgroup's box: the fragments go in as 4-byte pairs,
      // then each thread moves whole 16-byte pieces of rows (a warp writes four full 128-byte
      // row segments per store, where storing the pairs straight from registers touched eight
      // rows with 16 bytes each), masked to the expert's rows and to N.
      uint8_t* box = staging + warpgroup * Tr::kChunkBytes;
      const int consumer = threadIdx.x % 128;
#pragma unroll
      for (int sub = 0; sub < 4; ++sub) {
        named_barrier_sync(2 + warpgroup, 128);  // the previous box's pieces are read
        stage_box<T>(box, acc, sub, warp, lane);
        named_barrier_sync(2 + warpgroup, 128);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int piece = consumer + i * 128, r = piece / 8, q = piece % 8;
          const int row = t.m0 + warpgroup * 64 + r, col = t.n0 + sub * 64 + q * 8;
          if (row < t.m_end && col < p.N) {
            *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * p.N + col) =
                *reinterpret_cast<const uint4*>(box + sw128_offset(r, q));
          }
        }
      }
    }
  }
  if constexpr (kMode == GemmMode::kWgrad) {
    if (threadIdx.x % 128 == 0) tma_store_wait();
  }
  cluster_sync();
#endif
}

// bounds[e+1] = min(max(offs[0..e], 0), M) (non-decreasing, within [0, M]); tile_prefix[e+1] =
// sum of ceil(rows / 128) over experts 0..e. One block.
__global__ void __launch_bounds__(1024) expert_bounds_kernel(const int* __restrict__ offs, int E, int M,
                                                             int* __restrict__ bounds, int* __restrict__ tile_prefix) {
  __shared__ int warp_totals[kWarpSize];
  __shared__ int chunk_ends[1024];
  int end_carry = 0, tile_carry = 0;
  if (threadIdx.x == 0) bounds[0] = tile_prefix[0] = 0;
  for (int base = 0; base < E; base += blockDim.x) {
    const int e = base + threadIdx.x;
    const int v = e < E ? min(max(offs[e], 0), M) : 0;
    int total;
    const int end = max(block_inclusive_scan(v, MaxOp{}, 0, warp_totals, &total), end_carry);
    chunk_ends[threadIdx.x] = end;
    __syncthreads();
    const int start = threadIdx.x == 0 ? end_carry : chunk_ends[threadIdx.x - 1];
    const int tiles = e < E ? static_cast<int>(ceil_div(end - start, GemmTraits::kBM)) : 0;
    int tiles_total;
    const int tiles_incl = block_inclusive_scan(tiles, SumOp{}, 0, warp_totals, &tiles_total);
    if (e < E) {
      bounds[e + 1] = end;
      tile_prefix[e + 1] = tile_carry + tiles_incl;
    }
    end_carry = max(end_carry, total);
    tile_carry += tiles_total;
    __syncthreads();
  }
}

void check_half(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
              ": the CUDA kernel takes bfloat16 or float16, got ", t.scalar_type());
}

void check_rows_unit_stride(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, op, ": ", name, " must have unit stride in its last dimension, got ",
              "strides ", c10::str(t.strides()), "; call .contiguous() first");
}

// Workspace [2, E + 1]: expert row bounds and forward tile prefix, computed on the device.
at::Tensor expert_bounds(const at::Tensor& offs, int64_t M, cudaStream_t stream) {
  const int64_t E = offs.size(0);
  at::Tensor ws = at::empty({2, E + 1}, offs.options());
  expert_bounds_kernel<<<1, 1024, 0, stream>>>(offs.contiguous().data_ptr<int>(), static_cast<int>(E),
                                               static_cast<int>(M), ws[0].data_ptr<int>(), ws[1].data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return ws;
}

template <typename T, GemmMode kMode>
void launch_gemm(const GemmParams& p, const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_out,
                 int64_t max_tiles, int device, cudaStream_t stream) {
  using Tr = GemmTraits;
  const auto kernel = grouped_gemm_kernel<T, kMode>;
  const int prefix_entries = kMode == GemmMode::kWgrad ? 0 : p.num_experts + 1;
  const size_t smem = Tr::smem_bytes(kMode, prefix_entries);
  set_smem(kernel, smem);
  const int64_t clusters = std::max<int64_t>(
      1, std::min<int64_t>(num_sms(device) / Tr::kClusterSize, ceil_div(max_tiles, Tr::kClusterSize)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(clusters * Tr::kClusterSize));
  config.blockDim = dim3(Tr::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = Tr::kClusterSize;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p, map_a, map_b, map_out));
}

}  // namespace

at::Tensor grouped_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs) {
  using Tr = GemmTraits;
  check_grouped_mm(a, b, offs);
  check_half(a, "grouped_mm");
  check_sm90(a, "grouped_mm");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(2), E = b.size(0);
  TORCH_CHECK(E <= Tr::kMaxExperts, "grouped_mm: the CUDA kernel takes at most ", Tr::kMaxExperts,
              " experts, got ", E);
  TORCH_CHECK(N % 8 == 0, "grouped_mm: the CUDA kernel needs N % 8 == 0 (16-byte output rows), got N = ", N);
  check_rows_unit_stride(a, "a", "grouped_mm");
  const bool n_contiguous = b.stride(2) == 1 || N == 1;
  TORCH_CHECK(n_contiguous || b.stride(1) == 1, "grouped_mm: b must be [E, K, N] with N contiguous, or the transpose ",
              "view of an [E, N, K] tensor (K contiguous), got strides ", c10::str(b.strides()));
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ws = expert_bounds(offs, M, stream);
  GemmParams p{out.data_ptr(), ws[0].data_ptr<int>(), ws[1].data_ptr<int>(), static_cast<int>(E),
               static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(ceil_div(N, Tr::kBN)), 0};
  const CUtensorMap map_a = make_tensor_map_sw128<2>(a, {uint64_t(K), uint64_t(M)}, {uint64_t(a.stride(0))},
                                                     {64, 64}, "a");
  const int64_t max_tiles = (ceil_div(M, Tr::kBM) + E) * p.n_tiles;
  KDA_DISPATCH_CUDA_HALF(a.scalar_type(), "grouped_mm", [&] {
    if (n_contiguous) {
      const uint64_t expert_stride = E == 1 ? uint64_t(K) * b.stride(1) : uint64_t(b.stride(0));
      const CUtensorMap map_b = make_tensor_map_sw128<3>(b, {uint64_t(N), uint64_t(K), uint64_t(E)},
                                                         {uint64_t(b.stride(1)), expert_stride}, {64, 64, 1}, "b");
      launch_gemm<scalar_t, GemmMode::kForwardKN>(p, map_a, map_b, map_b, max_tiles, a.get_device(), stream);
    } else {
      const uint64_t expert_stride = E == 1 ? uint64_t(N) * b.stride(2) : uint64_t(b.stride(0));
      const CUtensorMap map_b = make_tensor_map_sw128<3>(b, {uint64_t(K), uint64_t(N), uint64_t(E)},
                                                         {uint64_t(b.stride(2)), expert_stride}, {64, 128, 1}, "b");
      launch_gemm<scalar_t, GemmMode::kForwardNK>(p, map_a, map_b, map_b, max_tiles, a.get_device(), stream);
    }
  });
  return out;
}

at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& offs) {
  using Tr = GemmTraits;
  check_grouped_mm_wgrad(a, dy, offs);
  check_half(a, "grouped_mm_wgrad");
  check_sm90(a, "grouped_mm_wgrad");
  const int64_t M = a.size(0), K = a.size(1), N = dy.size(1), E = offs.size(0);
  TORCH_CHECK(K % 8 == 0 && N % 8 == 0, "grouped_mm_wgrad: the CUDA kernel needs K % 8 == 0 and N % 8 == 0 ",
              "(16-byte rows), got K = ", K, ", N = ", N);
  check_rows_unit_stride(a, "a", "grouped_mm_wgrad");
  check_rows_unit_stride(dy, "dy", "grouped_mm_wgrad");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({E, K, N}, a.options());
  if (K == 0 || N == 0 || E == 0) return out;
  if (M == 0) return out.zero_();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ws = expert_bounds(offs, M, stream);
  GemmParams p{out.data_ptr(), ws[0].data_ptr<int>(), nullptr, static_cast<int>(E), static_cast<int>(M),
               static_cast<int>(N), static_cast<int>(K), static_cast<int>(ceil_div(N, Tr::kBN)),
               static_cast<int>(ceil_div(K, Tr::kBM))};
  const CUtensorMap map_a = make_tensor_map_sw128<2>(a, {uint64_t(K), uint64_t(M)}, {uint64_t(a.stride(0))},
                                                     {64, 64}, "a");
  const CUtensorMap map_dy = make_tensor_map_sw128<2>(dy, {uint64_t(N), uint64_t(M)}, {uint64_t(dy.stride(0))},
                                                      {64, 64}, "dy");
  const CUtensorMap map_out = make_tensor_map_sw128<3>(out, {uint64_t(N), uint64_t(K), uint64_t(E)},
                                                       {uint64_t(N), uint64_t(K * N)}, {64, 64, 1}, "out");
  const int64_t tiles = E * p.k_row_tiles * p.n_tiles;
  KDA_DISPATCH_CUDA_HALF(a.scalar_type(), "grouped_mm_wgrad", [&] {
    launch_gemm<scalar_t, GemmMode::kWgrad>(p, map_a, map_dy, map_out, tiles, a.get_device(), stream);
  });
  return out;
}

}  // namespace kda_dsa_ops::moe
