// The loops of runtime/csrc/host_adam.cpp that are compiled once per instruction-set
// target. host_adam.cpp includes this file several times, each time inside its own
// namespace and with MC_ISA_ATTR set to that target's function attribute, e.g.
//
//   namespace isa_x86_64_v3 {
//   #define MC_ISA_ATTR __attribute__((target("arch=x86-64-v3")))
//   #include "host_adam_isa.h"
//   }
//
// so that one library holds a baseline x86-64 copy, an AVX2+FMA copy and an AVX-512 copy
// of the same source, and picks one at run time for the CPU it runs on. No include guard
// on purpose. Everything here uses only correctly rounded IEEE operations (mul, add, sub,
// div, sqrt and explicit std::fma; the file is compiled with -ffp-contract=off and without
// -ffast-math, and nothing is reduced), so every target computes bitwise the same result;
// only the vector width differs. tests/test_host_adam.py checks that bitwise.

#ifndef MC_ISA_ATTR
#error "define MC_ISA_ATTR (and open a namespace) before including host_adam_isa.h"
#endif

inline float load_grad(float g) { return g; }

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits. Written with
// integer ops (not c10's conversion) so the loop stays trivially vectorizable.
inline float load_grad(c10::BFloat16 g) {
  uint32_t bits = static_cast<uint32_t>(g.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One Adam update over n contiguous elements. The mode switches are template parameters
// so that the loop body the vectorizer sees is branch-free.
template <typename GradT, int kWd, bool kMaximize, bool kSmallW1>
MC_ISA_ATTR void adam_range(float* __restrict p, const void* g_erased, float* __restrict m,
                            float* __restrict v, int64_t n, const Coeffs& c) {
  const GradT* __restrict g = static_cast<const GradT*>(g_erased);
  const float decay = c.decay, wd = c.wd, w1 = c.w1, w1m1 = c.w1m1, beta2 = c.beta2,
              omb2 = c.omb2, bc2_sqrt = c.bc2_sqrt, eps = c.eps, nss = c.neg_step_size;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = load_grad(g[i]);
    if (kMaximize) gi = -gi;
    float pi = p[i];
    if (kWd == kDecoupled) pi = pi * decay;
    if (kWd == kL2) gi = std::fma(pi, wd, gi);
    float mi = m[i];
    const float diff = gi - mi;
    mi = kSmallW1 ? std::fma(w1, diff, mi) : std::fma(w1m1, diff, gi);
    float vi = v[i] * beta2;
    vi = std::fma(omb2 * gi, gi, vi);
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    pi = pi + (nss * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename GradT, int kWd>
RangeFn pick2(bool maximize, bool small_w1) {
  if (maximize) {
    return small_w1 ? adam_range<GradT, kWd, true, true> : adam_range<GradT, kWd, true, false>;
  }
  return small_w1 ? adam_range<GradT, kWd, false, true> : adam_range<GradT, kWd, false, false>;
}

template <typename GradT>
RangeFn pick1(int wd_mode, bool maximize, bool small_w1) {
  switch (wd_mode) {
    case kDecoupled: return pick2<GradT, kDecoupled>(maximize, small_w1);
    case kL2: return pick2<GradT, kL2>(maximize, small_w1);
    default: return pick2<GradT, kNoDecay>(maximize, small_w1);
  }
}

// The kernel for one tensor's configuration (grad dtype, weight decay mode, maximize, which
// of lerp's two formulas).
inline RangeFn pick_adam(bool bf16_grad, int wd_mode, bool maximize, bool small_w1) {
  return bf16_grad ? pick1<c10::BFloat16>(wd_mode, maximize, small_w1)
                   : pick1<float>(wd_mode, maximize, small_w1);
}

// Bandwidth probes for the benchmark, vectorized like the kernel.

// a = b (8 bytes moved per element, STREAM counting).
MC_ISA_ATTR inline void copy_range(float* __restrict a, const float* __restrict b, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = b[i];
}

// a = b + s*c (12 bytes moved per element, STREAM counting).
MC_ISA_ATTR inline void triad_range(float* __restrict a, const float* __restrict b,
                                    const float* __restrict c, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

// Adam's access pattern with trivial arithmetic: read p, g, m, v; write p, m, v.
MC_ISA_ATTR inline void rmw_range(float* __restrict p, const float* __restrict g,
                                  float* __restrict m, float* __restrict v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}

inline IsaKernels kernels() {
  IsaKernels k;
  k.pick_adam = pick_adam;
  k.copy = copy_range;
  k.triad = triad_range;
  k.rmw = rmw_range;
  return k;
}
