// What the memory system gives the sparse kernels' two scattered patterns (H200 figures in
// docs/dsa.md): rows of 256 or 1152 bytes at random into shared memory by cp.async (a warp a ring of
// stages, as the GQA forward gathers), and 512-byte fp32 rows added at random (a warp a row, by
// red.global.add.v4.f32 or by scalar atomicAdd), as a (query, key) pair's dkv would be.
//   nvcc -O3 -arch=sm_90a -std=c++17 tools/l2_rows_probe.cu -o /tmp/l2_rows_probe && /tmp/l2_rows_probe
// The second gather line's blocks take 128 KB of shared memory: one block (4 warps) an SM.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include <cstdint>
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned sa = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g));
}
template <int ROW, int R, int S>
__global__ void gather(const uint8_t* tab, const int* idx, int iters, int* sink) {
  extern __shared__ uint8_t sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint8_t* ring = sm + warp * S * R * ROW;
  const int gw = blockIdx.x * (blockDim.x / 32) + warp;
  const int* my = idx + (size_t)gw * iters * R;
  constexpr int P = ROW / 16;
  for (int it = 0; it < iters; ++it) {
    uint8_t* st = ring + (it % S) * R * ROW;
    for (int i = lane; i < R * P; i += 32) {
      int r = i / P, p = i % P;
      cp16(st + r * ROW + p * 16, tab + (size_t)my[it * R + r] * ROW + p * 16);
    }
    asm volatile("cp.async.commit_group;\n");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 1));
  }
  asm volatile("cp.async.wait_group 0;\n");
  __syncwarp();
  if (ring[lane] == 123 && lane == 99) *sink = 1;
}
template <bool V4>
__global__ void atom(float* tab, const int* idx, int iters, int R) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = blockIdx.x * (blockDim.x / 32) + warp;
  const int* my = idx + (size_t)gw * iters * R;
  for (int it = 0; it < iters * R; ++it) {
    float* p = tab + (size_t)my[it] * 128 + lane * 4;
    if (V4) {
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(1.f), "f"(2.f), "f"(3.f), "f"(4.f) : "memory");
    } else {
      atomicAdd(p, 1.f); atomicAdd(p + 1, 2.f); atomicAdd(p + 2, 3.f); atomicAdd(p + 3, 4.f);
    }
  }
}
int main() {
  const int nrows256 = 32768, nrows1152 = 8192;
  uint8_t* tab; cudaMalloc(&tab, 64 << 20); cudaMemset(tab, 1, 64 << 20);
  int* sink; cudaMalloc(&sink, 4);
  const int blocks = 132 * 4, warps = blocks * 4, iters = 512, R = 16;
  size_t n = (size_t)warps * iters * R;
  std::vector<int> h(n);
  int* idx; cudaMalloc(&idx, n * 4);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  auto run = [&](const char* name, auto launch, double bytes) {
    launch(); cudaDeviceSynchronize();
    cudaEventRecord(e0);
    for (int i = 0; i < 5; ++i) launch();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 5;
    printf("%-40s %8.3f ms  %7.2f TB/s  err=%s\n", name, ms, bytes / ms / 1e9, cudaGetErrorString(cudaGetLastError()));
  };
  for (int nr : {nrows256, nrows1152}) {
    for (auto& x : h) x = rand() % nr;
    cudaMemcpy(idx, h.data(), n * 4, cudaMemcpyHostToDevice);
    if (nr == nrows256) {
      auto k = gather<256, 16, 3>; cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 3 * 16 * 256);
      run("gather 256B rows (8MB table) 16x3/warp", [&] { k<<<blocks, 128, 4 * 3 * 16 * 256>>>(tab, idx, iters, sink); }, double(n) * 256);
      auto k2 = gather<256, 32, 4>; cudaFuncSetAttribute(k2, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 4 * 32 * 256);
      run("gather 256B rows 32x4/warp, 3 blk/SM", [&] { k2<<<132 * 3, 128, 4 * 4 * 32 * 256>>>(tab, idx, iters * 16 / 32 * 4 / 3, sink); }, double(132 * 3 * 4) * (iters * 16 / 32 * 4 / 3) * 32 * 256);
      float* ft = (float*)tab;
      run("red.v4.f32 512B rows (16MB)", [&] { atom<true><<<blocks, 128>>>(ft, idx, iters, R); }, double(n) * 512);
      run("atomicAdd f32 x4 512B rows", [&] { atom<false><<<blocks, 128>>>(ft, idx, iters, R); }, double(n) * 512);
    } else {
      auto k = gather<1152, 8, 3>; cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 3 * 8 * 1152);
      run("gather 1152B rows (9MB table) 8x3/warp", [&] { k<<<blocks, 128, 4 * 3 * 8 * 1152>>>(tab, idx, iters, sink); }, double(warps) * iters * 8 * 1152);
    }
  }
  return 0;
}
