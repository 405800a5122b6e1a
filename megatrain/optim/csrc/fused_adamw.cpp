// One pass of AdamW over a host tile: reads the streamed gradient (bf16 or fp32), applies the
// global-norm clip coefficient, updates the weights and fp32 moments in place and, in mixed mode,
// writes the bf16 copy the next step streams to the GPU. Weights are fp32 (mixed mode's master,
// 28 bytes of memory traffic per parameter instead of ~46 for convert + scale + torch fused AdamW +
// convert back) or bf16 (the bf16 mode: read, updated in fp32, rounded back; 22 bytes).
// The arithmetic follows torch's fused CPU AdamW (decoupled decay, lerp for the first moment).
// Multiplying by 1/sqrt(bias_correction2) instead of dividing differs from torch by an ulp.
// compact_adamw is the same update with compact moments (megatrain/optim/compact.py, whose maps it
// repeats): bf16 with stochastic rounding, or int8 blocks of kQBlock with an fp32 absmax each.
// The fused multiply-adds are written out (std::fma) and the build turns contraction off
// (megatrain/optim/fused.py): the rounding is the source's, not the vectoriser's choice per loop.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, branch-free; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

// lowbias32 (C. Wellons) of (element index, step, stream): 16 random bits, as compact.random_bits16.
static inline uint32_t random_bits16(uint32_t index, uint32_t step, uint32_t stream) {
  uint32_t x = index * 0x9E3779B1u + step * 0x85EBCA77u + stream * 0xC2B2AE3Du;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x & 0xFFFFu;
}

static inline uint16_t f32_to_bf16_stochastic(float f, uint32_t bits16) {  // unbiased: up with p = distance
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + bits16) >> 16);
}

static inline float load(const uint16_t* x, int64_t i) { return bf16_to_f32(x[i]); }
static inline float load(const float* x, int64_t i) { return x[i]; }
static inline void store(uint16_t* x, int64_t i, float f) { x[i] = f32_to_bf16(f); }
static inline void store(float* x, int64_t i, float f) { x[i] = f; }

// threads <= 0: all cores but one, which is left to the thread that feeds the GPU.
static inline int kernel_threads(int64_t threads) {
  return threads > 0 ? static_cast<int>(threads) : std::max(1, omp_get_max_threads() - 1);
}

// Templated on the weight and gradient types and on whether a bf16 copy is written, so the loop
// has no per-element branches and vectorises.
template <typename P, typename G, bool kWriteBf16>
static void adamw_kernel(P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
                         uint16_t* __restrict w_out, int64_t n, float clip, float lr, float beta1, float beta2,
                         float eps, float wd, float bc1, float bc2_sqrt, int threads) {
  const float step_size = lr / bc1;
  const float decay = 1.0f - lr * wd;
  const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;
  const float inv_bc2_sqrt = 1.0f / bc2_sqrt;
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = load(g, i) * clip;
    const float mi = std::fma(one_m_b1, gi - m[i], m[i]);
    const float vi = std::fma(v[i], beta2, one_m_b2 * gi * gi);
    const float pi = std::fma(load(p, i), decay, -(step_size * mi / std::fma(std::sqrt(vi), inv_bc2_sqrt, eps)));
    store(p, i, pi);
    m[i] = mi;
    v[i] = vi;
    if constexpr (kWriteBf16) w_out[i] = f32_to_bf16(pi);
  }
}

template <typename P, typename G>
static void dispatch(P* p, const G* g, float* m, float* v, uint16_t* w_out, int64_t n, const float* a, int threads) {
  if (w_out) adamw_kernel<P, G, true>(p, g, m, v, w_out, n, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], threads);
  else adamw_kernel<P, G, false>(p, g, m, v, w_out, n, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], threads);
}

template <typename P>
static void dispatch_grad(P* p, const torch::Tensor& grad, float* m, float* v, uint16_t* w_out, int64_t n,
                          const float* a, int threads) {
  if (grad.scalar_type() == torch::kBFloat16)
    dispatch(p, reinterpret_cast<const uint16_t*>(grad.data_ptr()), m, v, w_out, n, a, threads);
  else
    dispatch(p, grad.data_ptr<float>(), m, v, w_out, n, a, threads);
}

constexpr int64_t kQBlock = 128;  // megatrain.optim.state_bytes.QBLOCK

// Compact moments, one block of kQBlock at a time: decoded into fp32, updated as adamw_kernel does
// (weight decay on the elements before decay_n), encoded back. int8: m signed, q = round(127 m /
// absmax); v as sqrt(v) = absmax (q + 1) / 256. bf16: stochastic rounding, bits by store index.
// Templated on the format too, and each step a loop of its own over the block in small stack arrays,
// so that every loop vectorises; the int8 block's absmax is taken in the update loop, where sqrt(v)
// is computed anyway. The max is a compare and select, not std::fmax (a libm call per element that
// kept the loop scalar); with the running max never NaN both skip a NaN element alike.
template <bool kInt8, typename P, typename G, bool kWriteBf16>
static void compact_kernel(P* __restrict p, const G* __restrict g, void* m_state, void* v_state, float* m_scale,
                           float* v_scale, uint16_t* __restrict w_out, int64_t n, int64_t decay_n, int64_t index0,
                           uint32_t step, const float* a, int threads) {
  const float clip = a[0], lr = a[1], beta1 = a[2], beta2 = a[3], eps = a[4], wd = a[5];
  const float step_size = lr / a[6];
  const float decay = 1.0f - lr * wd;
  const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;
  const float inv_bc2_sqrt = 1.0f / a[7];
  const int64_t blocks = (n + kQBlock - 1) / kQBlock;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    // the block's elements, indexed by a 32-bit j: no 64-bit lanes in the vector loops
    const int64_t lo = blk * kQBlock;
    const int len = static_cast<int>(std::min(kQBlock, n - lo));
    const int decay_len = static_cast<int>(std::clamp<int64_t>(decay_n - lo, 0, len));
    P* __restrict pb = p + lo;
    const G* __restrict gb = g + lo;
    float m[kQBlock], v[kQBlock];  // v: the second moment, for int8 its root after the update
    if constexpr (kInt8) {
      const int8_t* __restrict mq = static_cast<const int8_t*>(m_state) + lo;
      const uint8_t* __restrict vq = static_cast<const uint8_t*>(v_state) + lo;
      const float sm = m_scale[blk] / 127.0f, sv = v_scale[blk] / 256.0f;
#pragma omp simd
      for (int j = 0; j < len; ++j) {
        m[j] = static_cast<float>(mq[j]) * sm;
        const float root = (static_cast<float>(vq[j]) + 1.0f) * sv;
        v[j] = root * root;
      }
    } else {
      const uint16_t* __restrict mb = static_cast<const uint16_t*>(m_state) + lo;
      const uint16_t* __restrict vb = static_cast<const uint16_t*>(v_state) + lo;
#pragma omp simd
      for (int j = 0; j < len; ++j) {
        m[j] = bf16_to_f32(mb[j]);
        v[j] = bf16_to_f32(vb[j]);
      }
    }
    float m_max = 0.0f, v_max = 0.0f;
#pragma omp simd reduction(max : m_max, v_max)
    for (int j = 0; j < len; ++j) {
      const float gi = load(gb, j) * clip;
      const float mi = std::fma(one_m_b1, gi - m[j], m[j]);
      const float vi = std::fma(v[j], beta2, one_m_b2 * gi * gi);
      const float root = std::sqrt(vi);
      // p * decay rounded before the subtraction (adamw_kernel fuses the two): as this kernel always has
      const float decayed = load(pb, j) * (j < decay_len ? decay : 1.0f);
      const float pi = decayed - step_size * mi / std::fma(root, inv_bc2_sqrt, eps);
      store(pb, j, pi);
      m[j] = mi;
      v[j] = kInt8 ? root : vi;
      if constexpr (kWriteBf16) w_out[lo + j] = f32_to_bf16(pi);
      if constexpr (kInt8) {
        const float m_abs = std::fabs(mi);
        m_max = m_abs > m_max ? m_abs : m_max;
        v_max = root > v_max ? root : v_max;
      }
    }
    if constexpr (kInt8) {
      int8_t* __restrict mq = static_cast<int8_t*>(m_state) + lo;
      uint8_t* __restrict vq = static_cast<uint8_t*>(v_state) + lo;
      m_scale[blk] = m_max;
      v_scale[blk] = v_max;
      const float im = m_max > 0.0f ? 127.0f / m_max : 0.0f, iv = v_max > 0.0f ? 256.0f / v_max : 0.0f;
#pragma omp simd
      for (int j = 0; j < len; ++j) {
        mq[j] = static_cast<int8_t>(std::clamp(std::nearbyint(m[j] * im), -127.0f, 127.0f));
        vq[j] = static_cast<uint8_t>(std::clamp(std::nearbyint(v[j] * iv) - 1.0f, 0.0f, 255.0f));
      }
    } else {
      uint16_t* __restrict mb = static_cast<uint16_t*>(m_state) + lo;
      uint16_t* __restrict vb = static_cast<uint16_t*>(v_state) + lo;
      const uint32_t index_lo = static_cast<uint32_t>(index0 + lo);  // random_bits16 keeps the index's low 32 bits
#pragma omp simd
      for (int j = 0; j < len; ++j) {
        mb[j] = f32_to_bf16_stochastic(m[j], random_bits16(index_lo + static_cast<uint32_t>(j), step, 0));
        vb[j] = f32_to_bf16_stochastic(v[j], random_bits16(index_lo + static_cast<uint32_t>(j), step, 1));
      }
    }
  }
}

template <typename P, typename G>
static void dispatch_compact(P* p, const G* g, void* ms, void* vs, float* msc, float* vsc, uint16_t* w_out, int64_t n,
                             int64_t decay_n, int64_t index0, uint32_t step, const float* a, int threads) {
  if (msc) {  // int8
    if (w_out) compact_kernel<true, P, G, true>(p, g, ms, vs, msc, vsc, w_out, n, decay_n, index0, step, a, threads);
    else compact_kernel<true, P, G, false>(p, g, ms, vs, msc, vsc, w_out, n, decay_n, index0, step, a, threads);
  } else {
    if (w_out) compact_kernel<false, P, G, true>(p, g, ms, vs, msc, vsc, w_out, n, decay_n, index0, step, a, threads);
    else compact_kernel<false, P, G, false>(p, g, ms, vs, msc, vsc, w_out, n, decay_n, index0, step, a, threads);
  }
}

template <typename P>
static void dispatch_compact_grad(P* p, const torch::Tensor& grad, void* ms, void* vs, float* msc, float* vsc,
                                  uint16_t* w_out, int64_t n, int64_t decay_n, int64_t index0, uint32_t step,
                                  const float* a, int threads) {
  if (grad.scalar_type() == torch::kBFloat16)
    dispatch_compact(p, reinterpret_cast<const uint16_t*>(grad.data_ptr()), ms, vs, msc, vsc, w_out, n, decay_n,
                     index0, step, a, threads);
  else
    dispatch_compact(p, grad.data_ptr<float>(), ms, vs, msc, vsc, w_out, n, decay_n, index0, step, a, threads);
}

// The hyperparameters as the kernels take them: clip, lr, betas, eps, weight decay, bias corrections.
static void kernel_args(float* out, int64_t step, double clip, double lr, double beta1, double beta2, double eps,
                        double weight_decay) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float args[] = {static_cast<float>(clip), static_cast<float>(lr), static_cast<float>(beta1),
                        static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                        static_cast<float>(bc1), static_cast<float>(std::sqrt(bc2))};
  std::memcpy(out, args, sizeof(args));
}

static uint16_t* checked_weight_out(const torch::Tensor& weight_out, bool param_bf16, int64_t n) {
  if (weight_out.numel() == 0) return nullptr;
  TORCH_CHECK(!param_bf16, "a bf16 param is its own bf16 copy: pass no weight_out");
  TORCH_CHECK(weight_out.numel() == n && weight_out.is_contiguous() && weight_out.scalar_type() == torch::kBFloat16);
  return reinterpret_cast<uint16_t*>(weight_out.data_ptr());
}

// param and grad as for fused_adamw; weight_out: bf16 or empty; decay_numel: elements (from the
// start) that take weight decay; index0: the first element's index in the store (the random bits).
// exp_avg, exp_avg_sq: bf16 (scales empty) or int8 and uint8 with fp32 scales, one per kQBlock.
void compact_adamw(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                   torch::Tensor exp_avg_scale, torch::Tensor exp_avg_sq_scale, torch::Tensor weight_out,
                   int64_t decay_numel, int64_t index0, int64_t step, double clip, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t threads) {
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous());
  const bool param_bf16 = param.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(param_bf16 || param.scalar_type() == torch::kFloat32, "param must be fp32 or bf16");
  TORCH_CHECK(grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kFloat32);
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n);
  const bool int8 = exp_avg.scalar_type() == torch::kInt8;
  float* msc = nullptr;
  float* vsc = nullptr;
  if (int8) {
    const int64_t blocks = (n + kQBlock - 1) / kQBlock;
    TORCH_CHECK(exp_avg_sq.scalar_type() == torch::kUInt8 && exp_avg_scale.numel() == blocks &&
                exp_avg_sq_scale.numel() == blocks && exp_avg_scale.scalar_type() == torch::kFloat32 &&
                exp_avg_sq_scale.scalar_type() == torch::kFloat32, "int8 moments: int8, uint8, fp32 scales");
    msc = exp_avg_scale.data_ptr<float>();
    vsc = exp_avg_sq_scale.data_ptr<float>();
  } else {
    TORCH_CHECK(exp_avg.scalar_type() == torch::kBFloat16 && exp_avg_sq.scalar_type() == torch::kBFloat16,
                "compact moments are bf16 or int8");
  }
  uint16_t* w_out = checked_weight_out(weight_out, param_bf16, n);
  float args[8];
  kernel_args(args, step, clip, lr, beta1, beta2, eps, weight_decay);
  const uint32_t step32 = static_cast<uint32_t>(step);
  const int t = kernel_threads(threads);
  if (param_bf16)
    dispatch_compact_grad(reinterpret_cast<uint16_t*>(param.data_ptr()), grad, exp_avg.data_ptr(),
                          exp_avg_sq.data_ptr(), msc, vsc, w_out, n, decay_numel, index0, step32, args, t);
  else
    dispatch_compact_grad(param.data_ptr<float>(), grad, exp_avg.data_ptr(), exp_avg_sq.data_ptr(), msc, vsc, w_out,
                          n, decay_numel, index0, step32, args, t);
}

// param: fp32, or bf16 (updated in fp32 and rounded back; then no weight_out); grad: bf16 or fp32;
// exp_avg, exp_avg_sq: fp32; weight_out: bf16 or empty (none).
void fused_adamw(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 torch::Tensor weight_out, int64_t step, double clip, double lr, double beta1, double beta2,
                 double eps, double weight_decay, int64_t threads) {
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous());
  const bool param_bf16 = param.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(param_bf16 || param.scalar_type() == torch::kFloat32, "param must be fp32 or bf16");
  TORCH_CHECK(exp_avg.scalar_type() == torch::kFloat32 && exp_avg_sq.scalar_type() == torch::kFloat32);
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n);
  TORCH_CHECK(grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kFloat32);
  uint16_t* w_out = checked_weight_out(weight_out, param_bf16, n);
  float args[8];
  kernel_args(args, step, clip, lr, beta1, beta2, eps, weight_decay);
  const int t = kernel_threads(threads);
  float* mp = exp_avg.data_ptr<float>();
  float* vp = exp_avg_sq.data_ptr<float>();
  if (param_bf16)
    dispatch_grad(reinterpret_cast<uint16_t*>(param.data_ptr()), grad, mp, vp, w_out, n, args, t);
  else
    dispatch_grad(param.data_ptr<float>(), grad, mp, vp, w_out, n, args, t);
}

// csrc/host_bandwidth.cpp: STREAM's kernels, GB/s by kind, one rate per thread count.
std::map<std::string, std::vector<double>> host_mem_bandwidth_gbs(int64_t numel, const std::vector<int64_t>& threads,
                                                                  int64_t repeats);

// The GIL is released: the training thread keeps issuing GPU work while a tile updates.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_adamw", &fused_adamw, "one-pass host AdamW", py::call_guard<py::gil_scoped_release>());
  m.def("compact_adamw", &compact_adamw, "one-pass host AdamW, compact moments",
        py::call_guard<py::gil_scoped_release>());
  m.def("host_mem_bandwidth_gbs", &host_mem_bandwidth_gbs, "STREAM's kernels per thread count",
        py::call_guard<py::gil_scoped_release>());
}
