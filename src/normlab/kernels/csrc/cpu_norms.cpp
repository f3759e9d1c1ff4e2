// normlab's CPU kernels: the element-wise norms (DyT, Derf, DyISRU, ELN) and RMSNorm, forward and backward.
//
// Built once per machine by normlab/kernels/cpu_build.py and loaded with torch.ops.load_library; the
// autograd functions live in normlab/kernels/cpu.py, which also states the formulas.
//
// Layout: x, g (= dL/dy) and y are (N, C) row-major in float32, bfloat16 or float16. Every parameter
// arrives as a float32 (C,) vector (a scalar parameter expanded; the channel scale folded into w).
// Arithmetic is float32 in at::vec::Vectorized registers. The build passes -ffp-contract=off: every fused
// multiply-add is written (at::vec::fmadd, fnmadd), none is the compiler's choice, so the same function gives the
// same bits wherever it is inlined (the forward's f and the backward's recomputed f; an AVX2 build differed).
//
// The backward is one pass over x and g: a task owns a contiguous block of rows, writes their dx and adds
// their parameter-gradient terms into its own float32 (C,) partial sums; the partials are added in task
// order at the end. The blocks depend only on N and the thread count, so a result is the same on every run
// with the same thread count.

#include <limits>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t VL = Vec::size();

enum Kind : int64_t { DYT = 0, DERF = 1, DYISRU = 2, ELN = 3 };

// ---------------------------------------------------------------------------------------------------------
// loads and stores of up to VL elements, converted to and from float32
// ---------------------------------------------------------------------------------------------------------
template <typename T>
inline Vec load(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n == VL ? Vec::loadu(p) : Vec::loadu(p, n);
  } else {
    if (n == VL) {
      Vec out;
      at::vec::load_to_float<T>(p, out);
      return out;
    }
    float buf[VL] = {0};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
  }
}

template <typename T>
inline void store(T* p, const Vec& v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
    if (n == VL) {
#if defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512BF16__)
      // one instruction, rounding to nearest even as ATen's conversion; it flushes denormal results to zero and
      // quiets NaN, so a vector holding a denormal takes ATen's conversion (NaN stays NaN either way)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (_mm512_fpclass_ps_mask(__m512(v), 0x20) == 0) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(__m512(v)));
          return;
        }
      }
#endif
      const __m256i h = std::is_same_v<T, c10::BFloat16> ? at::vec::cvtfp32_bf16(__m512(v))
                                                         : at::vec::cvtfp32_fp16(__m512(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
#elif defined(CPU_CAPABILITY_AVX2)
      const __m128i h = std::is_same_v<T, c10::BFloat16> ? at::vec::cvtfp32_bf16(__m256(v))
                                                         : at::vec::cvtfp32_fp16(__m256(v));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
#else
      at::vec::convert_from_float<T>(v, v).store(p, VL);
#endif
      return;
    }
    float buf[VL];
    v.store(buf);
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(buf[i]);
  }
}

// ---------------------------------------------------------------------------------------------------------
// the functions
// ---------------------------------------------------------------------------------------------------------
// 1 / d and 1 / sqrt(v) to about 1 float32 ulp: the hardware estimate (12 bits on AVX2, 14 on AVX-512) and one
// Newton step, in place of a division (ATen's AVX-512 rsqrt is a square root and a division). Used where the operand
// is finite and positive.
inline Vec recip(const Vec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const Vec r(_mm512_rcp14_ps(d));
  return r * at::vec::fnmadd(d, r, Vec(2.0f));
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec r(_mm256_rcp_ps(d));
  return r * at::vec::fnmadd(d, r, Vec(2.0f));
#else
  return d.reciprocal();
#endif
}

// The estimate reads a denormal operand as 0 (and gives inf): below float32's smallest normal the operand is
// scaled by 2^64 first and the result by 2^32, so a denormal beta (which init accepts) gives the reference's answer.
inline Vec rsqrt_(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
  const __m512 vs = _mm512_mask_mul_ps(v, tiny, v, _mm512_set1_ps(18446744073709551616.0f));
  const __m512 r = _mm512_rsqrt14_ps(vs);
  const __m512 y = _mm512_mul_ps(r, _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), vs), _mm512_mul_ps(r, r),
                                                     _mm512_set1_ps(1.5f)));
  return Vec(_mm512_mask_mul_ps(y, tiny, y, _mm512_set1_ps(4294967296.0f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec tiny = v < Vec(1.17549435e-38f);
  const Vec vs = Vec::blendv(v, v * Vec(18446744073709551616.0f), tiny);
  const Vec r(_mm256_rsqrt_ps(vs));
  const Vec y = r * at::vec::fnmadd(Vec(0.5f) * vs, r * r, Vec(1.5f));
  return Vec::blendv(y, y * Vec(4294967296.0f), tiny);
#else
  return v.rsqrt();
#endif
}

// tanh and erf as odd rationals, z P(z^2) / Q(z^2), one accuracy per storage dtype. The coefficients and clamps were
// fitted by scripts/fit_rationals.py (Lawson's algorithm on the maximum relative error; P(0) is the exact slope at 0,
// so a tiny z keeps full relative accuracy down to the denormals), and the bounds below are what
// tests/kernels/test_cpu_edges.py measures against float64 from denormals to infinity, as relative errors of
// the float32 result before any rounding to the output dtype (eps = 2^-23):
//
//   float32 input          tanh: [4/4] rational, z clamped to +-9.14   bound 4 eps
//                          erf:  [5/5] rational, z clamped to +-4.01   bound 4 eps
//   bfloat16 / float16     tanh: [3/3] rational, z clamped to +-7.05   bound 2^-12 (1.6e-6 measured)
//                          erf:  [3/3] rational, z clamped to +-3.32   bound 2^-12 (2.9e-6 measured)
//
// Each rational rises a little above 1 before it turns back down, and its clamp is a point where it is already two
// float32 ulps above 1: f = min(max(r(clamp(z)), -1), 1) is exactly sign(z) for every |z| beyond the clamp, so the
// derivative 1 - f^2 (computed from the same f, as in the backward) is exactly 0 there, as the reference's, and
// |f| <= 1 everywhere (1 - f^2 is never negative). Two clamps, no comparison and blend: three vector operations
// fewer than testing |z| against a cut, in a function that bounds the bfloat16 kernels' time (docs/kernels.md).
// The division is `recip`'s estimate and Newton step in every dtype: its ulp or so over an exact division (whose
// fit alone reached 2.2 and 2.7 eps in float32) keeps float32 inside 4 eps. (On the AMD EPYC VM the two forms ran at
// the same speed within its noise: docs/kernels.md, "AVX-512 reciprocals".)
// A bfloat16 or float16 output cannot hold more than 8 or 11 bits, so its cheaper forms stay well inside the
// output's own rounding; they are kept a decade below 2^-12 because a parameter's gradient sums 1 - f^2 over
// every element, where an error of one sign would add up (a [2/2] tanh at 9e-5 broke the bf16 alpha gradient).
// The max and min take z (and r) as their second operand, which x86 returns when either is NaN: a NaN z stays NaN.
// +-inf gives +-1, -0 gives -0 (the rational is odd).
template <size_t NP, size_t NQ>
inline Vec odd_saturating(const Vec& z, const float (&p)[NP], const float (&q)[NQ], float clamp) {
#if defined(CPU_CAPABILITY_AVX512)
  const Vec a(_mm512_min_ps(_mm512_set1_ps(clamp), _mm512_max_ps(_mm512_set1_ps(-clamp), z)));
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec a(_mm256_min_ps(_mm256_set1_ps(clamp), _mm256_max_ps(_mm256_set1_ps(-clamp), z)));
#else
  const Vec a = Vec::blendv(at::vec::clamp(z, Vec(-clamp), Vec(clamp)), z, z != z);  // ATen's portable vectors
#endif
  const Vec s = a * a;
  Vec num(p[NP - 1]), den(q[NQ - 1]);
  for (size_t k = NP - 1; k-- > 0;) num = at::vec::fmadd(num, s, Vec(p[k]));
  for (size_t k = NQ - 1; k-- > 0;) den = at::vec::fmadd(den, s, Vec(q[k]));
  const Vec r = a * num * recip(den);
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_min_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(_mm512_set1_ps(-1.0f), r)));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_min_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(_mm256_set1_ps(-1.0f), r)));
#else
  return Vec::blendv(at::vec::clamp(r, Vec(-1.0f), Vec(1.0f)), r, r != r);
#endif
}

constexpr float TANH32_P[] = {1.0f, 0.133839712f, 0.0034989845f, 2.06610694e-05f, 1.34195508e-08f};
constexpr float TANH32_Q[] = {1.0f, 0.467172921f, 0.0258901622f, 0.000329101924f, 7.80461903e-07f};
constexpr float TANH16_P[] = {1.0f, 0.123300821f, 0.00229965337f, 4.0229761e-06f};
constexpr float TANH16_Q[] = {1.0f, 0.456628919f, 0.0211838465f, 0.00014465375f};
constexpr float ERF32_P[] = {1.12837923f,     0.189880744f,    0.0526794307f,
                             0.00374288228f, 0.000284338428f, 2.05385072e-06f};
constexpr float ERF32_Q[] = {1.0f, 0.501610398f, 0.113891855f, 0.0149240913f, 0.00115693919f, 3.81018981e-05f};
constexpr float ERF16_P[] = {1.12837923f, 0.154685035f, 0.0431260765f, 0.000744810852f};
constexpr float ERF16_Q[] = {1.0f, 0.470437378f, 0.0949267671f, 0.00925597362f};
constexpr float TANH32_CLAMP = 9.14f, TANH16_CLAMP = 7.05f, ERF32_CLAMP = 4.01f, ERF16_CLAMP = 3.32f;

template <typename T>
inline Vec tanh_(const Vec& z) {
  if constexpr (std::is_same_v<T, float>) return odd_saturating(z, TANH32_P, TANH32_Q, TANH32_CLAMP);
  return odd_saturating(z, TANH16_P, TANH16_Q, TANH16_CLAMP);
}

template <typename T>
inline Vec erf_(const Vec& z) {
  if constexpr (std::is_same_v<T, float>) return odd_saturating(z, ERF32_P, ERF32_Q, ERF32_CLAMP);
  return odd_saturating(z, ERF16_P, ERF16_Q, ERF16_CLAMP);
}

// DyISRU's pieces: f = u h, h = (beta + u^2)^(-1/2) (the slope df/du is beta h^3). Beyond float32's square root of
// its largest value u^2 overflows: there f = sign(u) and h = 0, so the slope is 0.
struct Isru {
  Vec f, h;
};
inline Isru isru(const Vec& u, const Vec& beta) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 sign_bit = _mm512_castsi512_ps(_mm512_set1_epi32(0x80000000));
  const __mmask16 big = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign_bit, u), _mm512_set1_ps(1e18f), _CMP_GT_OQ);
  const __m512 h = _mm512_maskz_mov_ps(_knot_mask16(big), rsqrt_(at::vec::fmadd(u, u, beta)));
  const __m512 sign = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(sign_bit, u));
  return {Vec(_mm512_mask_blend_ps(big, _mm512_mul_ps(u, h), sign)), Vec(h)};
#else
  const Vec big = u.abs() > Vec(1e18f);
  const Vec h = Vec::blendv(rsqrt_(at::vec::fmadd(u, u, beta)), Vec(0.0f), big);
  const Vec sign = Vec::blendv(Vec(1.0f), Vec(-1.0f), u < Vec(0.0f));
  return {Vec::blendv(u * h, sign, big), h};
#endif
}

constexpr float TWO_OVER_SQRT_PI = 1.1283791670955126f;

// exp(-z^2), Derf's derivative without its 2/sqrt(pi): 2^n e^r with n = round(-z^2 log2(e)) and r = -z^2 - n ln 2
// (ln 2 in two parts, so that r keeps float32's accuracy), e^r by ATen's degree-5 minimax of exp on [-ln2/2, ln2/2]
// (the coefficients of its exp_u20), and 2^n by vscalefps, exact down to the denormals and to 0: twelve operations,
// where exp_u20 takes about twenty and a NaN fix-up, and flushes results below exp(-87.3) to 0. -z^2 is first raised
// to -110 (float32's exp is 0 below -103.3): an infinite z gives 0. A NaN z gives NaN (max passes its second
// operand's NaN).
inline Vec exp_neg_sq(const Vec& z) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-110.0f), _mm512_mul_ps(_mm512_set1_ps(-1.0f), _mm512_mul_ps(z, z)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), t);  // ln 2 = 0.693145752 + 1.42860682e-6
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682e-06f), r);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
  return Vec(_mm512_scalef_ps(p, n));
#else
  return (-(z * z)).exp();  // ATen's accurate exp (Sleef's, 1 ulp): exp_u20 flushes results below exp(-87.3) to 0
#endif
}

// ---------------------------------------------------------------------------------------------------------
// threading: blocks of rows, one per task, fixed by N and the thread count
// ---------------------------------------------------------------------------------------------------------
inline int64_t grain_rows(int64_t c) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(c, 1)); }

inline int64_t n_blocks(int64_t n, int64_t c) {
  const int64_t most = (n + grain_rows(c) - 1) / grain_rows(c);
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), most));
}

template <typename F>
inline void for_blocks(int64_t n, int64_t blocks, const F& body) {
  // one task per block: body(block, first row, end row)
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) body(b, n * b / blocks, n * (b + 1) / blocks);
  });
}

// ELN centres each row: a row holding inf or NaN has no finite mean, and the whole row is NaN (as the reference's)
inline float finite_or_nan(float m) { return std::isfinite(m) ? m : std::numeric_limits<float>::quiet_NaN(); }

// The lanes of v added as a tree (halves, then quarters, ...): every lane sum of the kernels (row means, sums of
// squares, the backward's row sums). ATen's portable vec_reduce_all adds them one after the other, which does not
// give 8x for eight lanes of x: the mean of a row of equal huge values was then not the value, and ELN's x - mean,
// which should be 0, came out as 7e10 at 1e18 (f = 1 instead of 0).
inline float sum_lanes(const Vec& v) {
  float a[VL];
  v.store(a);
  for (int64_t w = VL / 2; w > 0; w /= 2)
    for (int64_t i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

template <typename T>
inline float row_mean(const T* x, int64_t c) {
  Vec acc(0.0f);
  for (int64_t j = 0; j < c; j += VL) acc = acc + load(x + j, std::min(VL, c - j));  // tails load as zeros
  return sum_lanes(acc) / static_cast<float>(c);
}

template <typename T>
inline float row_sumsq(const T* x, int64_t c) {
  Vec acc(0.0f);
  for (int64_t j = 0; j < c; j += VL) {
    const Vec v = load(x + j, std::min(VL, c - j));
    acc = at::vec::fmadd(v, v, acc);
  }
  return sum_lanes(acc);
}

void check_rows(const Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), "normlab cpu kernel: ", what,
              " must be a contiguous CPU (N, C) tensor");
}

// ---------------------------------------------------------------------------------------------------------
// the element-wise family: y = scale w f(x; p0, p1) + b
// ---------------------------------------------------------------------------------------------------------
// A parameter as the kernels read it, without copying it into a (C,) vector: one float32 value per channel, one
// value for every channel (a (1,) parameter), or none (an absent one reads as 0); RMSNorm's weight too. A decode
// step's norm is one row, where preparing four (C,) vectors cost more than the arithmetic. `keep` holds a float32
// copy of another dtype's.
struct Param {
  const float* p = nullptr;
  bool per = false;
  Tensor keep;
};

// A parameter as a block of rows reads it, copied into the block's own locals so that the compiler keeps it in
// registers: stores into the float32 partial sums could otherwise alias it, and it was read again for every vector.
struct View {
  const float* p;
  bool per;
  Vec one;  // the value of a (1,) or absent parameter, broadcast
  inline Vec at(int64_t j, int64_t m) const { return per ? Vec::loadu(p + j, m) : one; }
};
inline View view(const Param& q, float scale = 1.0f) {
  return {q.p, q.per, Vec(q.p == nullptr ? 0.0f : *q.p * scale)};
}

Param param(const c10::optional<Tensor>& t, int64_t c) {
  Param out;
  if (!t.has_value() || !t->defined()) return out;
  TORCH_CHECK(t->dim() == 1 && (t->numel() == 1 || t->numel() == c) && t->device().is_cpu(),
              "normlab cpu kernel: a parameter must be a CPU tensor of shape (1,) or (C,) with C = ", c);
  out.keep = t->to(at::kFloat).contiguous();
  out.p = out.keep.data_ptr<float>();
  out.per = t->numel() == c;
  return out;
}

// rows r0..r1 (arguments, not captures, as in the backward's blocks); the backward recomputes f from x
template <typename T, int64_t K>
void pointwise_fwd_block(const T* __restrict x, T* __restrict y, const View v0, const View v1,
                         const View vw, const View vb, const Vec vscale, int64_t r0, int64_t r1, int64_t c) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * c;
    T* yr = y + r * c;
    const Vec mean(K == ELN ? finite_or_nan(row_mean(xr, c)) : 0.0f);
    for (int64_t j = 0; j < c; j += VL) {
      const int64_t m = std::min(VL, c - j);
      const Vec xv = load(xr + j, m), a = v0.at(j, m), wv = vw.at(j, m) * vscale, bv = vb.at(j, m);
      Vec f;
      if constexpr (K == DYT) {
        f = tanh_<T>(a * xv);
      } else if constexpr (K == DERF) {
        f = erf_<T>(at::vec::fmadd(a, xv, v1.at(j, m)));
      } else {
        f = isru(K == ELN ? xv - mean : xv, a).f;
      }
      store(yr + j, at::vec::fmadd(wv, f, bv), m);
    }
  }
}

template <typename T, int64_t K>
void pointwise_fwd_impl(const T* x, T* y, const Param& p0, const Param& p1, const Param& w, const Param& b,
                        float scale, int64_t n, int64_t c) {
  const View v0 = view(p0), v1 = view(p1), vw = view(w, scale), vb = view(b);
  const Vec vscale(vw.per ? scale : 1.0f);
  for_blocks(n, n_blocks(n, c), [&](int64_t, int64_t r0, int64_t r1) {
    pointwise_fwd_block<T, K>(x, y, v0, v1, vw, vb, vscale, r0, r1, c);
  });
}

// dx, and into part[0..4) (each (C,)): dp0, dp1, dw (sum g f), db (sum g). Rows go in groups of ROWS per
// column chunk, so that the parameters and the partial sums are loaded and stored once per group.
constexpr int64_t ROWS = 4;

// One block of rows, rows r0..r1. Its pointers and parameters are the function's own arguments, so the compiler
// keeps them in registers (captured by a lambda, they were read again for every vector). f is recomputed from x
// (saving it in the forward was slower in float32 and gave 5x DyT's gradient error in bfloat16; retired in 0.10.0).
template <typename T, int64_t K>
void pointwise_bwd_block(const T* __restrict g, const T* __restrict x, T* __restrict dx,
                         const View v0, const View v1, const View vw, const Vec vscale, float* __restrict dp0,
                         int64_t r0, int64_t r1, int64_t c) {
  float *dp1 = dp0 + c, *dw = dp0 + 2 * c, *db = dp0 + 3 * c;
  // ELN's q (dx before its row mean is taken off): a float32 dx holds it itself, other dtypes a float32 buffer of ROWS
  // rows (a buffer for float32 too made ELN's backward 1.6x DyISRU's, against 1.25x: scripts/bench_kernel_builds.py)
  constexpr bool Q_IN_DX = std::is_same_v<T, float>;
  std::vector<float> qbuf(K == ELN && !Q_IN_DX ? ROWS * c : 0);
  const auto q_row = [&](int64_t rg, int64_t i) {  // row i of the group starting at row rg
    return Q_IN_DX ? reinterpret_cast<float*>(dx) + (rg + i) * c : qbuf.data() + i * c;
  };
  for (int64_t rg = r0; rg < r1; rg += ROWS) {
    const int64_t rows = std::min(ROWS, r1 - rg);
    Vec mean[ROWS], qsum[ROWS];
    for (int64_t i = 0; i < rows; ++i) {
      mean[i] = Vec(K == ELN ? finite_or_nan(row_mean(x + (rg + i) * c, c)) : 0.0f);
      qsum[i] = Vec(0.0f);
    }
    // The per-channel factors (w, alpha, beta, 2/sqrt(pi)) are taken out of the row sums and applied once per
    // group: fewer multiplications per element, which is what bounds these loops on a CPU (docs/kernels.md).
    for (int64_t j = 0; j < c; j += VL) {
      const int64_t m = std::min(VL, c - j);
      const Vec a = v0.at(j, m), wv = vw.at(j, m) * vscale;
      const Vec shift = K == DERF ? v1.at(j, m) : Vec(0.0f);
      // dx = g u k: u the element's own factor, k the channel's
      const Vec k = K == DERF ? wv * a * Vec(TWO_OVER_SQRT_PI) : wv * a;  // a is beta for DyISRU and ELN
      Vec acc0(0.0f), acc1(0.0f), accw(0.0f), accb(0.0f);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t off = (rg + i) * c + j;
        const Vec xv = load(x + off, m), gv = load(g + off, m);  // g is zero in the tail lanes
        Vec gu, f;
        if constexpr (K == DYT) {
          f = tanh_<T>(a * xv);
          gu = gv * at::vec::fnmadd(f, f, Vec(1.0f));  // g (1 - f^2)
          acc0 = at::vec::fmadd(gu, xv, acc0);
        } else if constexpr (K == DERF) {
          const Vec z = at::vec::fmadd(a, xv, shift);
          f = erf_<T>(z);
          gu = gv * exp_neg_sq(z);
          acc0 = at::vec::fmadd(gu, xv, acc0);
          acc1 = acc1 + gu;
        } else {
          const Vec u = K == ELN ? xv - mean[i] : xv;
          const Isru s = isru(u, a);
          f = s.f;
          gu = gv * (s.h * s.h * s.h);  // g h^3; dbeta = -w/2 sum g u h^3
          // a saturated u (h = 0: beyond 1e18, +-inf, a float16 overflow) adds 0 to dbeta, not inf * 0 = NaN
          acc0 = at::vec::fmadd(gu, Vec::blendv(u, Vec(0.0f), s.h == Vec(0.0f)), acc0);
        }
        const Vec d = gu * k;
        accw = at::vec::fmadd(gv, f, accw);
        accb = accb + gv;
        if constexpr (K == ELN) {
          d.store(q_row(rg, i) + j, m);
          qsum[i] = qsum[i] + Vec::set(Vec(0.0f), d, m);  // the tail lanes hold NaN (beta = 0 there)
        } else {
          store(dx + off, d, m);
        }
      }
      // the tail lanes of the accumulators may hold NaN (beta = 0 there): stores take m lanes only
      if constexpr (K == DYT) acc0 = acc0 * wv;
      if constexpr (K == DERF) {
        acc0 = acc0 * (wv * Vec(TWO_OVER_SQRT_PI));
        acc1 = acc1 * (wv * Vec(TWO_OVER_SQRT_PI));
      }
      if constexpr (K == DYISRU || K == ELN) acc0 = acc0 * (wv * Vec(-0.5f));
      (Vec::loadu(dp0 + j, m) + acc0).store(dp0 + j, m);
      if constexpr (K == DERF) (Vec::loadu(dp1 + j, m) + acc1).store(dp1 + j, m);
      (Vec::loadu(dw + j, m) + accw).store(dw + j, m);
      (Vec::loadu(db + j, m) + accb).store(db + j, m);
    }
    if constexpr (K == ELN) {  // dx = q - mean(q)
      for (int64_t i = 0; i < rows; ++i) {
        const Vec qmean(sum_lanes(qsum[i]) / static_cast<float>(c));
        const float* q = q_row(rg, i);
        for (int64_t j = 0; j < c; j += VL) {
          const int64_t m = std::min(VL, c - j);
          store(dx + (rg + i) * c + j, Vec::loadu(q + j, m) - qmean, m);
        }
      }
    }
  }
}

template <typename T, int64_t K>
void pointwise_bwd_impl(const T* g, const T* x, T* dx, const Param& p0, const Param& p1, const Param& w,
                        float scale, float* partials, int64_t n, int64_t c, int64_t blocks) {
  const View v0 = view(p0), v1 = view(p1), vw = view(w, scale);
  const Vec vscale(vw.per ? scale : 1.0f);
  for_blocks(n, blocks, [&](int64_t blk, int64_t r0, int64_t r1) {
    float* part = partials + blk * 4 * c;
    pointwise_bwd_block<T, K>(g, x, dx, v0, v1, vw, vscale, part, r0, r1, c);
  });
}

template <typename F>
void dispatch_kind(int64_t kind, const F& f) {
  switch (kind) {
    case DYT: f(std::integral_constant<int64_t, DYT>{}); break;
    case DERF: f(std::integral_constant<int64_t, DERF>{}); break;
    case DYISRU: f(std::integral_constant<int64_t, DYISRU>{}); break;
    case ELN: f(std::integral_constant<int64_t, ELN>{}); break;
    default: TORCH_CHECK(false, "normlab cpu kernel: unknown kind ", kind);
  }
}

template <typename F>
void dispatch_dtype(at::ScalarType t, const F& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "normlab cpu kernel: float32, bfloat16 or float16 expected, got ", t);
  }
}

Tensor pointwise_fwd_rows(const Tensor& x, const Param& p0, const Param& p1, const Param& w, const Param& b,
                          float scale, int64_t kind) {
  check_rows(x, "x");
  const int64_t n = x.size(0), c = x.size(1);
  Tensor y = at::empty_like(x);
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    dispatch_kind(kind, [&](auto k) {
      pointwise_fwd_impl<T, decltype(k)::value>(x.data_ptr<T>(), y.data_ptr<T>(), p0, p1, w, b, scale, n, c);
    });
  });
  return y;
}

std::vector<Tensor> sum_partials(const Tensor& partials) {
  // (blocks, k, C) -> k tensors of (C,), added in block order
  const int64_t blocks = partials.size(0), k = partials.size(1), c = partials.size(2);
  const float* p = partials.data_ptr<float>();
  std::vector<Tensor> out;
  for (int64_t i = 0; i < k; ++i) {
    Tensor s = at::zeros({c}, partials.options());
    float* sp = s.data_ptr<float>();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* src = p + (blk * k + i) * c;
      for (int64_t j = 0; j < c; ++j) sp[j] += src[j];
    }
    out.push_back(s);
  }
  return out;
}

std::vector<Tensor> pointwise_bwd_rows(const Tensor& g, const Tensor& x, const Param& p0, const Param& p1,
                                       const Param& w, float scale, int64_t kind) {
  check_rows(x, "x");
  check_rows(g, "the gradient");
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(),
              "normlab cpu kernel: the gradient must match x in shape and dtype");
  const int64_t n = x.size(0), c = x.size(1);
  const int64_t blocks = n_blocks(n, c);
  Tensor dx = at::empty_like(x);
  Tensor partials = at::zeros({blocks, 4, c}, x.options().dtype(at::kFloat));
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    dispatch_kind(kind, [&](auto k) {
      pointwise_bwd_impl<T, decltype(k)::value>(g.data_ptr<T>(), x.data_ptr<T>(), dx.data_ptr<T>(), p0, p1, w, scale,
                                                partials.data_ptr<float>(), n, c, blocks);
    });
  });
  std::vector<Tensor> out{dx};
  for (Tensor& s : sum_partials(partials)) out.push_back(s);
  return out;  // dx, dp0, dp1, dw, db
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm: y = w x r, r = (mean x^2 + eps)^(-1/2); dx = r (g w) - x r^3 mean(g w x), dw = sum g x r
// ---------------------------------------------------------------------------------------------------------
std::vector<Tensor> rms_fwd_rows(const Tensor& x, const Param& w, double eps) {
  check_rows(x, "x");
  const int64_t n = x.size(0), c = x.size(1);
  Tensor y = at::empty_like(x);
  Tensor rstd = at::empty({n}, x.options().dtype(at::kFloat));
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    float* rp = rstd.data_ptr<float>();
    for_blocks(n, n_blocks(n, c), [&](int64_t, int64_t r0, int64_t r1) {
      const View vw = view(w);
      for (int64_t r = r0; r < r1; ++r) {
        const T* xr = xp + r * c;
        const float rs = 1.0f / std::sqrt(row_sumsq(xr, c) / static_cast<float>(c) + static_cast<float>(eps));
        rp[r] = rs;
        const Vec rv(rs);
        for (int64_t j = 0; j < c; j += VL) {
          const int64_t m = std::min(VL, c - j);
          store(yp + r * c + j, load(xr + j, m) * rv * vw.at(j, m), m);
        }
      }
    });
  });
  return {y, rstd};
}

std::vector<Tensor> rms_bwd_rows(const Tensor& g, const Tensor& x, const Tensor& rstd, const Param& w) {
  check_rows(x, "x");
  check_rows(g, "the gradient");
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(),
              "normlab cpu kernel: the gradient must match x in shape and dtype");
  const int64_t n = x.size(0), c = x.size(1);
  const int64_t blocks = n_blocks(n, c);
  Tensor dx = at::empty_like(x);
  Tensor partials = at::zeros({blocks, 1, c}, x.options().dtype(at::kFloat));
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const T *gp = g.data_ptr<T>(), *xp = x.data_ptr<T>();
    T* dxp = dx.data_ptr<T>();
    const float* rp = rstd.data_ptr<float>();
    float* part = partials.data_ptr<float>();
    for_blocks(n, blocks, [&](int64_t blk, int64_t r0, int64_t r1) {
      const View vw = view(w);
      float* dw = part + blk * c;
      for (int64_t r = r0; r < r1; ++r) {
        const T *xr = xp + r * c, *gr = gp + r * c;
        const Vec rv(rp[r]);
        Vec acc(0.0f);
        for (int64_t j = 0; j < c; j += VL) {
          const int64_t m = std::min(VL, c - j);
          const Vec xv = load(xr + j, m), gv = load(gr + j, m);
          acc = at::vec::fmadd(gv * vw.at(j, m), xv, acc);
          at::vec::fmadd(gv, xv * rv, Vec::loadu(dw + j, m)).store(dw + j, m);
        }
        const float r1f = rp[r];
        const Vec coef(sum_lanes(acc) /
                       static_cast<float>(c) * r1f * r1f * r1f);
        for (int64_t j = 0; j < c; j += VL) {
          const int64_t m = std::min(VL, c - j);
          const Vec xv = load(xr + j, m), gv = load(gr + j, m);
          store(dxp + r * c + j, at::vec::fnmadd(xv, coef, rv * gv * vw.at(j, m)), m);
        }
      }
    });
  });
  return {dx, sum_partials(partials)[0]};
}

// ---------------------------------------------------------------------------------------------------------
// the entry points: tensors as the modules hold them (x of any shape (..., C); a parameter of shape (1,) or
// (C,) in any float dtype; bias optional), prepared here so that a call costs one dispatch from Python
// ---------------------------------------------------------------------------------------------------------
Tensor rows(const Tensor& t) { return t.reshape({-1, t.size(-1)}).contiguous(); }

Tensor reduce_like(const Tensor& grad_c, const Tensor& p, double scale = 1.0) {
  Tensor g = p.numel() == 1 ? grad_c.sum().reshape(p.sizes()) : grad_c.reshape(p.sizes());
  return (scale == 1.0 ? g : g.mul(scale)).to(p.scalar_type());
}

// log_p0: p0 holds log(beta) (DyISRU's and ELN's parameter as the modules store it), and beta = exp(p0) is taken here
// by ATen's exp, the same kernel as the module's own `beta`: an inference call makes one Python op call fewer.
Tensor pointwise_fwd(const Tensor& x, const Tensor& p0, const c10::optional<Tensor>& p1, const Tensor& w,
                     const c10::optional<Tensor>& b, double scale, int64_t kind, bool log_p0) {
  TORCH_CHECK(!log_p0 || kind == DYISRU || kind == ELN, "normlab cpu kernel: log_p0 is for DyISRU and ELN's beta");
  const int64_t c = x.size(-1);
  return pointwise_fwd_rows(rows(x), param(log_p0 ? p0.exp() : p0, c), param(p1, c), param(w, c), param(b, c), scale,
                            kind)
      .view(x.sizes());
}

// [dx, dp0, dp1 (empty without p1), dw, db (empty without b)], each in its input's shape and dtype
std::vector<Tensor> pointwise_bwd(const Tensor& g, const Tensor& x, const Tensor& p0, const c10::optional<Tensor>& p1,
                                  const Tensor& w, const c10::optional<Tensor>& b, double scale, int64_t kind) {
  const int64_t c = x.size(-1);
  std::vector<Tensor> r =
      pointwise_bwd_rows(rows(g.to(x.scalar_type())), rows(x), param(p0, c), param(p1, c), param(w, c), scale, kind);
  const bool has_p1 = p1.has_value() && p1->defined(), has_b = b.has_value() && b->defined();
  return {r[0].view(x.sizes()), reduce_like(r[1], p0), has_p1 ? reduce_like(r[2], *p1) : at::empty({0}),
          reduce_like(r[3], w, scale), has_b ? reduce_like(r[4], *b) : at::empty({0})};
}

std::vector<Tensor> rms_fwd(const Tensor& x, const Tensor& w, double eps) {
  std::vector<Tensor> r = rms_fwd_rows(rows(x), param(w, x.size(-1)), eps);
  return {r[0].view(x.sizes()), r[1]};
}

std::vector<Tensor> rms_bwd(const Tensor& g, const Tensor& x, const Tensor& rstd, const Tensor& w) {
  std::vector<Tensor> r = rms_bwd_rows(rows(g.to(x.scalar_type())), rows(x), rstd, param(w, x.size(-1)));
  return {r[0].view(x.sizes()), reduce_like(r[1], w)};
}

}  // namespace

// The kernels' tanh (fn 0) or erf (fn 1) of a float32 (N,) tensor, in float32 before any rounding: the form used
// for float32 inputs, or (half = true) the one used for bfloat16 and float16. For the accuracy tests.
Tensor approx(const Tensor& z, int64_t fn, bool half) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.dim() == 1 && z.is_contiguous(), "approx: a float32 (N,) tensor");
  Tensor out = at::empty_like(z);
  const float* zp = z.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t j = 0; j < z.numel(); j += VL) {
    const int64_t m = std::min(VL, z.numel() - j);
    const Vec v = Vec::loadu(zp + j, m);
    const Vec f = fn == 0 ? (half ? tanh_<c10::BFloat16>(v) : tanh_<float>(v))
                          : (half ? erf_<c10::BFloat16>(v) : erf_<float>(v));
    f.store(op + j, m);
  }
  return out;
}

TORCH_LIBRARY(normlab_cpu, m) {
  m.def("approx(Tensor z, int fn, bool half) -> Tensor");
  m.def("pointwise_fwd(Tensor x, Tensor p0, Tensor? p1, Tensor w, Tensor? b, float scale, int kind, bool log_p0=False) "
        "-> Tensor");
  m.def("pointwise_bwd(Tensor g, Tensor x, Tensor p0, Tensor? p1, Tensor w, Tensor? b, float scale, int kind) -> "
        "Tensor[]");
  m.def("rms_fwd(Tensor x, Tensor w, float eps) -> Tensor[]");
  m.def("rms_bwd(Tensor g, Tensor x, Tensor rstd, Tensor w) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(normlab_cpu, CPU, m) {
  m.impl("approx", &approx);
  m.impl("pointwise_fwd", &pointwise_fwd);
  m.impl("pointwise_bwd", &pointwise_bwd);
  m.impl("rms_fwd", &rms_fwd);
  m.impl("rms_bwd", &rms_bwd);
}
