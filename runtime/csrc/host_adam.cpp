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
// sqrt is MKL's vsSqrt (at::vml) in its default "HA" mode, documented to be within 1 ulp
// of the exact root but not correctly rounded: measured, 0.7% of results are the other
// neighbour of the exact root on an Intel Xeon and 17% on an AMD EPYC (Zen 3), where MKL
// runs another code path (error up to 0.75 ulp). We use the IEEE correctly rounded sqrt
// instruction. Elements where that matters differ from torch by about 1 ulp of the update
// (tests/test_host_adam.py derives and asserts the bound); with a correctly rounded sqrt
// swapped into torch's op sequence the results are bitwise equal.
//
// Instruction sets: the library is compiled without -march, so its numerics do not depend
// on the machine that built it. The loops (host_adam_isa.h) are compiled several times
// with function target attributes: baseline x86-64, x86-64-v3 (AVX2+FMA) and x86-64-v4
// (AVX-512); the best the running CPU supports is used unless the caller names one. All
// operations above are correctly rounded IEEE operations (no reductions, no reciprocal
// approximations), so every target gives bitwise the same result.
//
// The file also contains STREAM-like loops (copy, triad, and a 4-read/3-write stream with
// Adam's access pattern) used only by benchmarks/host_adamw.py to measure the machine's
// memory bandwidth with the same compiler, flags, vector target and threading as the kernel.
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
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
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

using RangeFn = void (*)(float*, const void*, float*, float*, int64_t, const Coeffs&);

// What each instruction-set target provides (host_adam_isa.h fills it in).
struct IsaKernels {
  RangeFn (*pick_adam)(bool bf16_grad, int wd_mode, bool maximize, bool small_w1);
  void (*copy)(float*, const float*, int64_t);
  void (*triad)(float*, const float*, const float*, float, int64_t);
  void (*rmw)(float*, const float*, float*, float*, int64_t);
};

// ---------------------------------------------------------------------------------------
// Instruction-set targets. The library is built without -march (it runs on any CPU of its
// architecture) and holds one copy of the loops per target, each compiled with a function
// target attribute; the best one the running CPU supports is used unless the caller names
// one. On x86-64 the targets are the psABI levels:
//   x86-64     baseline (SSE2; std::fma is glibc's correctly rounded fmaf)
//   x86-64-v3  AVX2 + FMA, 256-bit vectors
//   x86-64-v4  AVX-512 (F, VL, BW, DQ, CD), 512-bit vectors
// Elsewhere there is one target, "default". MEGACOMPILE_HOST_ADAM_BASELINE_ONLY builds the
// baseline alone (host_adam.py's fallback for a compiler that rejects the attributes).

namespace isa_baseline {
#define MC_ISA_ATTR
#include "host_adam_isa.h"
#undef MC_ISA_ATTR
}  // namespace isa_baseline

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(MEGACOMPILE_HOST_ADAM_BASELINE_ONLY)
#define MC_X86_TARGETS 1
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
// GCC 12 knows the psABI levels both as target attributes and in __builtin_cpu_supports.
#define MC_V3_ATTR __attribute__((target("arch=x86-64-v3")))
#define MC_V4_ATTR __attribute__((target("arch=x86-64-v4,prefer-vector-width=512")))
bool cpu_has_v3() { return __builtin_cpu_supports("x86-64-v3"); }
bool cpu_has_v4() { return __builtin_cpu_supports("x86-64-v4"); }
#else
// Other compilers: the subset of each level the loops can use, checked feature by feature.
#define MC_V3_ATTR __attribute__((target("avx2,fma")))
#define MC_V4_ATTR __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512cd,avx2,fma")))
bool cpu_has_v3() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool cpu_has_v4() {
  return cpu_has_v3() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd");
}
#endif

namespace isa_x86_64_v3 {
#define MC_ISA_ATTR MC_V3_ATTR
#define MC_ISA_AVX2_LINES 1
#include "host_adam_isa.h"
#undef MC_ISA_AVX2_LINES
#undef MC_ISA_ATTR
}  // namespace isa_x86_64_v3

namespace isa_x86_64_v4 {
#define MC_ISA_ATTR MC_V4_ATTR
#include "host_adam_isa.h"
#undef MC_ISA_ATTR
}  // namespace isa_x86_64_v4
#endif  // MC_X86_TARGETS

bool cpu_has_baseline() { return true; }

struct Target {
  const char* name;
  bool (*cpu_ok)();  // may this CPU execute the target's instructions?
  IsaKernels kernels;
};

// Compiled targets, from the most portable to the fastest.
const std::vector<Target>& all_targets() {
  static const std::vector<Target> targets = [] {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_cpu_init();
#endif
    std::vector<Target> t;
#if defined(__x86_64__)
    t.push_back({"x86-64", cpu_has_baseline, isa_baseline::kernels()});
#else
    t.push_back({"default", cpu_has_baseline, isa_baseline::kernels()});
#endif
#ifdef MC_X86_TARGETS
    t.push_back({"x86-64-v3", cpu_has_v3, isa_x86_64_v3::kernels()});
    t.push_back({"x86-64-v4", cpu_has_v4, isa_x86_64_v4::kernels()});
#endif
    return t;
  }();
  return targets;
}

const Target& best_target() {
  static const Target* best = [] {
    const Target* b = nullptr;
    for (const Target& t : all_targets()) {
      if (t.cpu_ok()) b = &t;
    }
    return b;
  }();
  return *best;
}

// "" picks the best target for this CPU; a name must be compiled in and runnable here
// (running AVX-512 code on a CPU without it would die of SIGILL, so this is checked).
const Target& resolve_target(const std::string& name) {
  if (name.empty()) return best_target();
  std::string known;
  for (const Target& t : all_targets()) {
    if (name == t.name) {
      TORCH_CHECK(t.cpu_ok(), "host_adam: target '", name,
                  "' is compiled in, but this CPU cannot execute it (best here: '",
                  best_target().name, "')");
      return t;
    }
    known += known.empty() ? "" : ", ";
    known += t.name;
  }
  TORCH_CHECK(false, "host_adam: unknown target '", name, "' (compiled: ", known, ")");
}

std::vector<std::string> compiled_targets() {
  std::vector<std::string> out;
  for (const Target& t : all_targets()) out.push_back(t.name);
  return out;
}

std::vector<std::string> cpu_targets() {
  std::vector<std::string> out;
  for (const Target& t : all_targets()) {
    if (t.cpu_ok()) out.push_back(t.name);
  }
  return out;
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

// float32 -> bfloat16, rounded to nearest even (what `tensor.to(torch.bfloat16)` does); a NaN
// stays a NaN. Integer arithmetic only, so every target gives the same bits.
inline uint16_t to_bf16_bits(float f) {
  if (std::isnan(f)) return static_cast<uint16_t>(0x7FC0);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t round_even = ((bits >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((bits + round_even) >> 16);
}

// Writes the bf16 copy of p[0, n): run right after a chunk's update, while the chunk is
// still in cache, so the copy costs no second pass over memory.
void write_bf16(uint16_t* __restrict out, const float* __restrict p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16_bits(p[i]);
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
               bool maximize, int64_t num_threads, std::string target,
               at::TensorList bf16_copies) {
  const size_t n = params.size();
  const IsaKernels& isa = resolve_target(target).kernels;
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "host_adam: params, grads, exp_avgs, exp_avg_sqs must have the same length");
  TORCH_CHECK(steps.size() == n || steps.size() == 1,
              "host_adam: steps must have one value per tensor or a single value");
  // Optional: one bf16 tensor per param, rewritten with the updated param's bf16 value.
  TORCH_CHECK(bf16_copies.empty() || bf16_copies.size() == n,
              "host_adam: bf16_copies must be empty or have one tensor per param");
  const Hyper h{lr, beta1, beta2, eps, weight_decay};
  const int wd_mode = weight_decay == 0.0 ? kNoDecay : (decoupled ? kDecoupled : kL2);
  const bool small_w1 = std::abs(static_cast<float>(1.0 - beta1)) < 0.5f;

  std::vector<int64_t> numels(n);
  std::vector<Coeffs> coeffs(n);
  std::vector<RangeFn> fns(n);
  std::vector<float*> pp(n), mp(n), vp(n);
  std::vector<const void*> gp(n);
  std::vector<int64_t> gsize(n);
  std::vector<uint16_t*> cp(n, nullptr);
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
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16,
                "host_adam: grads[", i, "] must be float32 or bfloat16, got ", g.scalar_type());
    fns[i] = isa.pick_adam(g.scalar_type() == at::kBFloat16, wd_mode, maximize, small_w1);
    numels[i] = numel;
    coeffs[i] = make_coeffs(h, steps.size() == 1 ? steps[0] : steps[i]);
    pp[i] = params[i].data_ptr<float>();
    mp[i] = exp_avgs[i].data_ptr<float>();
    vp[i] = exp_avg_sqs[i].data_ptr<float>();
    gp[i] = g.data_ptr();
    gsize[i] = g.element_size();
    if (!bf16_copies.empty()) {
      const at::Tensor& c = bf16_copies[i];
      TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.scalar_type() == at::kBFloat16 &&
                      c.numel() == numel,
                  "host_adam: bf16_copies[", i, "] must be a contiguous bfloat16 CPU tensor of ",
                  numel, " elements");
      cp[i] = reinterpret_cast<uint16_t*>(c.data_ptr());
    }
  }

  int64_t total = 0;
  const std::vector<Item> items = make_items(numels, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
    const int64_t b = it.begin;
    const size_t t = static_cast<size_t>(it.tensor);
    fns[t](pp[t] + b, static_cast<const char*>(gp[t]) + b * gsize[t], mp[t] + b, vp[t] + b,
           it.end - b, coeffs[t]);
    if (cp[t] != nullptr) write_bf16(cp[t] + b, pp[t] + b, it.end - b);
  });

  // Writing through data pointers bypasses ATen's in-place ops, which would have bumped
  // the version counters that autograd uses to detect tensors modified after being saved
  // for backward. Keep that safety net: torch.optim's update bumps them too.
  for (size_t i = 0; i < n; ++i) {
    params[i].unsafeGetTensorImpl()->bump_version();
    exp_avgs[i].unsafeGetTensorImpl()->bump_version();
    exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
    if (!bf16_copies.empty()) bf16_copies[i].unsafeGetTensorImpl()->bump_version();
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
void stream_copy(at::Tensor a, const at::Tensor& b, int64_t num_threads, std::string target) {
  const IsaKernels& isa = resolve_target(target).kernels;
  check_stream(a);
  check_stream(b);
  TORCH_CHECK(a.numel() == b.numel(), "stream_copy: size mismatch");
  float* __restrict pa = a.data_ptr<float>();
  const float* __restrict pb = b.data_ptr<float>();
  int64_t total = 0;
  const auto items = make_items({a.numel()}, &total);
  for_items(items, total, num_threads, [&](const Item& it) {
    isa.copy(pa + it.begin, pb + it.begin, it.end - it.begin);
  });
}

// a = b + s*c (12 bytes moved per element, STREAM counting).
void stream_triad(at::Tensor a, const at::Tensor& b, const at::Tensor& c, double s,
                  int64_t num_threads, std::string target) {
  const IsaKernels& isa = resolve_target(target).kernels;
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
    isa.triad(pa + it.begin, pb + it.begin, pc + it.begin, fs, it.end - it.begin);
  });
}

// Adam's access pattern with trivial arithmetic: read p, g, m, v; write p, m, v
// (28 bytes per element). The best an optimizer step could do on this machine.
void stream_rmw(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v,
                int64_t num_threads, std::string target) {
  const IsaKernels& isa = resolve_target(target).kernels;
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
    const int64_t b = it.begin;
    isa.rmw(pp + b, pg + b, pm + b, pv + b, it.end - b);
  });
}

}  // namespace

// A namespace of our own: TORCH_LIBRARY may define a namespace only once per process, and
// other megacompile extensions may register their own.
TORCH_LIBRARY(megacompile_host_adam, m) {
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, float[] steps, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool decoupled, bool maximize, int num_threads=0, "
      "str target=\"\", Tensor(d!)[] bf16_copies) -> ()");
  m.def("increment_steps(Tensor(a!)[] steps) -> float[]");
  // No tensor arguments, nothing to dispatch on: one kernel for every backend.
  m.def("compiled_targets() -> str[]", compiled_targets);
  m.def("cpu_targets() -> str[]", cpu_targets);
  m.def("stream_copy(Tensor(a!) a, Tensor b, int num_threads=0, str target=\"\") -> ()");
  m.def(
      "stream_triad(Tensor(a!) a, Tensor b, Tensor c, float s, int num_threads=0, "
      "str target=\"\") -> ()");
  m.def(
      "stream_rmw(Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v, "
      "int num_threads=0, str target=\"\") -> ()");
}

TORCH_LIBRARY_IMPL(megacompile_host_adam, CPU, m) {
  m.impl("adam_step", adam_step);
  m.impl("increment_steps", increment_steps);
  m.impl("stream_copy", stream_copy);
  m.impl("stream_triad", stream_triad);
  m.impl("stream_rmw", stream_rmw);
}
