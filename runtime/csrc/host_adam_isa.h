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

// One Adam update of element i (the scalar form of every loop below).
template <typename GradT, int kWd, bool kMaximize, bool kSmallW1>
inline void adam_element(float* __restrict p, const GradT* __restrict g, float* __restrict m,
                         float* __restrict v, int64_t i, const Coeffs& c) {
  float gi = load_grad(g[i]);
  if (kMaximize) gi = -gi;
  float pi = p[i];
  if (kWd == kDecoupled) pi = pi * c.decay;
  if (kWd == kL2) gi = std::fma(pi, c.wd, gi);
  float mi = m[i];
  const float diff = gi - mi;
  mi = kSmallW1 ? std::fma(c.w1, diff, mi) : std::fma(c.w1m1, diff, gi);
  float vi = v[i] * c.beta2;
  vi = std::fma(c.omb2 * gi, gi, vi);
  const float denom = std::sqrt(vi) / c.bc2_sqrt + c.eps;
  pi = pi + (c.neg_step_size * mi) / denom;
  p[i] = pi;
  m[i] = mi;
  v[i] = vi;
}

#ifdef MC_ISA_AVX2_LINES
// AVX2 main loop: 16 elements, i.e. one 64-byte cache line of each of the four streams,
// per iteration, each stream's two 8-float halves loaded and stored back to back. The
// vectorizer's loop (8 floats per iteration, the four streams interleaved) touches every
// line of every stream twice, alternating with the other streams. When the streams' addresses
// agree in their low 21 or more bits (equal-sized tensors allocated group after group, as
// benchmarks/host_adamw.py once did: p and g 2^28 bytes apart) their lines collide in the
// L1 data cache of AMD Zen CPUs and evict each other: the vectorizer's loop ran 4x slower on one Zen 3 core, 1.5x on two
// (the trivial rmw probe loop too). Whole lines at a time took one core from 4.2 to 2.3 ns
// per element there, and measured the same as the vectorizer's loop for other layouts. Same
// operations in the same order as adam_element (checked bitwise against the other targets
// by tests/test_host_adam.py).
template <typename GradT>
MC_ISA_ATTR inline __m256 load8_grad(const GradT* g);
template <>
MC_ISA_ATTR inline __m256 load8_grad<float>(const float* g) { return _mm256_loadu_ps(g); }
template <>
MC_ISA_ATTR inline __m256 load8_grad<c10::BFloat16>(const c10::BFloat16* g) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <int kWd, bool kMaximize, bool kSmallW1>
MC_ISA_ATTR inline __m256 adam8(__m256 gi, __m256 pi, __m256& mi, __m256& vi, const Coeffs& c) {
  if (kMaximize) gi = _mm256_xor_ps(gi, _mm256_set1_ps(-0.0f));
  if (kWd == kDecoupled) pi = _mm256_mul_ps(pi, _mm256_set1_ps(c.decay));
  if (kWd == kL2) gi = _mm256_fmadd_ps(pi, _mm256_set1_ps(c.wd), gi);
  const __m256 diff = _mm256_sub_ps(gi, mi);
  mi = kSmallW1 ? _mm256_fmadd_ps(_mm256_set1_ps(c.w1), diff, mi)
                : _mm256_fmadd_ps(_mm256_set1_ps(c.w1m1), diff, gi);
  vi = _mm256_mul_ps(vi, _mm256_set1_ps(c.beta2));
  vi = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(c.omb2), gi), gi, vi);
  const __m256 denom = _mm256_add_ps(
      _mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
  return _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.neg_step_size), mi), denom));
}
#endif

// One Adam update over n contiguous elements. The mode switches are template parameters
// so that the loop body the vectorizer sees is branch-free.
template <typename GradT, int kWd, bool kMaximize, bool kSmallW1>
MC_ISA_ATTR void adam_range(float* __restrict p, const void* g_erased, float* __restrict m,
                            float* __restrict v, int64_t n, const Coeffs& c) {
  const GradT* __restrict g = static_cast<const GradT*>(g_erased);
  int64_t i = 0;
#ifdef MC_ISA_AVX2_LINES
  for (; i + 16 <= n; i += 16) {
    const __m256 p0 = _mm256_loadu_ps(p + i), p1 = _mm256_loadu_ps(p + i + 8);
    const __m256 g0 = load8_grad(g + i), g1 = load8_grad(g + i + 8);
    __m256 m0 = _mm256_loadu_ps(m + i), m1 = _mm256_loadu_ps(m + i + 8);
    __m256 v0 = _mm256_loadu_ps(v + i), v1 = _mm256_loadu_ps(v + i + 8);
    const __m256 q0 = adam8<kWd, kMaximize, kSmallW1>(g0, p0, m0, v0, c);
    const __m256 q1 = adam8<kWd, kMaximize, kSmallW1>(g1, p1, m1, v1, c);
    _mm256_storeu_ps(p + i, q0);
    _mm256_storeu_ps(p + i + 8, q1);
    _mm256_storeu_ps(m + i, m0);
    _mm256_storeu_ps(m + i + 8, m1);
    _mm256_storeu_ps(v + i, v0);
    _mm256_storeu_ps(v + i + 8, v1);
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) adam_element<GradT, kWd, kMaximize, kSmallW1>(p, g, m, v, j, c);
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
