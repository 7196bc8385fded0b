// Weight-only int4 and int8 matrix products for x86-64 CPUs with AVX512-VNNI, built at first use
// by llm/kernels/cpu.py (torch.utils.cpp_extension) and registered as torch operators (llm::*).
//
// The method is llama.cpp's (ggml-cpu's Q4_1 x Q8_0 and Q8_0 x Q8_0 dot products): activations
// are quantized to int8 in groups of 32 per token (scale = max|x| / 127, round to nearest), the
// products are integer dot products (vpdpbusd: unsigned bytes times signed bytes, 4 at a time into
// int32), and the float scales are applied once per group of 32. Unlike ggml, the lanes of a vector
// are 16 output features (a "block" of rows), not 16 inputs, so the weights of 16 rows are read
// once per token tile and no horizontal sums are needed (torch's int4 CPU kernel's layout).
//
// Layouts (made by llm/kernels/cpu.py; NB = ceil(N / 16) blocks of 16 output rows, padded):
//   int4 codes  (NB, K / 8, 16, 4) uint8: for block b, inputs 8t..8t+7 of row 16b+i: byte j holds
//               q[8t + j] in its low nibble and q[8t + 4 + j] in its high nibble.
//   int4 scales, mins (NB, K / G, 16) fp16: w = q * scale + min (GGUF Q4_1's convention).
//   int8 codes  (NB, K / 4, 16, 4) int8: bytes j of row 16b+i at (b, t, i, j) = q[4t + j].
//   int8 scales (NB * 16,) float32: w = q * scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LLM_X86 1
#endif

namespace {

constexpr int64_t kLanes = 16;  // output rows per block: one zmm of int32 or float
constexpr int64_t kTile = 8;    // tokens per pass over a block's weights
constexpr int64_t kGroup = 32;  // inputs per activation scale
// Weight bytes prefetched ahead of use: without it SmolLM2's 150 int4 projections of one token took
// 4.1 ms on one thread instead of 3.1 (each thread's stretch of blocks is short: the hardware
// prefetcher ramps up too late).
constexpr int64_t kAheadBytes = 8192;

bool supported() {
#ifdef LLM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

void check(const at::Tensor& x, const at::Tensor& codes, int64_t n, int64_t bytes_per_block) {
  TORCH_CHECK(supported(), "llm CPU kernels need AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features), got ", x.sizes());
  TORCH_CHECK(x.size(1) % kGroup == 0, "x must be (rows, in_features) with in_features % 32 == 0, got ", x.sizes());
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 4 && codes.size(2) == kLanes && codes.size(3) == 4,
              "codes must be a contiguous (blocks, steps, 16, 4) layout, got ", codes.sizes());
  TORCH_CHECK(codes.size(0) == (n + kLanes - 1) / kLanes && codes.size(1) * 4 * kLanes == bytes_per_block,
              "codes of shape ", codes.sizes(), " do not match ", n, " outputs of ", x.size(1), " inputs");
}

#ifdef LLM_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")

// Per token and group of 32 inputs: int8 codes, the float scale, the sum of the codes (int8 x
// int8 products need it) and, per weight group of G inputs, the sum of the quantized x (for
// int4's mins: with the quantized sum, as ggml's Q8_1, the product is the dequantized weight's
// with the quantized x, whose rounding errors meet w; with the exact sum they would meet w - min,
// which lies on one side of zero, and add up: 0.4% of bits per byte on SmolLM2).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, sum;  // sum: of codes times scale, per weight group
  std::vector<int32_t> qsum;
};

void quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, Acts& a) {
  const int64_t C = K / kGroup, KG = K / G;
  a.q.resize(M * K);
  a.d.resize(M * C);
  a.qsum.resize(M * C);
  a.sum.assign(M * KG, 0.f);
  for (int64_t i = 0; i < M * C; ++i) {
    const float* p = x + i * kGroup;
    const __m512 u = _mm512_loadu_ps(p), v = _mm512_loadu_ps(p + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(u), _mm512_abs_ps(v)));
    // max drops NaN; a NaN or infinite input makes its group's scale NaN, so it reaches the output
    if (!std::isfinite(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_abs_ps(u), _mm512_abs_ps(v)))))
      amax = std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);  // NaN > 0 is false: codes 0
    const __m512i qu = _mm512_cvtps_epi32(_mm512_mul_ps(u, inv));  // round to nearest even
    const __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + i * kGroup), _mm512_cvtsepi32_epi8(qu));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.data() + i * kGroup + 16), _mm512_cvtsepi32_epi8(qv));
    a.d[i] = amax / 127.f;
    a.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qu, qv));
    a.sum[(i / C) * KG + (i % C) * kGroup / G] += a.d[i] * static_cast<float>(a.qsum[i]);
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

inline void store(float* out, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }

// 16 output rows for R tokens of int4 weights. The high nibbles are masked, not shifted: their
// products come out 16 times too large, which the scale's 1/16 undoes exactly (int32 holds
// 16 * 15 * 127 * 32).
template <int R>
void int4_block(const uint8_t* w, const at::Half* d, const at::Half* m, int64_t K, int64_t G, const int8_t* xq,
                const float* xd, const float* xs, int64_t ldo, float* out, __mmask16 mask) {
  const int64_t C = K / kGroup, KG = K / G;
  const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512 sixteenth = _mm512_set1_ps(1.f / 16.f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < KG; ++g) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kLanes)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * kLanes)));
    const __m512 dv16 = _mm512_mul_ps(dv, sixteenth);
    // scales and mins as far ahead as the codes: 2 bytes a row per group against G / 2
    _mm_prefetch(reinterpret_cast<const char*>(d + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T0);
    for (int64_t c = g * G / kGroup; c < (g + 1) * G / kGroup; ++c) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + c * 256 + kAheadBytes + j * 64), _MM_HINT_T0);
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(w + (c * 4 + j) * 64);
        lo[j] = _mm512_and_si512(v, lo_mask);
        hi[j] = _mm512_and_si512(v, hi_mask);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + c * kGroup;
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          i0 = _mm512_dpbusd_epi32(i0, lo[j], broadcast4(xr + 8 * j));
          i1 = _mm512_dpbusd_epi32(i1, hi[j], broadcast4(xr + 8 * j + 4));
        }
        const __m512i i = _mm512_add_epi32(_mm512_slli_epi32(i0, 4), i1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv16, _mm512_set1_ps(xd[r * C + c])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * KG + g]), acc[r]);
  }
  for (int r = 0; r < R; ++r) store(out + r * ldo, acc[r], mask);
}

// 16 output rows for R tokens of int8 weights. vpdpbusd needs one unsigned operand: the weights
// enter as w + 128 (the sign bit flipped), and 128 * sum(x codes) is taken off.
template <int R>
void int8_block(const int8_t* w, const float* scale, int64_t K, const int8_t* xq, const float* xd,
                const int32_t* xqs, int64_t ldo, float* out, __mmask16 mask) {
  const int64_t C = K / kGroup;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    __m512i wv[8];
    for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + c * 512 + kAheadBytes + j * 64), _MM_HINT_T0);
    for (int j = 0; j < 8; ++j) wv[j] = _mm512_xor_si512(_mm512_loadu_si512(w + (c * 8 + j) * 64), flip);
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + c * kGroup;
      __m512i i0 = _mm512_set1_epi32(-128 * xqs[r * C + c]), i1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        i0 = _mm512_dpbusd_epi32(i0, wv[j], broadcast4(xr + 4 * j));
        i1 = _mm512_dpbusd_epi32(i1, wv[j + 1], broadcast4(xr + 4 * j + 4));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_set1_ps(xd[r * C + c]), acc[r]);
    }
  }
  const __m512 sv = _mm512_loadu_ps(scale);
  for (int r = 0; r < R; ++r) store(out + r * ldo, _mm512_mul_ps(acc[r], sv), mask);
}

// The first min(left, 16) lanes.
__mmask16 lanes_mask(int64_t left) {
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Blocks per task: enough work per thread wake-up, and at least two tasks when there are threads.
int64_t grain(int64_t blocks) { return std::max<int64_t>(1, std::min<int64_t>(16, blocks / (2 * at::get_num_threads()))); }

// Calls f(block, first token, std::integral_constant<int, R>, mask of the block's real rows) for
// every block of 16 output rows (split over torch's threads) and tile of at most kTile tokens.
template <typename F>
void for_each_tile(int64_t blocks, int64_t M, int64_t n, F&& f) {
  at::parallel_for(0, blocks, grain(blocks), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const __mmask16 mask = lanes_mask(n - b * kLanes);
      for (int64_t r0 = 0; r0 < M; r0 += kTile) {
        switch (std::min(kTile, M - r0)) {
          case 1: f(b, r0, std::integral_constant<int, 1>(), mask); break;
          case 2: f(b, r0, std::integral_constant<int, 2>(), mask); break;
          case 3: f(b, r0, std::integral_constant<int, 3>(), mask); break;
          case 4: f(b, r0, std::integral_constant<int, 4>(), mask); break;
          case 5: f(b, r0, std::integral_constant<int, 5>(), mask); break;
          case 6: f(b, r0, std::integral_constant<int, 6>(), mask); break;
          case 7: f(b, r0, std::integral_constant<int, 7>(), mask); break;
          default: f(b, r0, std::integral_constant<int, 8>(), mask); break;
        }
      }
    }
  });
}

at::Tensor int4_linear_cpu(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t group_size, int64_t n) {
  const int64_t K = x_in.dim() == 2 ? x_in.size(1) : 0;
  check(x_in, codes, n, K * 8);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kGroup == 0 && K % group_size == 0, "group_size ", group_size,
              " must be a multiple of 32 that divides in_features ", K);
  const int64_t KG = K / group_size;
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  mins.scalar_type() == at::kHalf && scales.numel() == codes.size(0) * KG * kLanes &&
                  mins.numel() == scales.numel(),
              "scales and mins must be contiguous float16 (", codes.size(0), ", ", KG, ", 16) for group_size ",
              group_size, ", got ", scales.sizes(), " and ", mins.sizes());
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  Acts a;
  quantize_acts(x.data_ptr<float>(), M, K, group_size, a);
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const at::Half* dp = scales.data_ptr<at::Half>();
  const at::Half* mp = mins.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  const int64_t C = K / kGroup, NB = codes.size(0);
  for_each_tile(NB, M, n, [&](int64_t b, int64_t r0, auto R, __mmask16 mask) {
    int4_block<decltype(R)::value>(w + b * K * 8, dp + b * KG * kLanes, mp + b * KG * kLanes, K, group_size,
                                   a.q.data() + r0 * K, a.d.data() + r0 * C, a.sum.data() + r0 * KG, n,
                                   o + r0 * n + b * kLanes, mask);
  });
  return out;
}

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  const int64_t K = x_in.dim() == 2 ? x_in.size(1) : 0;
  check(x_in, codes, n, K * kLanes);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == codes.size(0) * kLanes,
              "scales must be contiguous float32 (blocks * 16,)");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  Acts a;
  quantize_acts(x.data_ptr<float>(), M, K, K, a);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t C = K / kGroup, NB = codes.size(0);
  for_each_tile(NB, M, n, [&](int64_t b, int64_t r0, auto R, __mmask16 mask) {
    int8_block<decltype(R)::value>(w + b * K * kLanes, sp + b * kLanes, K, a.q.data() + r0 * K, a.d.data() + r0 * C,
                                   a.qsum.data() + r0 * C, n, o + r0 * n + b * kLanes, mask);
  });
  return out;
}

// exp(x) for 16 floats, Cephes' expf (as ggml's and Eigen's vectorized exp): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) from a degree-5 polynomial, times 2^n. About 1 ulp; NaN stays NaN; x
// below -104 (exp underflows to 0) is clamped there, since n ln2 would no longer cancel x.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // the second operand is returned for NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// One query's heads of one kv head (grouped-query attention: G query heads read the same keys, so
// each key and value row is loaded once for all of them), over keys j0 .. j1 - 1 of a cache
// buffer, those that mask says to use; head_dim = 16 * DV. Per head g it leaves the largest score
// top[g], the sum of exp(score - top[g]) total[g] and acc (G, D), the sum of those weights times
// the values, for the split parts of the keys to be merged (flash-decoding). s: G * (j1 - j0) floats.
template <int DV>
void attend(const float* q, int64_t G, const float* k, const float* v, const bool* mask, const float* bias,
            int64_t bias_stride, int64_t j0, int64_t j1, float scale, float* s, float* top, float* total,
            float* acc) {
  constexpr int64_t D = DV * kLanes;
  const int64_t L = j1 - j0;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) top[g] = -inf;
  bool any = false;
  for (int64_t j = j0; j < j1; ++j) {
    if (!mask[j]) {
      for (int64_t g = 0; g < G; ++g) s[g * L + j - j0] = -inf;
      continue;
    }
    any = true;
    __m512 kr[DV];
    for (int c = 0; c < DV; ++c) kr[c] = _mm512_loadu_ps(k + j * D + c * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), kr[0]);
      for (int c = 1; c < DV; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + c * kLanes), kr[c], dot);
      float score = _mm512_reduce_add_ps(dot) * scale;
      if (bias) score += bias[g * bias_stride + j];
      s[g * L + j - j0] = score;
      if (!(score <= top[g])) top[g] = score;  // NaN wins, so that it reaches the output
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * L - j0;  // row[j] for j0 <= j < j1
    __m512 acc0[DV], acc1[DV];
    for (int c = 0; c < DV; ++c) acc0[c] = acc1[c] = _mm512_setzero_ps();
    total[g] = 0.f;
    if (any) {
      const __m512 topv = _mm512_set1_ps(top[g]), minus_inf = _mm512_set1_ps(-inf);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = j0; j < j1; j += kLanes) {
        const __mmask16 tail = lanes_mask(j1 - j);
        const __m512 x = _mm512_mask_loadu_ps(minus_inf, tail, row + j);
        // masked keys (-inf) weigh exactly 0; NaN is unordered, so it is kept
        const __mmask16 real = _mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_UQ);
        const __m512 p = _mm512_maskz_mov_ps(real, exp16(_mm512_sub_ps(x, topv)));
        _mm512_mask_storeu_ps(row + j, tail, p);
        sum = _mm512_add_ps(sum, p);
      }
      total[g] = _mm512_reduce_add_ps(sum);
      // two keys at a time: two independent chains of additions per lane. A masked row is never
      // read: a static buffer's unwritten rows may hold anything.
      int64_t j = j0;
      for (; j + 1 < j1; j += 2) {
        if (mask[j]) {
          const __m512 p = _mm512_set1_ps(row[j]);
          for (int c = 0; c < DV; ++c) acc0[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + j * D + c * kLanes), acc0[c]);
        }
        if (mask[j + 1]) {
          const __m512 p = _mm512_set1_ps(row[j + 1]);
          for (int c = 0; c < DV; ++c)
            acc1[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + (j + 1) * D + c * kLanes), acc1[c]);
        }
      }
      if (j < j1 && mask[j]) {
        const __m512 p = _mm512_set1_ps(row[j]);
        for (int c = 0; c < DV; ++c) acc0[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + j * D + c * kLanes), acc0[c]);
      }
    }
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + g * D + c * kLanes, _mm512_add_ps(acc0[c], acc1[c]));
  }
}

// Attention of a few queries over a cache buffer, the keys each query may see given by a mask:
// a decoding step over a static cache (gpt-fast's shape) without the two batched products,
// the softmax and the masking as separate passes over the buffer. Keys that are masked out are
// neither read nor weighted. Scores, softmax and sums are float32, as the torch path's. The keys
// are split into parts when there are fewer (query, kv head) pairs than threads to keep busy
// (flash-decoding: each part's softmax is merged by its largest score).
at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                const at::Tensor& mask_in, double scale, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(supported(), "llm CPU kernels need AVX512-VNNI");
  TORCH_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && k_in.sizes() == v_in.sizes(),
              "q must be (batch, n_heads, seq_q, head_dim) and k, v (batch, kv_n_heads, seq_k, head_dim), got ",
              q_in.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes());
  const int64_t B = q_in.size(0), H = q_in.size(1), S = q_in.size(2), D = q_in.size(3);
  const int64_t KV = k_in.size(1), T = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == B && k_in.size(3) == D && KV > 0 && H % KV == 0 && D % kLanes == 0 && D > 0 &&
                  D <= 8 * kLanes,
              "k and v of shape ", k_in.sizes(), " do not fit q of shape ", q_in.sizes(),
              " (same batch and head_dim, a multiple of 16 up to 128; n_heads a multiple of kv_n_heads)");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat && v_in.scalar_type() == at::kFloat,
              "q, k and v must be float32");
  TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.dim() == 3 && mask_in.size(0) == B &&
                  mask_in.size(1) == S && mask_in.size(2) == T,
              "mask must be bool (batch, seq_q, seq_k) = (", B, ", ", S, ", ", T, "), got ", mask_in.sizes());
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(1) == H && bias.size(2) == S && bias.size(3) == T,
                "bias must be (batch, n_heads, seq_q, seq_k), got ", bias.sizes());
  }
  // queries (batch, kv head, group, seq_q, head_dim) -> (batch, kv head, seq_q, group, head_dim)
  const int64_t G = H / KV, pairs = B * KV * S;
  const at::Tensor q = q_in.view({B, KV, G, S, D}).transpose(2, 3).contiguous();
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), mask = mask_in.contiguous();
  at::Tensor out = at::empty({B, KV, S, G, D}, q.options());
  if (out.numel() == 0 || T == 0) return out.zero_().transpose(2, 3).reshape({B, H, S, D});
  // parts of at least 64 keys, enough for two tasks a thread
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(T / 64, (2 * at::get_num_threads() + pairs - 1) / pairs));
  const int64_t span = (T + parts - 1) / parts;
  std::vector<float> top(pairs * parts * G), total(pairs * parts * G), acc(pairs * parts * G * D);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, pairs * parts, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(G * span);
    for (int64_t t = t0; t < t1; ++t) {  // t = ((b * KV + kv head) * S + query) * parts + part
      const int64_t pair = t / parts, b = pair / (KV * S), h = (pair / S) % KV, i = pair % S;
      const int64_t j0 = (t % parts) * span, j1 = std::min(T, j0 + span);
      const float* kt = kp + (b * KV + h) * T * D;
      const float* vt = vp + (b * KV + h) * T * D;
      const bool* mt = mp + (b * S + i) * T;
      // bias (b, h * G + g, i, :): heads of a group are S * T apart
      const float* bt = bp ? bp + ((b * H + h * G) * S + i) * T : nullptr;
      float *tp = top.data() + t * G, *sp = total.data() + t * G, *ap = acc.data() + t * G * D;
      switch (D / kLanes) {
#define LLM_ATTEND(DV) \
  case DV: attend<DV>(qp + pair * G * D, G, kt, vt, mt, bt, S * T, j0, j1, fscale, s.data(), tp, sp, ap); break;
        LLM_ATTEND(1) LLM_ATTEND(2) LLM_ATTEND(3) LLM_ATTEND(4) LLM_ATTEND(5) LLM_ATTEND(6) LLM_ATTEND(7) LLM_ATTEND(8)
#undef LLM_ATTEND
      }
    }
  });
  float* op = out.data_ptr<float>();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t g = 0; g < G; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) {
        const float x = top[(pair * parts + p) * G + g];
        if (!(x <= best)) best = x;
      }
      float weight_sum = 0.f;
      float* o = op + (pair * G + g) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at_ = (pair * parts + p) * G + g;
        if (total[at_] == 0.f) continue;  // no key in this part (and none NaN)
        const float w = std::exp(top[at_] - best);
        weight_sum += w * total[at_];
        for (int64_t d = 0; d < D; ++d) o[d] += w * acc[at_ * D + d];
      }
      // nothing to attend to: zeros, as the torch path's (a NaN score makes weight_sum NaN)
      if (weight_sum != 0.f) {
        const float inv = 1.f / weight_sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
  return out.transpose(2, 3).reshape({B, H, S, D});
}

#pragma GCC pop_options
#else
at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor&, const at::Tensor&,
                           int64_t, int64_t n) {
  check(x, codes, n, 0);
  return at::Tensor();
}
at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor&, int64_t n) {
  check(x, codes, n, 0);
  return at::Tensor();
}
at::Tensor decode_attention_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "llm CPU kernels need AVX512-VNNI");
}
#endif

bool cpu_supported() { return supported(); }

// Distinct threads that one at::parallel_for of `tasks` tasks ran on: 1 when the extension was
// built without OpenMP (at::parallel_for's pragma is then ignored and every kernel runs serially).
int64_t parallel_threads(int64_t tasks) {
  std::vector<int> seen(tasks, -1);
  at::parallel_for(0, tasks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) seen[i] = at::get_thread_num();
  });
  std::sort(seen.begin(), seen.end());
  return std::unique(seen.begin(), seen.end()) - seen.begin();
}

}  // namespace

TORCH_LIBRARY(llm, m) {
  m.def("cpu_supported() -> bool", &cpu_supported);
  m.def("parallel_threads(int tasks) -> int", &parallel_threads);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int group_size, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm, CPU, m) {
  m.impl("int4_linear", &int4_linear_cpu);
  m.impl("int8_linear", &int8_linear_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
}
