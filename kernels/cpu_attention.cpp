// Decode attention on the CPU over a two-area KV cache (prompt tokens, then generated tokens),
// one pass over each kv head's keys and values for all the query heads that share it.
//
// Registered as torch.ops.flexoff.cpu_decode_attention; built on first use by
// flexoff/kernels/cpu_attention.py, which also holds the torch reference it is tested against.
// Keys and values are float16, bfloat16 or float32; all arithmetic is float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FLEXOFF_SIMD 1
#else
#define FLEXOFF_SIMD 0
#endif

namespace {

inline float to_float(at::Half x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }

#if FLEXOFF_SIMD
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
#endif

// sum_i q[i] * row[i] over d values
template <typename T, bool SIMD>
inline float dot(const float* q, const T* row, int64_t d) {
  int64_t i = 0;
  float s = 0.f;
#if FLEXOFF_SIMD
  if constexpr (SIMD) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; i + 32 <= d; i += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(row + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load16(row + i + 16), a1);
    }
    for (; i + 16 <= d; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(row + i), a0);
    s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
  for (; i < d; ++i) s += q[i] * to_float(row[i]);
  return s;
}

// acc[i] += p * row[i] over d values
template <typename T, bool SIMD>
inline void axpy(float* acc, float p, const T* row, int64_t d) {
  int64_t i = 0;
#if FLEXOFF_SIMD
  if constexpr (SIMD) {
    __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= d; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(row + i), _mm512_loadu_ps(acc + i)));
  }
#endif
  for (; i < d; ++i) acc[i] += p * to_float(row[i]);
}

// Token t's row of one kv head: the prompt area for t < s, the generated area after.
template <typename T>
struct Areas {
  const T* prompt;
  int64_t prompt_tok;  // stride between tokens
  int64_t s;
  const T* gen;
  int64_t gen_tok;
  const T* row(int64_t t) const { return t < s ? prompt + t * prompt_tok : gen + (t - s) * gen_tok; }
};

template <typename T, bool SIMD>
void run(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& kg,
         const at::Tensor& vg, const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t b = q.size(0), nh = q.size(1), d = q.size(2);
  const int64_t kvh = kp.size(1), s = kp.size(2), n = kg.size(2), grp = nh / kvh, len = s + n;
  const T* qd = q.data_ptr<T>();
  const T *kpd = kp.data_ptr<T>(), *vpd = vp.data_ptr<T>(), *kgd = kg.data_ptr<T>(), *vgd = vg.data_ptr<T>();
  const bool* md = mask.data_ptr<bool>();
  T* od = out.data_ptr<T>();
  at::parallel_for(0, b * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(grp * d), sc(grp * len), acc(grp * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kvh, h = item % kvh;
      const Areas<T> K{kpd + r * kp.stride(0) + h * kp.stride(1), kp.stride(2), s,
                       kgd + r * kg.stride(0) + h * kg.stride(1), kg.stride(2)};
      const Areas<T> V{vpd + r * vp.stride(0) + h * vp.stride(1), vp.stride(2), s,
                       vgd + r * vg.stride(0) + h * vg.stride(1), vg.stride(2)};
      const bool* m = md + r * mask.stride(0);
      for (int64_t j = 0; j < grp; ++j) {
        const T* qrow = qd + r * q.stride(0) + (h * grp + j) * q.stride(1);
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(qrow[i]) * static_cast<float>(scale);
      }
      // scores, one read of each key row for the whole group
      for (int64_t t = 0; t < len; ++t) {
        if (!m[t]) {
          for (int64_t j = 0; j < grp; ++j) sc[j * len + t] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const T* row = K.row(t);
        for (int64_t j = 0; j < grp; ++j) sc[j * len + t] = dot<T, SIMD>(qf.data() + j * d, row, d);
      }
      // softmax numerators; the sums divide at the end
      std::vector<float> total(grp, 0.f);
      for (int64_t j = 0; j < grp; ++j) {
        float* x = sc.data() + j * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, x[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          x[t] = m[t] ? std::exp(x[t] - mx) : 0.f;
          sum += x[t];
        }
        total[j] = sum;
      }
      // weighted values, one read of each value row for the whole group
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (!m[t]) continue;
        const T* row = V.row(t);
        for (int64_t j = 0; j < grp; ++j) axpy<T, SIMD>(acc.data() + j * d, sc[j * len + t], row, d);
      }
      for (int64_t j = 0; j < grp; ++j) {
        T* orow = od + (r * nh + h * grp + j) * d;
        const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
        for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<T>(acc[j * d + i] * inv);
      }
    }
  });
}

// q (b, heads, d); kp, vp (b, kv_heads, s, d) and kg, vg (b, kv_heads, n, d), each token's row
// contiguous; mask (b, >= s + n) bool, True where the query may attend. Returns (b, heads, d).
at::Tensor cpu_decode_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                                const at::Tensor& kg, const at::Tensor& vg, const at::Tensor& mask,
                                double scale, bool simd) {
  TORCH_CHECK(q.device().is_cpu() && kp.device().is_cpu() && kg.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kp.dim() == 4 && vp.dim() == 4 && kg.dim() == 4 && vg.dim() == 4,
              "q is (b, heads, d); keys and values (b, kv_heads, tokens, d)");
  TORCH_CHECK(kp.sizes() == vp.sizes() && kg.sizes() == vg.sizes(), "keys and values differ in shape");
  TORCH_CHECK(kp.size(0) == q.size(0) && kg.size(0) == q.size(0) && kg.size(1) == kp.size(1) &&
                  kp.size(3) == q.size(2) && kg.size(3) == q.size(2),
              "q, prompt and generated areas disagree in shape");
  TORCH_CHECK(q.size(1) % kp.size(1) == 0, "query heads are not a multiple of kv heads");
  TORCH_CHECK(q.stride(2) == 1 && kp.stride(3) == 1 && vp.stride(3) == 1 && kg.stride(3) == 1 &&
                  vg.stride(3) == 1 && kp.strides() == vp.strides() && kg.strides() == vg.strides(),
              "each row must be contiguous, keys and values alike");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == q.size(0) &&
                  mask.size(1) >= kp.size(2) + kg.size(2) && mask.stride(1) == 1,
              "mask is (b, tokens) bool");
  const auto dt = q.scalar_type();
  TORCH_CHECK(kp.scalar_type() == dt && vp.scalar_type() == dt && kg.scalar_type() == dt &&
                  vg.scalar_type() == dt, "q, keys and values differ in dtype");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
#define FLEXOFF_RUN(T)                                  \
  if (simd) run<T, true>(q, kp, vp, kg, vg, mask, scale, out); \
  else run<T, false>(q, kp, vp, kg, vg, mask, scale, out);
  if (dt == at::kHalf) { FLEXOFF_RUN(at::Half) }
  else if (dt == at::kBFloat16) { FLEXOFF_RUN(at::BFloat16) }
  else if (dt == at::kFloat) { FLEXOFF_RUN(float) }
  else TORCH_CHECK(false, "dtype must be float16, bfloat16 or float32");
#undef FLEXOFF_RUN
  return out;
}

bool has_simd() { return FLEXOFF_SIMD; }

}  // namespace

TORCH_LIBRARY(flexoff, m) {
  m.def("cpu_decode_attention(Tensor q, Tensor kp, Tensor vp, Tensor kg, Tensor vg, Tensor mask, float scale, bool simd) -> Tensor");
  m.def("cpu_kernel_simd() -> bool", has_simd);
}

TORCH_LIBRARY_IMPL(flexoff, CPU, m) { m.impl("cpu_decode_attention", cpu_decode_attention); }
