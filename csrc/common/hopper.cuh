// Hopper (sm_90a) device primitives: mbarriers, TMA tile loads, wgmma and its shared-memory
// descriptors, register reallocation. Written against the PTX ISA; every wrapper is one
// instruction or a wait loop around one.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_SM90A_ENABLED 1
#endif

namespace kda_dsa_ops::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ---------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes initialised barriers visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One arrival (no transaction bytes) on a barrier of this CTA.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// An arrival that waits for this thread's earlier cp.async copies: the barrier's pending count is
// raised now and lowered when they land (the thread still arrives itself, after the call).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Waits until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = smem_addr(bar);
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  }
}

// ---- clusters ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA in the cluster: release this thread's prior writes, wait for all.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// Arrives on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster. No
// cluster-scope release: it signals that this thread's reads (wgmma operands, already waited
// for) are done, not that it wrote anything the other CTA must see.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// ---- TMA --------------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared
// memory, the mbarrier receiving the bytes as they land.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// The same box written to the same shared-memory offset of every CTA in cta_mask, each CTA's
// mbarrier at `bar`'s offset receiving the bytes it got.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                                      int c1, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                                      int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

// Starts bringing `bytes` (a multiple of 16, address 16-byte aligned) of global memory into L2.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

// Stores a box from shared memory to global memory (out-of-bounds parts are not written).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most the kPending most recent of this thread's committed store groups are still
// reading shared memory.
template <int kPending = 0>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Waits until this thread's committed stores are complete.
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (wgmma operands, TMA stores).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- register reallocation between warpgroups (needs a register cap at kernel entry) -----

template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
#ifdef KDA_SM90A_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
#ifdef KDA_SM90A_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
#endif
}

// ---- wgmma ------------------------------------------------------------------------------

// Byte offset of 16-byte piece q of row r in a 128B-swizzled box of 128-byte rows (the layout TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads through sw128_descriptor).
__device__ __forceinline__ int sw128_offset(int r, int q) { return r * 128 + ((q ^ (r % 8)) * 16); }

// Shared-memory matrix descriptor for a 128-byte-swizzled operand (tile base 1024-aligned).
//   K-major:  rows of 64 16-bit elements (128 B) along K; 8-row groups every 1024 B (SBO).
//   MN-major: rows of 64 elements along M/N, one row per k; 8-k groups every 1024 B (SBO);
//             64-wide M/N chunks every `lbo` bytes.
__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem_byte_addr, uint32_t lbo_bytes) {
  constexpr uint64_t kSbo = 1024;
  return static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo_bytes >> 4) << 16) |
         ((kSbo >> 4) << 32) | (1ull << 62);
}

// The descriptor of the same operand layout `bytes` further on (a multiple of 16; the tile stays
// below 256 KB): the start address is the descriptor's low field, so one 32-bit add to the low
// word (it cannot carry into the high one), not a new encoding.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef KDA_SM90A_ENABLED
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef KDA_SM90A_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#ifdef KDA_SM90A_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}

// Keeps the compiler from moving accumulator accesses across wgmma fences and waits.
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

#define KDA_ACC8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define KDA_ACC32(i) KDA_ACC8(i), KDA_ACC8(i + 8), KDA_ACC8(i + 16), KDA_ACC8(i + 24)
#define KDA_REGS_0_15 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define KDA_REGS_16_31 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KDA_REGS_0_63 \
  KDA_REGS_0_15 ", " KDA_REGS_16_31 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define KDA_REGS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// One wgmma.mma_async: the accumulators are operands %0.., then come the two descriptors (DESC),
// kTransA and kTransB (TRANS) and the scale-d flag (SCALE_D, 1: accumulate).
#define KDA_WGMMA(SHAPE, TYPE, REGS, DESC, TRANS, SCALE_D, ...)                                             \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " SCALE_D ", 0;\n"                                         \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" REGS "}, " DESC ", p, 1, 1, " TRANS \
               ";\n}\n"                                                                                        \
               : __VA_ARGS__                                                                                 \
               : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB), "r"(1))

// d[64 x N] += A[64 x 16] * B[16 x N], both operands in shared memory. kTransA/kTransB:
// 1 when the operand is M/N-major rather than K-major. Accumulator layout: thread t of the
// warpgroup holds rows 16*(t/32) + (t%32)/4 (+8) and, for each 8-column block j, columns
// 8j + 2*(t%4) (+1): d[4j], d[4j+1] on the first row, d[4j+2], d[4j+3] on the second.
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#ifdef KDA_SM90A_ENABLED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KDA_WGMMA("m64n256k16", "bf16", KDA_REGS_0_63 ", " KDA_REGS_64_127, "%128, %129", "%130, %131", "%132",
              KDA_ACC32(0), KDA_ACC32(32), KDA_ACC32(64), KDA_ACC32(96));
  } else {
    KDA_WGMMA("m64n256k16", "f16", KDA_REGS_0_63 ", " KDA_REGS_64_127, "%128, %129", "%130, %131", "%132",
              KDA_ACC32(0), KDA_ACC32(32), KDA_ACC32(64), KDA_ACC32(96));
  }
#endif
}

template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#ifdef KDA_SM90A_ENABLED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KDA_WGMMA("m64n128k16", "bf16", KDA_REGS_0_63, "%64, %65", "%66, %67", "%68", KDA_ACC32(0),
              KDA_ACC32(32));
  } else {
    KDA_WGMMA("m64n128k16", "f16", KDA_REGS_0_63, "%64, %65", "%66, %67", "%68", KDA_ACC32(0),
              KDA_ACC32(32));
  }
#endif
}

template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
#ifdef KDA_SM90A_ENABLED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KDA_WGMMA("m64n64k16", "bf16", KDA_REGS_0_15 ", " KDA_REGS_16_31, "%32, %33", "%34, %35", "%36", KDA_ACC32(0));
  } else {
    KDA_WGMMA("m64n64k16", "f16", KDA_REGS_0_15 ", " KDA_REGS_16_31, "%32, %33", "%34, %35", "%36", KDA_ACC32(0));
  }
#endif
}

template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
#ifdef KDA_SM90A_ENABLED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KDA_WGMMA("m64n32k16", "bf16", KDA_REGS_0_15, "%16, %17", "%18, %19", "%20", KDA_ACC8(0), KDA_ACC8(8));
  } else {
    KDA_WGMMA("m64n32k16", "f16", KDA_REGS_0_15, "%16, %17", "%18, %19", "%20", KDA_ACC8(0), KDA_ACC8(8));
  }
#endif
}

// d[64 x 256] += A[64 x 16] * B[16 x 256] with A from registers: a[0..3] hold the thread's bf16 / fp16
// pairs in the accumulator layout of its 16 columns (rows r, r + 8 at columns 2c, 2c + 1, then
// 8 + 2c, 9 + 2c: a[0] (r, 2c), a[1] (r + 8, 2c), a[2] (r, 8 + 2c), a[3] (r + 8, 8 + 2c)).
#define KDA_WGMMA_RS(TYPE)                                                                              \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %134, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {" KDA_REGS_0_63 ", "          \
               KDA_REGS_64_127 "}, {%128, %129, %130, %131}, %132, p, 1, 1, %133;\n}\n"                  \
               : KDA_ACC32(0), KDA_ACC32(32), KDA_ACC32(64), KDA_ACC32(96)                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB), "r"(1))
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
#ifdef KDA_SM90A_ENABLED
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    KDA_WGMMA_RS("bf16");
  } else {
    KDA_WGMMA_RS("f16");
  }
#endif
}
#undef KDA_WGMMA_RS

#undef KDA_WGMMA
#undef KDA_REGS_64_127
#undef KDA_REGS_0_63
#undef KDA_REGS_16_31
#undef KDA_REGS_0_15
#undef KDA_ACC32
#undef KDA_ACC8

}  // namespace kda_dsa_ops::sm90
