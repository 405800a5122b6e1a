// STREAM's kernels (J. McCalpin) on this host's memory at a given OpenMP thread count: the limit the
// host AdamW kernel is measured against (megatrain.probe.host_mem_bandwidth_gbs). Bytes are counted
// as STREAM counts them, each array element read or written once (4 B), as megatrain.optim.state_bytes
// counts the AdamW kernel's. A plain store moves more: its cache line is read first (write-allocate),
// so fill really moves 8 B per element, copy 12 and triad 16 where 4, 8 and 12 are counted;
// write_nt's non-temporal stores go to memory without that read. The AdamW kernel stores mostly into
// lines it has just read (weights, moments), so its counted bytes are nearly its real traffic, and
// its counted rate can pass triad's: "update" (a = a + s b) is that pattern, the fair limit for it.
// Plain C++ and OpenMP, built into the host AdamW extension (megatrain/optim/fused.py).
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <new>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr int64_t kLine = 16;  // floats per 64-byte cache line: threads' ranges start on one

// n floats, 2 MiB aligned and advised onto transparent huge pages: the probe measures the memory, not the TLB.
class Array {
 public:
  explicit Array(int64_t n) : bytes_((n * sizeof(float) + kHugePage - 1) / kHugePage * kHugePage) {
    data_ = static_cast<float*>(std::aligned_alloc(kHugePage, bytes_));
    if (data_ == nullptr) throw std::bad_alloc();
    madvise(data_, bytes_, MADV_HUGEPAGE);
  }
  ~Array() { std::free(data_); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  float* data() { return data_; }

 private:
  size_t bytes_;
  float* data_;
};

// The calling thread's share [lo, hi) of n elements, whole cache lines but the last: the same in
// the first touch and in every kernel, so that each thread streams the pages it placed (NUMA).
void share(int64_t n, int64_t& lo, int64_t& hi) {
  const int64_t lines = (n + kLine - 1) / kLine, threads = omp_get_num_threads(), t = omp_get_thread_num();
  lo = std::min(n, lines * t / threads * kLine);
  hi = std::min(n, lines * (t + 1) / threads * kLine);
}

float sum(const float* __restrict a, int64_t lo, int64_t hi) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = lo; i < hi; ++i) total += a[i];
  return total;
}

void fill(float* __restrict a, int64_t lo, int64_t hi, float value) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) a[i] = value;
}

// A loop of plain stores, which GCC would otherwise call memmove for: glibc's switches to non-temporal
// stores on large sizes, and copy would then measure another thing than triad's stores.
__attribute__((optimize("no-tree-loop-distribute-patterns")))
void copy(const float* __restrict a, float* __restrict b, int64_t lo, int64_t hi) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) b[i] = a[i];
}

void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, int64_t lo, int64_t hi,
           float scalar) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) a[i] = b[i] + scalar * c[i];
}

// AdamW's own access pattern: arrays read and written back in place beside arrays only read (12 B counted,
// and 12 moved: the store hits the line just read).
void update(float* __restrict a, const float* __restrict b, int64_t lo, int64_t hi, float scalar) {
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) a[i] = a[i] + scalar * b[i];
}

#if defined(__x86_64__)
// SSE's 16-byte non-temporal stores: the write-combining buffers gather them into whole lines.
void fill_nt(float* __restrict a, int64_t lo, int64_t hi, float value) {
  const __m128 x = _mm_set1_ps(value);
  int64_t i = lo;
  for (; i + 4 <= hi; i += 4) _mm_stream_ps(a + i, x);  // lo is 64-byte aligned
  for (; i < hi; ++i) a[i] = value;
  _mm_sfence();
}
#endif

// The best time of `repeats` runs of kernel(lo, hi) over every thread's share, in seconds.
template <typename Kernel>
double best_seconds(int64_t n, int threads, int64_t repeats, Kernel kernel) {
  double best = std::numeric_limits<double>::infinity();
  for (int64_t r = 0; r < repeats; ++r) {
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
      int64_t lo, hi;
      share(n, lo, hi);
      kernel(lo, hi);
    }
    best = std::min(best, omp_get_wtime() - t0);
  }
  return best;
}

}  // namespace

// GB/s (1e9 bytes/s) of read (a sum), write (a fill), write_nt (the fill's non-temporal stores, x86), copy, triad
// (a = b + s c) and update (a = a + s b, read-modify-write as AdamW's state) over fp32 arrays of numel elements, at each thread count, each the best of repeats.
// The arrays are placed anew per thread count, first touched by the threads that stream them.
std::map<std::string, std::vector<double>> host_mem_bandwidth_gbs(int64_t numel, const std::vector<int64_t>& threads,
                                                                  int64_t repeats) {
  std::map<std::string, std::vector<double>> gbs;
  const double element_gb = sizeof(float) * static_cast<double>(numel) / 1e9;
  for (const int64_t t64 : threads) {
    const int t = static_cast<int>(t64);
    Array a_array(numel), b_array(numel), c_array(numel);
    float* __restrict a = a_array.data();
    float* __restrict b = b_array.data();
    float* __restrict c = c_array.data();
    best_seconds(numel, t, 1, [=](int64_t lo, int64_t hi) {
      fill(a, lo, hi, 1.0f);
      fill(b, lo, hi, 2.0f);
      fill(c, lo, hi, 0.5f);
    });
    auto rate = [&](const char* kind, double arrays, auto kernel) {
      gbs[kind].push_back(arrays * element_gb / best_seconds(numel, t, repeats, kernel));
    };
    rate("read", 1, [=](int64_t lo, int64_t hi) {
      volatile float kept = sum(a, lo, hi);  // so that the reads are not optimised away
      (void)kept;
    });
    rate("write", 1, [=](int64_t lo, int64_t hi) { fill(c, lo, hi, 0.25f); });
#if defined(__x86_64__)
    rate("write_nt", 1, [=](int64_t lo, int64_t hi) { fill_nt(c, lo, hi, 0.5f); });
#endif
    rate("copy", 2, [=](int64_t lo, int64_t hi) { copy(a, b, lo, hi); });
    rate("triad", 3, [=](int64_t lo, int64_t hi) { triad(a, b, c, lo, hi, 3.0f); });
    rate("update", 3, [=](int64_t lo, int64_t hi) { update(a, b, lo, hi, 0.5f); });
  }
  return gbs;
}
