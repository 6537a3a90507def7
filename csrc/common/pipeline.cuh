// The warp-specialised skeleton of the Hopper kernels (the indexer forward, the MLA attention
// forward, the grouped GEMM): one producer warpgroup fills a ring of shared-memory stages that the
// consumer warpgroups compute on, the registers moved from the producer to the consumers by
// setmaxnreg, the stages 1024-byte aligned for the 128B swizzle.
//   WarpSpecialized   the block's shape and register split, checked against the register pool
//   StageRing         per stage kParts "full" mbarriers (the producer's arrivals or TMA's bytes;
//                     several parts let consumers start on a stage's first part) and one "empty"
//                     mbarrier (the consumers' releases); the i-th use of the ring is stage
//                     i % kStages with parity (i / kStages) & 1, or a Cursor walks the same order
//   aligned_smem      dynamic shared memory from its first 1024-byte boundary
#pragma once

#include "common/hopper.cuh"

namespace kda_dsa_ops::sm90 {

constexpr int kSwizzleAlign = 1024;  // 128B-swizzle atoms repeat every 1 KB

// Dynamic shared memory from its first kSwizzleAlign boundary (launch with kSwizzleAlign extra bytes).
__device__ __forceinline__ uint8_t* aligned_smem(uint8_t* raw) {
  return raw + ((kSwizzleAlign - (smem_addr(raw) & (kSwizzleAlign - 1))) & (kSwizzleAlign - 1));
}

// kConsumers consumer warpgroups (threads 0 .. 128 kConsumers - 1) and the producer warpgroup
// after them. setmaxnreg.inc waits for registers the block's pool does not have: the pool is
// what every thread gets at launch, 64K / threads rounded down to a multiple of 8 (168 at 384).
template <int kConsumers_, int kProducerRegs_, int kConsumerRegs_>
struct WarpSpecialized {
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kProducerRegs = kProducerRegs_, kConsumerRegs = kConsumerRegs_;
  static constexpr int kPoolRegs = 65536 / kThreads / 8 * 8 < 255 ? 65536 / kThreads / 8 * 8 : 255;
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <= (kConsumers + 1) * kPoolRegs,
                "setmaxnreg would ask for more registers than the block has");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");

  __device__ static int warpgroup() { return static_cast<int>(threadIdx.x / 128); }
  __device__ static bool is_producer() { return warpgroup() == kConsumers; }
  // Each warpgroup calls its side once, before its work.
  __device__ static void producer_registers() { warpgroup_reg_dealloc<kProducerRegs>(); }
  __device__ static void consumer_registers() { warpgroup_reg_alloc<kConsumerRegs>(); }
};

template <int kStages, int kParts = 1>
struct StageRing {
  uint64_t full[kStages][kParts];
  uint64_t empty[kStages];

  // The position of a walk over the ring's uses in order.
  struct Cursor {
    int stage = 0;
    uint32_t phase = 0;
    __device__ void advance() {
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  };

  __device__ static int stage(int i) { return i % kStages; }
  __device__ static uint32_t parity(int i) { return static_cast<uint32_t>(i / kStages) & 1; }

  // One thread, before the block (or cluster) synchronises: full barriers expect full_count
  // arrivals, empty ones empty_count.
  __device__ void init(uint32_t full_count, uint32_t empty_count) {
    for (int s = 0; s < kStages; ++s) {
      for (int p = 0; p < kParts; ++p) mbar_init(&full[s][p], full_count);
      mbar_init(empty + s, empty_count);
    }
    mbar_init_fence();
  }
  __device__ uint64_t* full_bar(int i, int part = 0) { return &full[stage(i)][part]; }
  // The producer: use i's stage is free again (its previous round was released).
  __device__ void wait_empty(int i) { mbar_wait(empty + stage(i), parity(i) ^ 1); }
  __device__ void wait_empty(const Cursor& at) { mbar_wait(empty + at.stage, at.phase ^ 1); }
  // A consumer: part `part` of use i's stage has arrived.
  __device__ void wait_full(int i, int part = 0) { mbar_wait(&full[stage(i)][part], parity(i)); }
  __device__ void wait_full(const Cursor& at) { mbar_wait(&full[at.stage][0], at.phase); }
  // A consumer (one arrival per counted thread or warp): use i's stage may be refilled.
  __device__ void release(int i) { mbar_arrive(empty + stage(i)); }
};

}  // namespace kda_dsa_ops::sm90
