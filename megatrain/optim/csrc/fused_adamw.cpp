// One pass of AdamW over a host tile: reads the streamed gradient (bf16 or fp32), applies the
// global-norm clip coefficient, updates the weights and fp32 moments in place and, in mixed mode,
// writes the bf16 copy the next step streams to the GPU. Weights are fp32 (mixed mode's master,
// 28 bytes of memory traffic per parameter instead of ~46 for convert + scale + torch fused AdamW +
// convert back) or bf16 (the bf16 mode: read, updated in fp32, rounded back; 22 bytes).
// The arithmetic follows torch's fused CPU AdamW (decoupled decay, lerp for the first moment).
// Multiplying by 1/sqrt(bias_correction2) instead of dividing differs from torch by an ulp.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

static inline float load(const uint16_t* x, int64_t i) { return bf16_to_f32(x[i]); }
static inline float load(const float* x, int64_t i) { return x[i]; }
static inline void store(uint16_t* x, int64_t i, float f) { x[i] = f32_to_bf16(f); }
static inline void store(float* x, int64_t i, float f) { x[i] = f; }

// Templated on the weight and gradient types and on whether a bf16 copy is written, so the loop
// has no per-element branches and vectorises. Leaves one core to the thread that feeds the GPU.
template <typename P, typename G, bool kWriteBf16>
static void adamw_kernel(P* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
                         uint16_t* __restrict w_out, int64_t n, float clip, float lr, float beta1, float beta2,
                         float eps, float wd, float bc1, float bc2_sqrt) {
  const float step_size = lr / bc1;
  const float decay = 1.0f - lr * wd;
  const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;
  const float inv_bc2_sqrt = 1.0f / bc2_sqrt;
  const int threads = std::max(1, omp_get_max_threads() - 1);
#pragma omp parallel for simd schedule(static) num_threads(threads)
  for (int64_t i = 0; i < n; ++i) {
    const float gi = load(g, i) * clip;
    const float mi = m[i] + one_m_b1 * (gi - m[i]);
    const float vi = v[i] * beta2 + one_m_b2 * gi * gi;
    const float pi = load(p, i) * decay - step_size * mi / (std::sqrt(vi) * inv_bc2_sqrt + eps);
    store(p, i, pi);
    m[i] = mi;
    v[i] = vi;
    if constexpr (kWriteBf16) w_out[i] = f32_to_bf16(pi);
  }
}

template <typename P, typename G>
static void dispatch(P* p, const G* g, float* m, float* v, uint16_t* w_out, int64_t n, const float* a) {
  if (w_out) adamw_kernel<P, G, true>(p, g, m, v, w_out, n, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
  else adamw_kernel<P, G, false>(p, g, m, v, w_out, n, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
}

template <typename P>
static void dispatch_grad(P* p, const torch::Tensor& grad, float* m, float* v, uint16_t* w_out, int64_t n,
                          const float* a) {
  if (grad.scalar_type() == torch::kBFloat16)
    dispatch(p, reinterpret_cast<const uint16_t*>(grad.data_ptr()), m, v, w_out, n, a);
  else
    dispatch(p, grad.data_ptr<float>(), m, v, w_out, n, a);
}

// param: fp32, or bf16 (updated in fp32 and rounded back; then no weight_out); grad: bf16 or fp32;
// exp_avg, exp_avg_sq: fp32; weight_out: bf16 or empty (none).
void fused_adamw(torch::Tensor param, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                 torch::Tensor weight_out, int64_t step, double clip, double lr, double beta1, double beta2,
                 double eps, double weight_decay) {
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous());
  const bool param_bf16 = param.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(param_bf16 || param.scalar_type() == torch::kFloat32, "param must be fp32 or bf16");
  TORCH_CHECK(exp_avg.scalar_type() == torch::kFloat32 && exp_avg_sq.scalar_type() == torch::kFloat32);
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n);
  TORCH_CHECK(grad.scalar_type() == torch::kBFloat16 || grad.scalar_type() == torch::kFloat32);
  uint16_t* w_out = nullptr;
  if (weight_out.numel() > 0) {
    TORCH_CHECK(!param_bf16, "a bf16 param is its own bf16 copy: pass no weight_out");
    TORCH_CHECK(weight_out.numel() == n && weight_out.is_contiguous() && weight_out.scalar_type() == torch::kBFloat16);
    w_out = reinterpret_cast<uint16_t*>(weight_out.data_ptr());
  }
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const float args[] = {static_cast<float>(clip), static_cast<float>(lr), static_cast<float>(beta1),
                        static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                        static_cast<float>(bc1), static_cast<float>(std::sqrt(bc2))};
  float* mp = exp_avg.data_ptr<float>();
  float* vp = exp_avg_sq.data_ptr<float>();
  if (param_bf16)
    dispatch_grad(reinterpret_cast<uint16_t*>(param.data_ptr()), grad, mp, vp, w_out, n, args);
  else
    dispatch_grad(param.data_ptr<float>(), grad, mp, vp, w_out, n, args);
}

// The GIL is released: the training thread keeps issuing GPU work while a tile updates.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_adamw", &fused_adamw, "one-pass host AdamW", py::call_guard<py::gil_scoped_release>());
}
