// The top-K owner sort on its own, one GPU, no torch: checks every variant
// against std::sort on awkward sizes and inputs (NaN, +-inf, -0.0, invalid
// ids, ties), then times 2048-key rows in 8-launch CUDA graphs for five score
// distributions. Built with -DTRACE=1, thread 0 of block 0 also stamps
// clock64 between the phases (the numbers after us/call).
//   nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr [-DTRACE=1] lab.cu -o /tmp/sort_lab
// Variants: cur1024 = v40 (multi-pass, as shipped in version 4.0), bk* = v41,
// bk2x1 / bk2x2 = v42 with 1 / 2 buckets per key (bk2x2 is the library's),
// floor1024 = load and store only.
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

__device__ long long g_stamps[16];
#define stamps g_stamps
#include "v42_one_pass.cuh"

constexpr int kN = 2048;

size_t sort_bytes() { return cur::rank_sort_bytes(kN); }

template <int V, int T>
__global__ void __launch_bounds__(T) sort_kernel(const float* scores, const int* ids, int n, int* out) {
  extern __shared__ __align__(16) uint8_t smem[];
  STAMP(0);
  const cur::SortSmem m = cur::sort_smem(smem, kN);
  uint64_t* res = reinterpret_cast<uint64_t*>(smem + cur::rank_sort_bytes(kN));
  const int t = blockIdx.x;
  auto key_at = [&](int j) { return topk_key(scores[t * n + j], ids[t * n + j]); };
  if (V == 0) {
    cur::rank_sort(m, key_at, n, n, res);
  } else if (V == 1) {
    bk::rank_sort<T>(m, key_at, n, n, res);
  } else if (V == 3) {
    bk2::rank_sort<T, 1>(m, [&](int j) { return scores[t * n + j]; }, [&](int j) { return ids[t * n + j]; }, n, n, res);
  } else if (V == 4) {
    bk2::rank_sort<T, 2>(m, [&](int j) { return scores[t * n + j]; }, [&](int j) { return ids[t * n + j]; }, n, n, res);
  } else {  // floor: load, store in input order
    for (int j = threadIdx.x; j < n; j += T) res[j] = key_at(j);
    __syncthreads();
  }
  STAMP(6);
  for (int j = threadIdx.x; j < n; j += T) out[t * n + j] = topk_key_id(res[j]);
  STAMP(7);
}

struct Variant {
  const char* name;
  void (*kernel)(const float*, const int*, int, int*);
  int threads;
};

Variant variants[] = {
    {"cur1024", sort_kernel<0, 1024>, 1024},
    {"bk1024", sort_kernel<1, 1024>, 1024},
    {"bk512", sort_kernel<1, 512>, 512},
    {"bk2x1", sort_kernel<3, 1024>, 1024},
    {"bk2x2", sort_kernel<4, 1024>, 1024},
    {"bk2x1_512", sort_kernel<3, 512>, 512},
    {"floor1024", sort_kernel<2, 1024>, 1024},
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
        v.kernel<<<rows, v.threads, smem>>>(ds, di, n, dout);
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
  for (int rows : {1, 64}) {
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
        cudaStream_t st;
        CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int c = 0; c < 8; ++c) v.kernel<<<rows, v.threads, smem, st>>>(ds, di, kN, dout);
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
        long long h[16] = {0};
        if (TRACE) {
          v.kernel<<<rows, v.threads, smem, st>>>(ds, di, kN, dout);
          CK(cudaStreamSynchronize(st));
          CK(cudaMemcpyFromSymbol(h, g_stamps, sizeof(h)));
        }
        printf("%-10s %-8s %5d %9.2f  ", v.name, kind, rows, trials[3]);
        if (TRACE)
          for (int i = 1; i < 8; ++i) printf(" %lld", h[i] ? h[i] - h[0] : -1);
        printf("\n");
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        CK(cudaStreamDestroy(st));
      }
      CK(cudaFree(ds));
      CK(cudaFree(di));
      CK(cudaFree(dout));
    }
  }
  return failures ? 1 : 0;
}
