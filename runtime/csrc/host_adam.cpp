// Fused host (CPU) Adam / AdamW step for megacompile's host optimizer.
//
// Parameters, gradients and optimizer state of models larger than GPU memory live in
// host RAM, so the optimizer step runs on the CPU over the whole model every iteration.
// torch's single-tensor Adam makes ~10 passes over memory per tensor (one per pointwise
// op); this kernel makes one: it reads param, grad, exp_avg, exp_avg_sq and writes param,
// exp_avg, exp_avg_sq (16 bytes read + 12 bytes written per fp32 parameter), which makes
// it memory-bandwidth bound on any recent x86/ARM CPU.
//
// Numerics follow torch.optim.Adam/AdamW(foreach=False, capturable=False), i.e.
// torch/optim/adam.py:_single_tensor_adam, op by op and in the same float rounding order:
//
//   step_t += 1                                    (float32 step tensor)
//   AdamW:  param *= float(1 - lr*wd)              (mul by a scalar rounded to float)
//   Adam:   grad   = fma(param, float(wd), grad)   (add(param, alpha=wd); ATen's vector
//                                                   path evaluates a + alpha*b as an fma)
//   exp_avg = lerp(exp_avg, grad, float(1-beta1))  (ATen's vector lerp is an fma:
//             |w| < 0.5 ? fma(w, g-m, m) : fma(w-1, g-m, g))
//   exp_avg_sq = exp_avg_sq * float(beta2)
//   exp_avg_sq = fma(float(1-beta2)*g, g, exp_avg_sq)  (addcmul, contracted by ATen)
//   denom = sqrt(exp_avg_sq) / float(bias_correction2**0.5) + float(eps)
//   param = param + (float(-lr/bias_correction1) * exp_avg) / denom   (addcdiv)
//
// The scalar coefficients are computed in double exactly as the Python code does (same
// libm pow) and rounded to float once, as ATen does when it casts a Python scalar to the
// tensor's dtype. The whole file is compiled with -ffp-contract=off so that the compiler
// cannot fuse anything ATen does not fuse; the fmas above are spelled out with std::fma.
//
// The one intended difference: on MKL builds of torch (the x86 pip wheels) ATen's float32
// sqrt is MKL's vsSqrt (at::vml), which puts about 0.7% of results 1 ulp away from the
// correctly rounded value; we use the IEEE correctly rounded sqrt instruction. Elements
// where that matters differ from torch by about 1 ulp of the update. With a correctly
// rounded sqrt swapped into torch's op sequence the results are bitwise equal
// (tests/test_host_adam.py checks both).
//
// The file also contains STREAM-like loops (copy, triad, and a 4-read/3-write stream with
// Adam's access pattern) used only by benchmarks/host_adamw.py to measure the machine's
// memory bandwidth with the same compiler, flags and threading as the kernel.
//
// Ops are registered with TORCH_LIBRARY rather than pybind11: the dispatcher headers
// compile several times faster than <torch/extension.h> (the kernel is JIT-built on first
// use), and torch.ops calls release the GIL, so the host runtime's transfer threads keep
// running while the CPU does the step.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Elements per work item: 32K fp32 = 128 KiB per stream. Large enough that per-item
// overhead (one dynamic-schedule fetch) is negligible and the hardware prefetcher gets
// long runs, small enough that a 2..64-thread team load-balances over a model.
constexpr int64_t kChunk = 32768;
// Below this many elements in total, one thread is faster than waking the team.
constexpr int64_t kMinParallel = 65536;

enum WeightDecay : int { kNoDecay = 0, kDecoupled = 1, kL2 = 2 };

// Per-tensor float32 coefficients, rounded from double the way ATen rounds the Python
// scalars it receives.
struct Coeffs {
  float decay;          // 1 - lr*wd           (AdamW)
  float wd;             // wd                  (Adam's L2 term)
  float w1;             // 1 - beta1           (lerp weight)
  float w1m1;           // (1 - beta1) - 1, computed in float as ATen's vector lerp does
  float beta2;
  float omb2;           // 1 - beta2
  float bc2_sqrt;       // (1 - beta2**step) ** 0.5
  float eps;
  float neg_step_size;  // -(lr / (1 - beta1**step))
};

struct Hyper {
  double lr, beta1, beta2, eps, weight_decay;
};

Coeffs make_coeffs(const Hyper& h, double step) {
  // Same expressions, in the same order, as _single_tensor_adam with a float step.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bias_correction1;
  // Python's `x ** 0.5` calls libm pow, not sqrt; they can differ in the last bit.
  const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  Coeffs c;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.wd = static_cast<float>(h.weight_decay);
  c.w1 = static_cast<float>(1.0 - h.beta1);
  c.w1m1 = c.w1 - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.omb2 = static_cast<float>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

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
void adam_range(float* __restrict p, const GradT* __restrict g, float* __restrict m,
                float* __restrict v, int64_t n, const Coeffs& c) {
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

using RangeFn = void (*)(float*, const void*, float*, float*, int64_t, const Coeffs&);

template <typename GradT, int kWd, bool kMaximize, bool kSmallW1>
void adam_range_erased(float* p, const void* g, float* m, float* v, int64_t n,
                       const Coeffs& c) {
  adam_range<GradT, kWd, kMaximize, kSmallW1>(p, static_cast<const GradT*>(g), m, v, n, c);
}

template <typename GradT, int kWd>
RangeFn pick2(bool maximize, bool small_w1) {
  if (maximize) {
    return small_w1 ? adam_range_erased<GradT, kWd, true, true>
                    : adam_range_erased<GradT, kWd, true, false>;
  }
  return small_w1 ? adam_range_erased<GradT, kWd, false, true>
                  : adam_range_erased<GradT, kWd, false, false>;
}

template <typename GradT>
RangeFn pick1(int wd_mode, bool maximize, bool small_w1) {
  switch (wd_mode) {
    case kDecoupled: return pick2<GradT, kDecoupled>(maximize, small_w1);
    case kL2: return pick2<GradT, kL2>(maximize, small_w1);
    default: return pick2<GradT, kNoDecay>(maximize, small_w1);
  }
}

struct Item {
  int32_t tensor;
  int64_t begin, end;
};

// Splits tensors into kChunk-sized items (chunk starts stay 64-byte aligned relative to
// the tensor start, so two threads never write the same cache line).
std::vector<Item> make_items(const std::vector<int64_t>& numels, int64_t* total) {
  std::vector<Item> items;
  int64_t sum = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += kChunk) {
      items.push_back({static_cast<int32_t>(t), b, std::min(numels[t], b + kChunk)});
    }
    sum += numels[t];
  }
  *total = sum;
  return items;
}

int resolve_threads(int64_t num_threads) {
  // Default to torch's intra-op thread count (torch.set_num_threads). The extension
  // links libgomp.so.1, which resolves to the copy torch already loaded, so this is the
  // same thread pool torch's own CPU ops use.
  return num_threads > 0 ? static_cast<int>(num_threads) : at::get_num_threads();
}

// Runs fn(item) over all items, in parallel when the work is large enough.
template <typename F>
void for_items(const std::vector<Item>& items, int64_t total, int64_t num_threads, const F& fn) {
  const int nt = resolve_threads(num_threads);
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (nt <= 1 || total < kMinParallel || n_items <= 1) {
    for (int64_t i = 0; i < n_items; ++i) fn(items[i]);
    return;
  }
  // Dynamic scheduling: items differ in size (small bias/norm tensors), and on a shared
  // machine one thread may be descheduled for a while.
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t i = 0; i < n_items; ++i) fn(items[i]);
}

void check_state(const at::Tensor& t, const char* what, size_t i) {
  TORCH_CHECK(t.device().is_cpu(), "host_adam: ", what, "[", i, "] must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "host_adam: ", what, "[", i,
              "] must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "host_adam: ", what, "[", i, "] must be contiguous");
}

// The one entry for both a single tensor and a whole parameter group (lists of length 1 or
// N): one dispatcher call and one OpenMP region per group, however many tensors it has.
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::ArrayRef<double> steps, double lr,
               double beta1, double beta2, double eps, double weight_decay, bool decoupled,
               bool maximize, int64_t num_threads) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "host_adam: params, grads, exp_avgs, exp_avg_sqs must have the same length");
  TORCH_CHECK(steps.size() == n || steps.size() == 1,
              "host_adam: steps must have one value per tensor or a single value");
  const Hyper h{lr, beta1, beta2, eps, weight_decay};
  const int wd_mode = weight_decay == 0.0 ? kNoDecay : (decoupled ? kDecoupled : kL2);
  const bool small_w1 = std::abs(static_cast<float>(1.0 - beta1)) < 0.5f;

  std::vector<int64_t> numels(n);
  std::vector<Coeffs> coeffs(n);
  std::vector<RangeFn> fns(n);
  std::vector<float*> pp(n), mp(n), vp(n);
  std::vector<const void*> gp(n);
  std::vector<int64_t> gsize(n);
  for (size_t i = 0; i < n; ++i) {
    check_state(params[i], "params", i);
    check_state(exp_avgs[i], "exp_avgs", i);
    check_state(exp_avg_sqs[i], "exp_avg_sqs", i);
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous(),
                "host_adam: grads[", i, "] must be a contiguous CPU tensor");
    const int64_t numel = params[i].numel();
    TORCH_CHECK(g.numel() == numel && exp_avgs[i].numel() == numel &&
                    exp_avg_sqs[i].numel() == numel,
                "host_adam: tensor ", i, " has mismatched sizes");
    if (g.scalar_type() == at::kFloat) {
      fns[i] = pick1<float>(wd_mode, maximize, small_w1);
    } else if (g.scalar_type() == at::kBFloat16) {
      fns[i] = pick1<c10::BFloat16>(wd_mode, maximize, small_w1);
    } else {
      TORCH_CHECK(false, "host_adam: grads[", i, "] must be float32 or bfloat16, got ",
                  g.scalar_type());
    }
    numels[i] = numel;
    coeffs[i] = make_coeffs(h, steps.size() == 1 ? steps[0] : steps[i]);
    pp[i] = params[i].data_ptr<float>();
    mp[i] = exp_avgs[i].data_ptr<float>();
    vp[i] = exp_avg_sqs[i].data_ptr<float>();
    gp[i] = g.data_ptr();
    gsize[i] = g.element_size();
  }

  int64_t total = 0;
  const std::vector<Item> items = make_items(numels, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
    const int64_t b = it.begin;
    const size_t t = static_cast<size_t>(it.tensor);
    fns[t](pp[t] + b, static_cast<const char*>(gp[t]) + b * gsize[t], mp[t] + b, vp[t] + b,
           it.end - b, coeffs[t]);
  });

  // Writing through data pointers bypasses ATen's in-place ops, which would have bumped
  // the version counters that autograd uses to detect tensors modified after being saved
  // for backward. Keep that safety net: torch.optim's update bumps them too.
  for (size_t i = 0; i < n; ++i) {
    params[i].unsafeGetTensorImpl()->bump_version();
    exp_avgs[i].unsafeGetTensorImpl()->bump_version();
    exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
  }
}

// Increments torch-style step tensors (0-dim, usually float32) in place, as
// `step_t += 1` does, and returns the new values for adam_step. One call for a whole
// parameter group instead of one Python op + .item() per tensor.
std::vector<double> increment_steps(at::TensorList steps) {
  std::vector<double> out;
  out.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK(s.device().is_cpu() && s.numel() == 1,
                "host_adam: steps[", i, "] must be a one-element CPU tensor");
    if (s.scalar_type() == at::kFloat) {
      float* ptr = s.data_ptr<float>();
      *ptr += 1.0f;
      out.push_back(*ptr);
    } else if (s.scalar_type() == at::kDouble) {
      double* ptr = s.data_ptr<double>();
      *ptr += 1.0;
      out.push_back(*ptr);
    } else {
      TORCH_CHECK(false, "host_adam: steps[", i, "] must be float32 or float64, got ",
                  s.scalar_type());
    }
    s.unsafeGetTensorImpl()->bump_version();  // as `step_t += 1` would
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Bandwidth probes for the benchmark (same compiler flags and thread pool as the kernel).

void check_stream(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "host_adam stream: tensors must be contiguous float32 CPU tensors");
}

// a = b (8 bytes moved per element, STREAM counting).
void stream_copy(at::Tensor a, const at::Tensor& b, int64_t num_threads) {
  check_stream(a);
  check_stream(b);
  TORCH_CHECK(a.numel() == b.numel(), "stream_copy: size mismatch");
  float* __restrict pa = a.data_ptr<float>();
  const float* __restrict pb = b.data_ptr<float>();
  int64_t total = 0;
  const auto items = make_items({a.numel()}, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
#pragma omp simd
    for (int64_t i = it.begin; i < it.end; ++i) pa[i] = pb[i];
  });
}

// a = b + s*c (12 bytes moved per element, STREAM counting).
void stream_triad(at::Tensor a, const at::Tensor& b, const at::Tensor& c, double s,
                  int64_t num_threads) {
  check_stream(a);
  check_stream(b);
  check_stream(c);
  TORCH_CHECK(a.numel() == b.numel() && a.numel() == c.numel(), "stream_triad: size mismatch");
  float* __restrict pa = a.data_ptr<float>();
  const float* __restrict pb = b.data_ptr<float>();
  const float* __restrict pc = c.data_ptr<float>();
  const float fs = static_cast<float>(s);
  int64_t total = 0;
  const auto items = make_items({a.numel()}, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
#pragma omp simd
    for (int64_t i = it.begin; i < it.end; ++i) pa[i] = pb[i] + fs * pc[i];
  });
}

// Adam's access pattern with trivial arithmetic: read p, g, m, v; write p, m, v
// (28 bytes per element). The best an optimizer step could do on this machine.
void stream_rmw(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v,
                int64_t num_threads) {
  check_stream(p);
  check_stream(g);
  check_stream(m);
  check_stream(v);
  TORCH_CHECK(p.numel() == g.numel() && p.numel() == m.numel() && p.numel() == v.numel(),
              "stream_rmw: size mismatch");
  float* __restrict pp = p.data_ptr<float>();
  const float* __restrict pg = g.data_ptr<float>();
  float* __restrict pm = m.data_ptr<float>();
  float* __restrict pv = v.data_ptr<float>();
  int64_t total = 0;
  const auto items = make_items({p.numel()}, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
#pragma omp simd
    for (int64_t i = it.begin; i < it.end; ++i) {
      const float gi = pg[i];
      pp[i] += gi;
      pm[i] += gi;
      pv[i] += gi;
    }
  });
}

}  // namespace

// A namespace of our own: TORCH_LIBRARY may define a namespace only once per process, and
// other megacompile extensions may register their own.
TORCH_LIBRARY(megacompile_host_adam, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float[] steps, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool decoupled, bool maximize, int num_threads=0) -> ()");
  m.def("increment_steps(Tensor(a!)[] steps) -> float[]");
  m.def("stream_copy(Tensor(a!) a, Tensor b, int num_threads=0) -> ()");
  m.def("stream_triad(Tensor(a!) a, Tensor b, Tensor c, float s, int num_threads=0) -> ()");
  m.def(
      "stream_rmw(Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v, "
      "int num_threads=0) -> ()");
}

TORCH_LIBRARY_IMPL(megacompile_host_adam, CPU, m) {
  m.impl("adam_step", adam_step);
  m.impl("increment_steps", increment_steps);
  m.impl("stream_copy", stream_copy);
  m.impl("stream_triad", stream_triad);
  m.impl("stream_rmw", stream_rmw);
}
