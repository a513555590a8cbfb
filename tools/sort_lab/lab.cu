// The top-K owner sort on its own, one GPU, linked without torch: checks the
// library's sort (csrc/topk_sort.cuh, included as it is built there) against
// std::sort on awkward sizes and inputs (NaN, +-inf, -0.0, invalid ids, ties),
// then times 2048-key rows in 8-launch CUDA graphs for five score
// distributions, and the peer merge of two ranks simulated by two blocks.
// Built with -DTRACE=1, thread 0 of block 0 also stamps clock64 between the
// phases (the numbers after us/call). From the repository root (the include
// folder is for the c10 headers semantics.h uses; nothing of torch is linked):
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr \
//     -I$(python3 -c 'import torch.utils.cpp_extension as c; print(c.include_paths()[0])') \
//     [-DTRACE=1] tools/sort_lab/lab.cu -o /tmp/sort_lab
//   /tmp/sort_lab [sim]   (sim: the correctness pass and the simulated peer merge only)
// Variants: shipped = the library's sort, floor = load and store only.
// Earlier versions and measured negatives (v40-v45, the cluster row v50) are
// in docs/NOTES.md with the commits that hold them.
#ifndef TRACE
#define TRACE 0
#endif
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common.cuh"
#include "../../csrc/topk_sort.cuh"

using sdcp::kThreads;
using sdcp::topk_key;
using sdcp::topk_key_id;

__device__ long long g_stamps[16];

constexpr int kN = 2048;

size_t sort_bytes() { return sdcp::rank_sort_bytes(kN); }

// One row per block: the library's sort (SHIPPED) or the floor (load, store
// in input order).
template <bool SHIPPED>
__global__ void __launch_bounds__(kThreads) sort_kernel(const float* scores, const int* ids, int n, int* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  STAMP(0);
  // The sorted keys first, then the sort's area (rank_sort_bytes is host code).
  uint64_t* res = reinterpret_cast<uint64_t*>(smem);
  const sdcp::SortSmem m = sdcp::sort_smem(smem + kN * 8, kN);
  const int t = blockIdx.x;
  if (SHIPPED) {
    sdcp::rank_sort(m, scores + t * n, ids + t * n, n, n, res);
  } else {
    for (int j = threadIdx.x; j < n; j += kThreads) res[j] = topk_key(scores[t * n + j], ids[t * n + j]);
    __syncthreads();
  }
  STAMP(6);
  for (int j = threadIdx.x; j < n; j += kThreads) out[t * n + j] = topk_key_id(res[j]);
  STAMP(7);
}

// The peer merge of two ranks simulated by two blocks of one kernel on one
// GPU (block r plays rank r, row r), as topk_merge runs it: sort, push the
// sorted keys into the other block's inbox (16-byte plain stores, the keys
// are their own flag), poll the own inbox (re-filling the sentinel), merge
// path writing the ids. What it leaves out: the NVLink crossing and the skew
// between two GPUs.
__global__ void __launch_bounds__(kThreads) peer_sim_kernel(const float* scores, const int* ids, int n,
                                                            uint64_t* inbox, int* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  STAMP(0);
  uint64_t* acc = reinterpret_cast<uint64_t*>(smem);
  uint64_t* stage = acc + kN;
  const sdcp::SortSmem m = sdcp::sort_smem(smem + 2 * kN * 8, kN);
  const int r = blockIdx.x;
  sdcp::rank_sort(m, scores + r * n, ids + r * n, n, n, acc);
  STAMP(6);
  ulonglong2* peer = reinterpret_cast<ulonglong2*>(inbox + (1 - r) * n);
  ulonglong2* mine = reinterpret_cast<ulonglong2*>(inbox + r * n);
  for (int v = threadIdx.x; v < n / 2; v += kThreads) peer[v] = reinterpret_cast<const ulonglong2*>(acc)[v];
  STAMP(7);
  for (int v = threadIdx.x; v < n / 2; v += kThreads) {
    ulonglong2 x;
    do {
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(x.x), "=l"(x.y) : "l"(mine + v) : "memory");
    } while (x.x == ~uint64_t{0} || x.y == ~uint64_t{0});
    reinterpret_cast<ulonglong2*>(stage)[v] = x;
    mine[v] = make_ulonglong2(~uint64_t{0}, ~uint64_t{0});
  }
  __syncthreads();
  STAMP(8);
  int* o = out + r * n;
  sdcp::merge_path(acc, n, stage, n, n, [o](int pos, uint64_t key) { o[pos] = topk_key_id(key); });
  STAMP(9);
}

struct Variant {
  const char* name;
  void (*kernel)(const float*, const int*, int, int*);
};

Variant variants[] = {
    {"shipped", sort_kernel<true>},
    {"floor", sort_kernel<false>},
};

std::vector<float> make_scores(const std::string& kind, int rows, int n, std::mt19937& g) {
  std::vector<float> s(static_cast<size_t>(rows) * n);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> t80(0, 79);
  for (size_t i = 0; i < s.size(); ++i) {
    if (kind == "uniform") s[i] = u(g);
    else if (kind == "normal") s[i] = nd(g);
    else if (kind == "tied80") s[i] = t80(g) * 0.25f - 10.f;
    else if (kind == "equal") s[i] = 0.5f;
    else if (kind == "skew") s[i] = (i % 97 == 0) ? 1e30f : u(g);  // one outlier squeezes the rest
    else {  // nasty: NaN, +-inf, -0/+0, ties, huge range
      const int r = g() % 10;
      s[i] = r == 0 ? NAN : r == 1 ? INFINITY : r == 2 ? -INFINITY : r == 3 ? -0.0f : r == 4 ? 0.0f
           : r == 5 ? 3e38f : r == 6 ? -3e38f : r == 7 ? 1.0f : nd(g);
    }
  }
  return s;
}

// Per-call time of `launch(stream)` captured 8 times in one CUDA graph:
// median of 7 trials of 100 replays (us). With TRACE, one more launch fills
// stamps[] (cycles from stamp 0).
template <typename Launch>
float time_k8(Launch launch, long long* stamps_out) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int c = 0; c < 8; ++c) launch(st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int w = 0; w < 20; ++w) CK(cudaGraphLaunch(exec, st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> trials;
  for (int tr = 0; tr < 7; ++tr) {
    CK(cudaEventRecord(e0, st));
    for (int rep = 0; rep < 100; ++rep) CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    trials.push_back(ms * 1000.f / 800.f);
  }
  std::sort(trials.begin(), trials.end());
  if (TRACE) {
    launch(st);
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpyFromSymbol(stamps_out, g_stamps, 16 * sizeof(long long)));
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(st));
  return trials[3];
}

int main(int argc, char** argv) {
  CK(cudaSetDevice(0));
  const size_t smem = sort_bytes() + kN * 8;
  for (auto& v : variants)
    CK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  std::mt19937 g(1234);
  int failures = 0;
  // Correctness on every kind and awkward sizes.
  const char* kinds[] = {"uniform", "normal", "tied80", "equal", "skew", "nasty"};
  const int sizes[] = {1, 2, 3, 5, 31, 32, 33, 100, 1000, 2047, 2048};
  for (const char* kind : kinds) {
    for (int n : sizes) {
      const int rows = 3;
      auto s = make_scores(kind, rows, n, g);
      std::vector<int> id(static_cast<size_t>(rows) * n);
      for (int r = 0; r < rows; ++r) {
        std::vector<int> p(n);
        for (int j = 0; j < n; ++j) p[j] = j * 2 + 1;
        std::shuffle(p.begin(), p.end(), g);
        for (int j = 0; j < n; ++j) id[r * n + j] = (g() % 13 == 0) ? -1 - (int)(g() % 5) : (j % 7 == 0 ? 0x7ffffff0 - j : p[j]);
      }
      std::vector<int> ref(id.size());
      for (int r = 0; r < rows; ++r) {
        std::vector<uint64_t> k(n);
        for (int j = 0; j < n; ++j) k[j] = topk_key(s[r * n + j], id[r * n + j]);
        std::sort(k.begin(), k.end(), [](uint64_t a, uint64_t b) { return a > b; });
        for (int j = 0; j < n; ++j) ref[r * n + j] = topk_key_id(k[j]);
      }
      float* ds;
      int *di, *dout;
      CK(cudaMalloc(&ds, s.size() * 4));
      CK(cudaMalloc(&di, id.size() * 4));
      CK(cudaMalloc(&dout, id.size() * 4));
      CK(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(di, id.data(), id.size() * 4, cudaMemcpyHostToDevice));
      for (auto& v : variants) {
        if (std::string(v.name).rfind("floor", 0) == 0) continue;
        CK(cudaMemset(dout, 0x55, id.size() * 4));
        v.kernel<<<rows, kThreads, smem>>>(ds, di, n, dout);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<int> got(id.size());
        CK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
        if (got != ref) {
          ++failures;
          int bad = 0;
          while (got[bad] == ref[bad]) ++bad;
          printf("FAIL %s kind=%s n=%d first mismatch at %d: got %d want %d\n", v.name, kind, n, bad, got[bad], ref[bad]);
        }
      }
      CK(cudaFree(ds));
      CK(cudaFree(di));
      CK(cudaFree(dout));
    }
  }
  printf("correctness: %d failures\n", failures);
  // Timing: 1 and 64 rows of 2048, k8 graphs, median of 7 trials of 100 replays.
  const char* tkinds[] = {"uniform", "normal", "tied80", "equal", "skew"};
  printf("%-10s %-8s %5s %9s   stamps (cycles from start, block 0, one traced launch)\n", "variant", "kind", "rows",
         "us/call");
  const bool sim_only = argc > 1 && std::string(argv[1]) == "sim";  // `lab sim`: the peer simulation only
  for (int rows : {1, 64}) {
    if (sim_only) break;
    for (const char* kind : tkinds) {
      auto s = make_scores(kind, rows, kN, g);
      std::vector<int> id(static_cast<size_t>(rows) * kN);
      for (int r = 0; r < rows; ++r) {
        std::vector<int> p(kN);
        for (int j = 0; j < kN; ++j) p[j] = j * 2 + 1;
        std::shuffle(p.begin(), p.end(), g);
        for (int j = 0; j < kN; ++j) id[r * kN + j] = p[j];
      }
      float* ds;
      int *di, *dout;
      CK(cudaMalloc(&ds, s.size() * 4));
      CK(cudaMalloc(&di, id.size() * 4));
      CK(cudaMalloc(&dout, id.size() * 4));
      CK(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(di, id.data(), id.size() * 4, cudaMemcpyHostToDevice));
      for (auto& v : variants) {
        long long h[16] = {0};
        const float us = time_k8(
            [&](cudaStream_t st) { v.kernel<<<rows, kThreads, smem, st>>>(ds, di, kN, dout); }, h);
        printf("%-10s %-8s %5d %9.2f  ", v.name, kind, rows, us);
        if (TRACE)
          for (int i = 1; i < 8; ++i) printf(" %lld", h[i] ? h[i] - h[0] : -1);
        printf("\n");
      }
      CK(cudaFree(ds));
      CK(cudaFree(di));
      CK(cudaFree(dout));
    }
  }

  // The peer merge simulated on one GPU: 2 blocks (ranks), rows of 2048.
  {
    struct Sim {
      const char* name;
      void (*kernel)(const float*, const int*, int, uint64_t*, int*);
    } sims[] = {{"sim", peer_sim_kernel}};
    for (auto& sim : sims)
      CK(cudaFuncSetAttribute(sim.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem + 2 * kN * 8)));
    for (auto& sim : sims)
    for (const char* kind : {"uniform", "normal"}) {
      auto s = make_scores(kind, 2, kN, g);
      std::vector<int> id(2 * kN);
      std::vector<int> p(2 * kN);
      for (int j = 0; j < 2 * kN; ++j) p[j] = j;
      std::shuffle(p.begin(), p.end(), g);
      for (int j = 0; j < 2 * kN; ++j) id[j] = p[j];
      std::vector<uint64_t> k(2 * kN);
      for (int j = 0; j < 2 * kN; ++j) k[j] = topk_key(s[j], id[j]);
      std::sort(k.begin(), k.end(), [](uint64_t a, uint64_t b) { return a > b; });
      float* ds;
      int *di, *dout;
      uint64_t* dinbox;
      CK(cudaMalloc(&ds, s.size() * 4));
      CK(cudaMalloc(&di, id.size() * 4));
      CK(cudaMalloc(&dout, id.size() * 4));
      CK(cudaMalloc(&dinbox, 2 * kN * 8));
      CK(cudaMemset(dinbox, 0xFF, 2 * kN * 8));
      CK(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(di, id.data(), id.size() * 4, cudaMemcpyHostToDevice));
      sim.kernel<<<2, kThreads, smem + 2 * kN * 8>>>(ds, di, kN, dinbox, dout);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      std::vector<int> got(2 * kN);
      CK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
      int bad = 0;
      for (int r = 0; r < 2; ++r)
        for (int j = 0; j < kN; ++j) bad += got[r * kN + j] != topk_key_id(k[j]);
      if (bad) {
        ++failures;
        printf("FAIL %s kind=%s: %d wrong ids\n", sim.name, kind, bad);
      }
      long long h[16] = {0};
      const float us = time_k8(
          [&](cudaStream_t st) { sim.kernel<<<2, kThreads, smem + 2 * kN * 8, st>>>(ds, di, kN, dinbox, dout); }, h);
      printf("%-10s %-8s %5d %9.2f  ", sim.name, kind, 1, us);
      if (TRACE)
        for (int i = 1; i < 10; ++i) printf(" %lld", h[i] ? h[i] - h[0] : -1);
      printf("\n");
      CK(cudaFree(ds));
      CK(cudaFree(di));
      CK(cudaFree(dout));
      CK(cudaFree(dinbox));
    }
  }
  return failures ? 1 : 0;
}
