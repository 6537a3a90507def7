// What the GQA kernels at 8 heads a kv head (Dqk, dv <= 128; gqa_fwd_cuda.cu, gqa_bwd_cuda.cu) share:
// the keys along the mma's rows, each lane's ldmatrix row address saying which key a step's row
// holds, the kv rows' gathers, and the packed kernels' ring and producer warps.
#pragma once

#include "dsa/dsa_cuda.cuh"

namespace kda_dsa_ops::dsa::gqa {

constexpr int kDim = 128;  // Dqk and dv, padded
constexpr int kLd = kDim + 8;

// The 8 x 8 16-bit matrix whose fragment (row lane / 4, cols 2 (lane % 4) ..) is x, transposed.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// A step's rows as this lane addresses them: key lane % 16 for S^T's ldmatrix (its columns 8 (lane /
// 16) ..), key lane % 8 + 8 (lane / 16) for V^T's ldmatrix.trans (its columns 8 (lane / 8 % 2) ..).
template <typename T>
struct StepRows {
  const T* k;
  const T* v;
};
__device__ __forceinline__ int k_row_of_lane() { return threadIdx.x % 16; }
__device__ __forceinline__ int v_row_of_lane() { return threadIdx.x % 8 + threadIdx.x % 32 / 16 * 8; }
template <typename T>
__device__ __forceinline__ StepRows<T> step_rows(const T* k_row, const T* v_row) {
  const int lane = threadIdx.x % 32;
  return {k_row + lane / 16 * 8, v_row + lane / 8 % 2 * 8};
}

// A lane's 16-byte piece (lane % 16) of the kv rows of one kv head, from an address and a key
// stride fixed for the kernel: a row's copy costs a select, one wide multiply-add and the cp.async
// (zeros past Dqk and for a slot without a key). With the address computed a row, the copies took ~20
// SASS instructions each.
template <typename T>
struct KvPieces {
  const char* base;  // the piece in key 0's row
  uint32_t stride;   // bytes from one key's row to the next
  bool in;           // the piece lies within Dqk

  __device__ __forceinline__ KvPieces(const AttnArgs& a, int kvh) {
    const int piece = threadIdx.x % 16;
    in = piece * 8 < a.Dqk;
    base = reinterpret_cast<const char*>(static_cast<const T*>(a.kv) + int64_t{kvh} * a.Dqk + (in ? piece * 8 : 0));
    stride = static_cast<uint32_t>(a.Hkv * a.Dqk * sizeof(T));
  }
  // Key k's piece (k < 0: zeros) into the shared row dst.
  __device__ __forceinline__ void copy(T* dst, int k) const {
    const bool valid = in && k >= 0;
    const uint32_t key = valid ? static_cast<uint32_t>(k) : 0u;  // (unsigned: one IMAD.WIDE.U32)
    cp_async_16_zfill(dst + threadIdx.x % 16 * 8, base + uint64_t{key} * stride, valid);
  }
};

// The packed kernels' shape: kQueries consumer warps (one a query), then kProducers producer warps;
// a ring of kStages tiles of kU slots, and 8 rows of zeros after it (one a bank group, a step's
// gaps); a warp's waiting rows in 8 queues by bank group (row index % 8), each of up to the rows of
// two tiles' slots in that group.
template <int kU_, int kStages_, int kProducers_>
struct PackedRing {
  static constexpr int kQueries = 8;
  static constexpr int kProducers = kProducers_;  // warps, each gathering its share of every tile
  static constexpr int kThreads = (kQueries + kProducers) * 32;
  static constexpr int kU = kU_;            // slots of a tile
  static constexpr int kStages = kStages_;  // tiles in the ring
  static constexpr int kQueue = 2 * kU / 8;
  static constexpr int kList = 8 * kQueue;
  static constexpr int kZeroRow = kStages * kU;
  static constexpr size_t kRing = size_t{kStages * kU + 8} * kLd * 2;
  static constexpr size_t kLists = size_t{kQueries} * kList * 2;
};

// A consumer warp's queues (the packed kernels'): queue r (lanes r, r + 8, .. keep its head and
// tail) holds the chosen rows of the ring whose index % 8 is r, in arrival order, up to kQueue of
// them. queue_tile: the rows of the tile in stage s (kU slots; words: their member bits) that have
// bit `query`, after the queue's tail.
template <int kU, int kQueue>
__device__ __forceinline__ void queue_tile(uint16_t* queue, int& tail, const uint32_t* words, int s, int query) {
  const int lane = threadIdx.x % 32, r = lane % 8;
#pragma unroll
  for (int h = 0; h < kU / 32; ++h) {
    const int slot = 32 * h + lane;  // (its row's group: r)
    const bool has = words[s * kU + slot] >> query & 1;
    const uint32_t mine = __ballot_sync(~0u, has) & 0x01010101u << r;
    if (has) queue[(tail + __popc(mine & ((1u << lane) - 1))) % kQueue] = s * kU + slot;
    tail += __popc(mine);
  }
}
// A step of kM x 16 rows takes up to 2 kM of each queue, step row 8 j + r the queue's j-th: its
// mask has bit 8 j + r where queue r had a j-th row (`waiting` of them).
template <int kM>
__device__ __forceinline__ uint32_t step_mask(int waiting) {
  uint32_t mask = 0;
#pragma unroll
  for (int j = 0; j < 2 * kM; ++j) mask |= (__ballot_sync(~0u, waiting > j) & 0xffu) << (8 * j);
  return mask;
}

// A packed block's ring before the roles part (every thread): its 8 rows of zeros from row kZeroRow
// (one a bank group, a step's gaps) and the barriers of its kStages stages (full: the kProducers
// producer warps' lanes; empty: `consumers` warps).
template <int kZeroRow, int kStages, int kProducers, typename T>
__device__ __forceinline__ void start_ring(T* ring, uint64_t* full, uint64_t* empty, int consumers) {
  for (int i = threadIdx.x; i < 8 * kLd / 8; i += blockDim.x) {
    reinterpret_cast<uint4*>(ring + kZeroRow * kLd)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(&full[s], 32 * kProducers);
      sm90::mbar_init(&empty[s], consumers);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();
}

// A packed block's producer warp `producer` of kProducers (the packed forward's and backward's):
// its share of each tile i of the block's union (slots base .. base + length of AttnArgs' indices and
// member, kv head kvh) into stage i % kStages of the ring (kU rows a stage) once the tile before it
// there is released (empty), then arrives on full: lanes 16 h .. 16 h + 15 copy row first + 2 r + h's
// 16-byte pieces (zeros past Dqk and for a slot without a key), lane l the member bits (and, kKeys,
// the key into keys, -1 for none) of slots first + l, first + l + 32, ..
template <int kU, int kStages, int kProducers, bool kKeys, typename T>
__device__ __forceinline__ void produce_union(const AttnArgs& a, int kvh, int64_t base, int length, int producer,
                                              T* ring, uint32_t* words, int32_t* keys, uint64_t* full,
                                              uint64_t* empty) {
  constexpr int kH = kU / 32 / kProducers;  // 32-slot pieces a producer
  const int lane = threadIdx.x % 32, tiles = (length + kU - 1) / kU;
  const int first = producer * kH * 32;  // its first slot of a tile
  const KvPieces<T> pieces(a, kvh);
  int key[kH];
  uint32_t chose[kH];
  // Its share of tile i's keys and member bits (slot first + 32 h + lane: -1 and 0 without a key).
  const auto load_slots = [&](int i) {
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      const int slot = i * kU + first + 32 * h + lane;
      const int k = slot < length ? a.indices[base + slot] : -1;
      key[h] = k >= 0 && k < a.Tk ? k : -1;
      chose[h] = slot < length ? a.member[base + slot] : 0u;
    }
  };
  load_slots(0);
  for (int i = 0; i < tiles; ++i) {
    const int s = i % kStages;
    sm90::mbar_wait(&empty[s], (i / kStages & 1) ^ 1);
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      atomicExch(words + s * kU + first + 32 * h + lane, key[h] >= 0 ? chose[h] : 0u);
      if constexpr (kKeys) atomicExch(keys + s * kU + first + 32 * h + lane, key[h]);
    }
    T* dst = ring + (s * kU + first) * kLd;
#pragma unroll
    for (int r = 0; r < kH * 16; ++r) {
      const int row = 2 * r + lane / 16;
      pieces.copy(dst + row * kLd, __shfl_sync(~0u, key[r / 16], row % 32));  // (row / 32 = r / 16)
    }
    sm90::mbar_arrive_cp_async(&full[s]);
    sm90::mbar_arrive(&full[s]);
    if (i + 1 < tiles) load_slots(i + 1);
  }
}

}  // namespace kda_dsa_ops::dsa::gqa
