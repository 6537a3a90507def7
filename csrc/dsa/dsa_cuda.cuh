// The DSA CUDA kernels' shared parts: small device helpers, the key-tile loaders of the mma.sync
// kernels, the parameter structs of every kernel and the launchers each kernel's file defines.
// The kernels, a file each, all on bf16/fp16 operands with fp32 accumulation:
//   indexer_fwd_cuda.cu   LI forward (sm_90a: TMA, wgmma): four queries per block scored against
//                         the keys they see in tiles of 64, ReLU and the weighted sum over heads
//                         in registers; the scores go straight into per-query candidate buffers
//                         (the [T, Tk] matrix never exists), cut back to top-k by a radix select;
//                         then a row sort
//   indexer_bwd_cuda.cu   LI backward: one block per query over its selected keys, dq and dw in
//                         registers, dk added to an fp32 buffer
//   attn_fwd_cuda.cu      SFA forward (mma.sync): one block per (query, kv head, block of up to
//                         64 heads) over the selected keys in tiles of 64: online softmax, P V,
//                         the output gate in the epilogue, lse; with return_p a second pass sums
//                         the final probabilities over the heads
//   mla_fwd_cuda.cu       SFA forward for the MLA layout on sm_90a: a gathering producer
//                         warpgroup and two wgmma consumer warpgroups
//   gqa_fwd_cuda.cu       SFA forward at 8 or 16 heads a kv head, Dqk <= 128 (mma.sync): keys
//                         along the mma's rows (gqa_cuda.cuh); packed at 8 heads, producer
//                         warps gathering the block's union and a warp a query over its own
//                         slots; unpacked, four warps a (query, kv head), each over its own tiles,
//                         merged at the end
//   attn_bwd_cuda.cu      SFA backward: the forward's blocks, dq in registers, dkv added to an fp32
//                         buffer (atomically, or stored per (query, slot) and summed in index order)
//   gqa_bwd_cuda.cu       SFA backward of the packed blocks at 8 heads a kv head, Dqk <= 128
//                         (atomic dkv): the packed forward's walk, a warp a query for S, dP and
//                         dq, dkv dense over each tile's slots
//   mla_bwd_cuda.cu       SFA backward for the MLA layout on sm_90a: a gathering producer warpgroup
//                         and two wgmma consumer warpgroups, dkv by 16-byte atomics per 64 columns
//   pack_cuda.cu          packed queries at 8, 16 or 32 heads a kv head (QueryPack): a block's
//                         selections' union, counted (a word per key) or sorted in shared memory;
//                         the order the kernels take the packed blocks in (longest_first)
// The mma.sync kernels' warps are 16-row groups x 2 halves of the columns (keys or values).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <type_traits>

#include "common/device.cuh"
#include "common/hopper.cuh"
#include "common/mma.cuh"
#include "dsa/dsa.h"

namespace kda_dsa_ops::dsa {

using namespace kda_dsa_ops::mma;

constexpr float kLn2 = 0.6931471805599453f;

// (a fast reciprocal: the IEEE division's slow path cost the MLA forward's epilogue a fifth of its
// stall samples; 0 where 1 + e^-x passes 2^126)
__device__ __forceinline__ float sigmoidf(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
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
// while the current one is used. Src (per thread; threadIdx.x < kKeys <= blockDim.x: its slot):
// load(k0) reads the thread's slot of the tile of keys k0.. (every global load of a slot issued at
// once: one round trip a tile), put(b, slot) stores it in buffer b's per-slot data (shared arrays:
// no sync inside), selected() its SelectedRows.
template <typename T, int kStages, int kKeys, typename Src>
struct KeyTiles {
  T* buf;  // kStages tiles of kKeys x ld
  int ld, width, cols;
  int64_t total;  // keys
  Src src;
  __device__ T* tile(int b) const { return buf + b * kKeys * ld; }
  // Each 16-byte piece of buffer b: its slot's key from shared memory, one wide multiply-add and the
  // cp.async (zeros past width and for a slot without a key), no branch. (Through gather_rows, with
  // a row pointer tested for null, a piece took ~50 SASS instructions.)
  __device__ void fetch(int b) {
    const auto& rows = src.selected();
    const int chunks = cols / 8;
    T* dst = tile(b);
    for (int i = threadIdx.x; i < kKeys * chunks; i += blockDim.x) {
      const int r = i / chunks, c = i % chunks * 8, key = rows.idx[b * kKeys + r];
      const bool valid = key >= 0 && c < width;
      cp_async_16_zfill(dst + r * ld + c, rows.at(valid ? key : 0, c), valid);
    }
    cp_async_commit();
  }
  // Before the loop (every thread).
  __device__ void start() {
    if constexpr (kStages == 2) {
      src.put(0, src.load(0));
      __syncthreads();
      fetch(0);
    }
  }
  // Tile it (keys k0..) in shared memory: returns its buffer. Every thread calls it, and calls
  // __syncthreads() after its last use of the tile, before the next ready().
  __device__ int ready(int it, int64_t k0) {
    if constexpr (kStages == 1) {
      src.put(0, src.load(k0));
      __syncthreads();
      fetch(0);
      cp_async_wait<0>();
      __syncthreads();
      return 0;
    } else {
      const int cur = it & 1;
      const bool more = k0 + kKeys < total;
      if (more) src.put(cur ^ 1, src.load(k0 + kKeys));
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
  struct Slot {
    int key;
  };
  __device__ bool in(int64_t k0) const { return threadIdx.x < kKeys && k0 + threadIdx.x < topk; }
  __device__ Slot load(int64_t k0) const {
    const int k = in(k0) ? sel[k0 + threadIdx.x] : -1;
    return {k < Tk ? k : -1};
  }
  __device__ void put(int b, Slot s) const {
    if (threadIdx.x < kKeys) idx[b * kKeys + threadIdx.x] = s.key;
  }
  __device__ const SelectedRows& selected() const { return *this; }
  // Column c of key k's row (k >= 0; unsigned: one wide multiply-add).
  __device__ const T* at(int k, int c) const {
    return kv + kvh * D + c + uint64_t{static_cast<uint32_t>(k)} * static_cast<uint32_t>(Hkv * D);
  }
};

// Selected rows with a value a slot: vals[b][slot] = from[slot], 0 for a slot without a key (read
// beside the key: read after it, each tile waited for two global round trips).
template <typename T, int kKeys, typename V>
struct RowsWith {
  SelectedRows<T, kKeys> keys;
  V* vals;        // [stages][kKeys], shared
  const V* from;  // a value per slot of the selection
  struct Slot {
    typename SelectedRows<T, kKeys>::Slot key;
    V v;
  };
  __device__ Slot load(int64_t k0) const {
    const V v = keys.in(k0) ? from[k0 + threadIdx.x] : V{0};
    const auto k = keys.load(k0);
    return {k, k.key < 0 ? V{0} : v};
  }
  __device__ void put(int b, Slot s) const {
    keys.put(b, s.key);
    if (threadIdx.x < kKeys) vals[b * kKeys + threadIdx.x] = s.v;
  }
  __device__ const SelectedRows<T, kKeys>& selected() const { return keys; }
};

// A packed block's selected rows with the queries that have each slot's key: bit g of the slot's
// byte for the block's query g (from its member row, AttnArgs::member). The block's rows 8 o .. 8 o
// + 7 are one query's, query o >> AttnArgs::row_shift.
template <typename T, int kKeys>
using AttnRows = RowsWith<T, kKeys, uint8_t>;

constexpr int kIdxRows = 64;  // indexer heads (Hi <= 64, padded)
constexpr int kIdxKeys = 64;  // keys per tile
constexpr int kIdxDim = 128;  // Di <= 128
constexpr int kIdxLd = kIdxDim + 8;

// What every sparse-attention kernel reads: the inputs, the sizes, and t0, the first query of
// the launch (the deterministic backward runs the queries in chunks).
struct AttnArgs {
  const void* q;
  const void* kv;
  const int32_t* indices;
  const void* gate;  // nullptr: no gate
  int64_t T, H, Hkv, Tk;  // indices outside [0, Tk) count as -1
  int Dqk, dv, topk, G, head_blocks;
  float scale;
  int64_t t0;
  // Packed queries (QueryPack): `group` queries a block; bit g of member[t, kvh, slot] says that the
  // block's query g (rows query_rows g .. of the kv head's) chose the slot; nullptr: every row has
  // the slot's key (query_rows 64 for the Hopper MLA kernels). Rows from rows_total on (of q's
  // T x H) are a packed block's padding. lengths[t, kvh]: the union's length (its slots from there
  // on are -1; nullptr: topk).
  const uint8_t* member;
  const int32_t* lengths;
  int group, query_rows;
  int row_shift;  // the mma.sync kernels' rows 8 o .. are packed query o >> row_shift's
  int64_t rows_total;
  // The mma.sync kernels' split (QueryPack::split_limit): a packed block whose union is longer than
  // split_limit runs on the unpacked launch. Packed launch: split_lengths = lengths, split_group 1;
  // unpacked: the pack's lengths and group (nullptr: no split).
  const int32_t* split_lengths;
  int split_group, split_limit;
  // Packed blocks in the order taken (longest_first; the atomic backward and the forward):
  // nullptr: index order.
  const int32_t* order;
};
struct AttnFwdArgs : AttnArgs {
  void* o;
  float* lse;
  float* probs;  // nullptr: not asked for
};
struct AttnBwdArgs : AttnArgs {
  const void* grad_o;
  const void* o_in;
  const float* lse_in;
  void* dq;
  float* dkv;      // atomics into [Tk, Hkv, Dqk]; nullptr: contributions into contrib
  float* contrib;  // [(t - t0), Hkv, head_blocks, topk, Dqk]
  void* dgate;
  // The ordered deterministic path (Hopper MLA, unpacked; ticket nullptr: not taken). Blocks take
  // turns u = t head_blocks + head block from *ticket in the order they start, each query's keys
  // ascending (indices sorted). Turn u adds to the dkv of its class u % classes (class 0: dkv, the
  // others their copy in dkv_more). It adds a tile's terms once turn u - classes has
  // passed the tile's last key (progress[u - classes] above it), and publishes in progress[u]
  // the key below which its adds and those of the earlier turns of its class are done.
  unsigned* ticket;
  int* progress;    // [T head_blocks]
  float* dkv_more;  // [classes - 1, Tk, Dqk]
  int classes;
};

// One block's share of the attention: (query or packed block) t, kv head kvh, its rows head0.. of
// the kv head's G (rows of them valid), the selected keys sel of (t, kvh), length of them used; the
// thread's place: warp, lane, accumulator row g and column pair c of its fragments, row group wr,
// column half wc, rows r0 and r0 + 8; kd the head dim rounded up to 16, sl2 the scale in log2 units.
struct AttnBlock {
  int64_t t;
  int kvh, head0, rows, length, warp, lane, g, c, wr, wc, r0, kd;
  float sl2;
  const int32_t* sel;
};

// q's row (of T x H) that the block's row r holds, -1 for none: unpacked query t's head kvh G +
// head0 + r; packed query t group + r / heads's head kvh heads + r % heads, with heads = G / group
// the call's query heads a kv head (rows_total or more: padding).
template <bool kPacked>
__device__ __forceinline__ int64_t attn_q_row(const AttnArgs& a, const AttnBlock& b, int r) {
  if (r >= b.rows) return -1;
  if constexpr (!kPacked) {
    return b.t * a.H + int64_t{b.kvh} * a.G + b.head0 + r;
  } else {
    const int heads = a.G / a.group, stride = static_cast<int>(a.H) / a.group;
    const int64_t row = (b.t * a.group + r / heads) * stride + int64_t{b.kvh} * heads + r % heads;
    return row < a.rows_total ? row : -1;
  }
}

// Whether the packed launch (lengths) or the unpacked one (split_lengths) leaves query or block t
// on kv head kvh to the other (AttnArgs::split_limit).
__device__ __forceinline__ bool attn_skips(const AttnArgs& a, int64_t t, int kvh) {
  if (a.split_lengths == nullptr) return false;
  const bool packed = a.split_lengths[t / a.split_group * a.Hkv + kvh] <= a.split_limit;
  return packed != (a.split_group == 1);
}

// A block's query (or packed block) t and kv head: blockIdx's, or on a packed launch with an order
// (AttnArgs::order, one head block) the item t Hkv + kvh it names in launch order.
struct AttnItem {
  int64_t t;
  int kvh;
};
template <bool kPacked>
__device__ __forceinline__ AttnItem attn_item(const AttnArgs& a) {
  if constexpr (kPacked) {
    if (a.order != nullptr) {
      const int64_t item = a.order[blockIdx.y * int64_t{gridDim.x} + blockIdx.x];
      return {item / a.Hkv, static_cast<int>(item % a.Hkv)};
    }
  }
  return {a.t0 + blockIdx.x, static_cast<int>(blockIdx.y)};
}

// The block's place, and its query rows sent to shared memory (cp.async, committed with the first
// key tile).
template <typename T, int kRows, int kCols, bool kPacked>
__device__ AttnBlock attn_block(const AttnArgs& a, AttnItem item, T* sQ, int ld) {
  AttnBlock b;
  b.t = item.t;
  b.kvh = item.kvh;
  b.head0 = blockIdx.z * kRows;
  b.rows = min(kRows, a.G - b.head0);
  b.length = kPacked ? a.lengths[b.t * a.Hkv + b.kvh] : a.topk;
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
    const int64_t row = attn_q_row<kPacked>(a, b, r);
    return row >= 0 ? q + row * a.Dqk : static_cast<const T*>(nullptr);
  });
  return b;
}

// The block's key tiles: its selection's first `length` slots, the slots' keys in idx and, packed,
// their queries in has ([kStages][kKeys] each, shared).
template <typename T, int kStages, int kKeys, bool kPacked>
using AttnTiles =
    KeyTiles<T, kStages, kKeys, std::conditional_t<kPacked, AttnRows<T, kKeys>, SelectedRows<T, kKeys>>>;

template <typename T, int kStages, int kKeys, int kCols, bool kPacked>
__device__ AttnTiles<T, kStages, kKeys, kPacked> attn_tiles(const AttnArgs& a, const AttnBlock& b, T* sK, int ld,
                                                            int* idx, uint8_t* has) {
  const SelectedRows<T, kKeys> keys{idx, b.sel, a.topk, a.Tk, a.Hkv, b.kvh, a.Dqk, static_cast<const T*>(a.kv)};
  if constexpr (kPacked) {
    return {sK, ld, a.Dqk, kCols, b.length, AttnRows<T, kKeys>{keys, has, a.member + (b.t * a.Hkv + b.kvh) * a.topk}};
  } else {
    return {sK, ld, a.Dqk, kCols, b.length, keys};
  }
}

// Whether the thread's row r0 + 8 h has slot s of the tile whose keys are idx (and, packed, whose
// queries are has).
template <bool kPacked>
__device__ __forceinline__ bool attn_has(const AttnArgs& a, const int* idx, const uint8_t* has, int s, int wr, int h) {
  if constexpr (kPacked) {
    return has[s] >> ((2 * wr + h) >> a.row_shift) & 1;
  } else {
    return idx[s] >= 0;
  }
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
  static_assert(kKeys <= kThreads, "KeyTiles reads a tile's slots a thread each");
  static constexpr int kLd = kDqk + 8;
  static constexpr int kLdP = kKeys + 8;
  // Q, the key tiles and their slots' keys and queries (16-bit operands).
  static constexpr size_t tile_bytes(int stages) {
    return (kRows + stages * kKeys) * kLd * 2 + stages * kKeys * (sizeof(int) + 1);
  }
  static constexpr int stages_for(size_t extra) { return tile_bytes(2) + extra <= kMaxSmem ? 2 : 1; }
};

// f(Dqk, dv, rows, packed) as integral constants for the problem's mma.sync kernel instance: head
// dims padded to 128, to 512 / 512 (GLM-5.3's NoPE MLA) or to 576 / 512 (MLA), 16 or 64 heads per
// block (packed: 64).
template <typename F>
void with_attn_instance(const AttnProblem& p, bool packed, F&& f) {
  using I128 = std::integral_constant<int, 128>;
  using I576 = std::integral_constant<int, 576>;
  using I512 = std::integral_constant<int, 512>;
  using R16 = std::integral_constant<int, 16>;
  using R64 = std::integral_constant<int, 64>;
  const auto rows = [&](auto dqk, auto dv) {
    if (packed) {
      f(dqk, dv, R64{}, std::true_type{});
    } else if (p.H / p.Hkv > 16) {
      f(dqk, dv, R64{}, std::false_type{});
    } else {
      f(dqk, dv, R16{}, std::false_type{});
    }
  };
  if (p.Dqk > 512) {
    rows(I576{}, I512{});
  } else if (p.Dqk > 128) {
    rows(I512{}, I512{});
  } else {
    rows(I128{}, I128{});
  }
}

// Queries packed into 64-row blocks. With G = 8, 16 or 32 query heads on a kv head a block of one
// query would leave most of the Hopper MLA kernels' wgmma tiles' rows empty, and every kernel would
// gather its keys and add its dkv terms one query at a time; packed, group = 64 / G consecutive
// queries share a block on each kv head (fewer where group x topk would pass 16,384 entries). The
// block's selection is the union of its queries' (a key that several of them chose once, a key one
// query chose n times n times), member[block, kvh, slot] has bit g set where query g chose the slot,
// and each query's rows attend over its own slots only. The kernels see problem: ceil(T / group)
// queries of group x H heads (a kv head's rows g G .. hold query t group + g's heads on it: for one
// kv head q, o, lse, gate and dq are the same memory, query t's rows block t / group's rows
// (t % group) H ..) over selections of group x topk slots, of which block t uses lengths[t, kvh]
// (no host sync sizes them). Unpacked (group 1), problem is the call's and indices its own.
// On the mma.sync kernels a block of 16 rows does one query's work at about half the cost of a
// block of 64: at 8 and 16 heads a packed block whose union keeps more than a share `split` of its
// slots (split_limit) is left to a second, unpacked launch over its queries (rest()), so that the
// queries that share few keys cost what they did unpacked (at Dqk <= 128 the forward's two launches
// run on gqa_fwd_cuda.cu's kernels, the packed one at 8 heads only).
struct QueryPack {
  AttnProblem problem;
  int64_t group = 1;  // queries per block
  int query_rows = 64;
  int64_t rows_total = 0;  // T x H of the call
  at::Tensor indices;  // [problem.T, Hkv, group x topk] int32, -1 padded
  at::Tensor member;   // [problem.T, Hkv, group x topk] uint8 (undefined unpacked)
  at::Tensor lengths;  // [problem.T, Hkv] int32 (undefined unpacked)
  at::Tensor slot_of;  // [T, Hkv, topk] int64: each (query, slot)'s place in its block's union, -1 without a
                       // key (asked for with the probabilities: they come back in the call's slots)
  // The split (AttnArgs::split_lengths): the pack's lengths (undefined: none), the queries a block
  // of them, the longest union a packed block keeps; the call's problem and indices.
  at::Tensor split_lengths;
  int64_t split_group = 1, split_limit = 0;
  AttnProblem call{};
  at::Tensor call_indices;
  // The unpacked launch of a split pack: the call's queries whose packed block is longer than
  // split_limit.
  QueryPack rest() const {
    QueryPack r;
    r.problem = call;
    r.rows_total = rows_total;
    r.indices = call_indices;
    r.split_lengths = split_lengths;
    r.split_group = group;
    r.split_limit = split_limit;
    return r;
  }
};
// f(pack) for each launch of the mma.sync kernels: the pack's, then, split, its rest().
template <typename F>
void each_launch(const QueryPack& pk, F&& f) {
  f(pk);
  if (pk.split_lengths.defined()) f(pk.rest());
}
// The pack for a call (pack_cuda.cu): packed with G in {8, 16, 32} and T > 1, on the Hopper MLA path
// or, without the probabilities, on the mma.sync kernels (split at 8 and 16 heads where split > 0).
QueryPack pack_queries(const AttnProblem& p, const at::Tensor& q, const at::Tensor& indices, bool slots,
                       double split);

// The shared fields of the attention kernels' arguments, for blocks of `rows` heads.
inline AttnArgs attn_args(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                          int rows) {
  const AttnProblem& p = pk.problem;
  AttnArgs a{};
  a.q = q.data_ptr();
  a.kv = kv.data_ptr();
  a.indices = pk.indices.data_ptr<int32_t>();
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
  a.member = pk.member.defined() ? pk.member.data_ptr<uint8_t>() : nullptr;
  a.lengths = pk.lengths.defined() ? pk.lengths.data_ptr<int32_t>() : nullptr;
  a.group = static_cast<int>(pk.group);
  a.query_rows = pk.query_rows;
  while (8 << a.row_shift < pk.query_rows) ++a.row_shift;
  a.rows_total = pk.rows_total;
  a.split_lengths = pk.split_lengths.defined() ? pk.split_lengths.data_ptr<int32_t>() : nullptr;
  a.split_group = static_cast<int>(pk.split_group);
  a.split_limit = static_cast<int>(pk.split_limit);
  return a;
}

// The Hopper MLA kernels' shared steps (mla_fwd_cuda.cu, mla_bwd_cuda.cu: two consumer warpgroups,
// then the producer one). load_rows64: rows [0, rows) of kWidth columns from src (zeros for the
// rest of the 64) into 128B-swizzled chunks of 64 rows, by cp.async from the consumer threads,
// committed. KeyTile: a producer thread's share of a tile of the gathered keys k0.. of block t's
// selection in 128B-swizzled chunks of kKeys rows: eight threads copy a row's 128-byte pieces (rows
// g, g + 16, .. for the threads 8g .. 8g + 7), so that each request covers whole cache lines, zeros
// for a slot without a key; and the tile's slots' row words (the stage's kKeys words): bit g where
// the block's query g has the slot's key (AttnArgs::member; 1 unpacked; 0 without a key), stored
// by atomics (compute-sanitizer's racecheck does not see the ring's barriers order a plain store
// before the consumers' loads). produce_key_tile: use i of the ring, the rows, then the first
// kSplit chunks arrive on part 0 of the use's barriers, the rest on part 1.
template <typename T, int kWidth>
__device__ __forceinline__ void load_rows64(uint8_t* dst, const T* src, int rows) {
  constexpr int kPieces = kWidth / 8;  // 16-byte pieces per row
  for (int i = threadIdx.x; i < 64 * kPieces; i += 256) {
    const int r = i / kPieces, p = i % kPieces;
    cp_async_16_or_zero(dst + (p / 8) * (64 * 128) + sm90::sw128_offset(r, p % 8),
                        r < rows ? src + r * kWidth + p * 8 : nullptr);
  }
  cp_async_commit();
}

// The block's tiles of kKeys slots.
template <int kKeys>
__device__ __forceinline__ int mla_block_tiles(const AttnArgs& a, int64_t t) {
  return static_cast<int>(ceil_div(a.lengths != nullptr ? a.lengths[t] : a.topk, kKeys));
}

// A Hopper MLA consumer thread's place: the block's query t (or packed queries), heads head0.. (rows
// of them), its tile count; the thread's warp and lane in its warpgroup, fragment row g and column
// pair c, accumulator rows r0 and r0 + 8 and their queries' bits in a slot's row word (bit[h] for
// row r0 + 8 h).
struct MlaPlace {
  int64_t t;
  int head0, rows, tiles, warp, lane, g, c, r0, bit[2];
};

__device__ __forceinline__ MlaPlace mla_place(const AttnArgs& a, int64_t t, int head0, int rows, int tiles) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, r0 = 16 * warp + lane / 4;
  return {t, head0, rows, tiles, warp, lane, lane / 4, lane % 4, r0, {r0 / a.query_rows, (r0 + 8) / a.query_rows}};
}

// The rows of block t's head block from head0 that hold a query head: up to 64, fewer past the kv
// head's G heads or, packed, past q's rows.
__device__ __forceinline__ int mla_block_rows(const AttnArgs& a, int64_t t, int head0) {
  return static_cast<int>(min(int64_t{min(64, a.G - head0)}, a.rows_total - (t * a.H + head0)));
}

template <typename T, int kKeys, int kDqk, int kGroups = 16>
struct KeyTile {
  static constexpr int kPer = kKeys / kGroups, kChunkBytes = kKeys * 128;
  int key[kPer];  // this thread's keys, rows g + kGroups m of the tile (-1: none)

  __device__ static int piece() { return threadIdx.x % 8; }
  __device__ static int g() { return (threadIdx.x - 256) / 8; }
  __device__ __forceinline__ KeyTile(const AttnArgs& a, int64_t t, int64_t k0) {
    const int32_t* sel = a.indices + t * a.topk;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int64_t j = k0 + g() + kGroups * m;
      const int k = j < a.topk ? sel[j] : -1;
      key[m] = k >= 0 && k < a.Tk ? k : -1;
    }
  }
  // The slots' row words into the stage's kKeys words.
  __device__ __forceinline__ void store_rows(const AttnArgs& a, int64_t t, int64_t k0, uint32_t* rows) const {
    if (piece() != 0) return;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int64_t j = k0 + g() + kGroups * m;
      atomicExch(rows + g() + kGroups * m, key[m] < 0 ? 0u : a.member != nullptr ? a.member[t * a.topk + j] : 1u);
    }
  }
  // The 64-column chunks [kFrom, kTo) of the thread's rows, without a branch (kv's first row, zero
  // bytes of it, for a slot without a key).
  template <int kFrom, int kTo>
  __device__ __forceinline__ void copy(uint8_t* tile, const AttnArgs& a) const {
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const T* src = static_cast<const T*>(a.kv) + int64_t{max(key[m], 0)} * kDqk + piece() * 8;
#pragma unroll
      for (int ch = kFrom; ch < kTo; ++ch) {
        cp_async_16_zfill(tile + ch * kChunkBytes + sm90::sw128_offset(g() + kGroups * m, piece()), src + ch * 64,
                          key[m] >= 0);
      }
    }
  }
};

template <typename T, int kKeys, int kDqk, int kSplit, int kGroups, typename Ring>
__device__ __forceinline__ void produce_key_tile(Ring& ring, int i, uint8_t* tile, const AttnArgs& a,
                                                 int64_t t, int64_t k0, uint32_t* rows) {
  using namespace sm90;
  ring.wait_empty(i);
  const KeyTile<T, kKeys, kDqk, kGroups> keys(a, t, k0);
  keys.store_rows(a, t, k0, rows);
  keys.template copy<0, kSplit>(tile, a);
  cp_async_commit();
  keys.template copy<kSplit, kDqk / 64>(tile, a);
  cp_async_commit();
  cp_async_wait<1>();
  fence_proxy_async();  // the rows (and zeros) are read by wgmma
  mbar_arrive(ring.full_bar(i, 0));
  cp_async_wait<0>();
  fence_proxy_async();
  mbar_arrive(ring.full_bar(i, 1));
}

// The launchers, one per kernel file. Inputs as dsa.h's CUDA entry points pass them (bf16 /
// fp16, contiguous, 16-byte aligned rows; w, grad_scores and lse fp32).
void indexer_fwd_cuda(const IndexerProblem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& w,
                      at::Tensor& indices, at::Tensor& scores);
void indexer_bwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, const at::Tensor& indices,
                      const at::Tensor& grad_scores, at::Tensor& dq, at::Tensor& dk, at::Tensor& dw);
void attn_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                   at::Tensor& o, at::Tensor& lse, at::Tensor& probs);
// 8 or 16 query heads a kv head with Dqk <= 128 (gqa_fwd_cuda.cu), for a launch of `group` queries
// a block.
bool gqa_fwd_takes(const AttnProblem& p, int64_t group = 1);
void gqa_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                  at::Tensor& o, at::Tensor& lse, at::Tensor& probs);
// The atomic backward's packed launch at 8 heads a kv head (8 queries a block), Dqk <= 128: a warp a
// query over its own slots (gqa_bwd_cuda.cu), over `blocks` packed blocks.
template <typename T>
void gqa_packed_bwd_launch(const AttnBwdArgs& a, int64_t blocks);
// The MLA layout (Dqk 576, dv 512, one kv head) on sm_90a, unless the portable_sfa switch is on.
bool mla_fwd_takes(const AttnProblem& p, const at::Tensor& q);
void mla_fwd_cuda(const QueryPack& pk, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& gate,
                  at::Tensor& o, at::Tensor& lse, at::Tensor& probs);
// The order of the packed blocks whose union lengths are `lengths` (int32, on the GPU) that the
// kernels take them in (AttnArgs::order; pack_cuda.cu): longest first (index order among equals),
// each round of `round` blocks after the first in the direction opposite to the last.
at::Tensor longest_first(const at::Tensor& lengths, int64_t round);
// A packed launch's order (kept alive by the tensor returned) in a.order: packed blocks' unions
// differ in length (with causal sets they grow with t), and taken longest first the last wave's
// blocks are the shortest; `round`: the Hopper forward's persistent blocks, one round elsewhere.
// Unpacked (no lengths), or past kOrderItems blocks (longest_first ranks each against all:
// quadratic), none.
constexpr int64_t kOrderItems = int64_t{1} << 16;
inline at::Tensor with_order(const QueryPack& pk, AttnArgs& a, int64_t round = kOrderItems) {
  if (!pk.lengths.defined() || pk.lengths.numel() > kOrderItems || a.head_blocks != 1 || a.t0 != 0) return {};
  at::Tensor order = longest_first(pk.lengths, round);
  a.order = order.data_ptr<int32_t>();
  return order;
}
// The MLA layouts with more than 16 heads per kv head (packed queries included) on sm_90a (unless
// portable_sfa is on); the launch over `queries` queries from a.t0.
bool mla_bwd_takes(const AttnProblem& p, const at::Tensor& q);
template <typename T>
void mla_bwd_launch(const AttnBwdArgs& a, int64_t queries);
void attn_bwd_cuda(const QueryPack& pk, const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& o, const at::Tensor& lse, const at::Tensor& gate, bool deterministic,
                   at::Tensor& dq, at::Tensor& dkv, at::Tensor& dgate);

}  // namespace kda_dsa_ops::dsa
