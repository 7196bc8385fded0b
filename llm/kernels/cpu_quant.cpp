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

#ifdef _OPENMP
#include <omp.h>
#endif

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
// prefetcher ramps up too late). Into L2 (T1), which can have more lines in flight than L1: the 30
// fused blocks of SmolLM2 took 3.4-4.0 ms a token against 3.9-5.7 with T0 (AMD EPYC, Zen 4;
// alternating builds, a noisy day).
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
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kGroup == 0,
              "x must be (rows, in_features) with in_features a positive multiple of 32, got ", x.sizes());
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
    _mm_prefetch(reinterpret_cast<const char*>(d + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(m + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T1);
    for (int64_t c = g * G / kGroup; c < (g + 1) * G / kGroup; ++c) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + c * 256 + kAheadBytes + j * 64), _MM_HINT_T1);
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
    for (int j = 0; j < 8; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + c * 512 + kAheadBytes + j * 64), _MM_HINT_T1);
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

// A packed int4 or int8 weight (the layouts of the file's header) and its shape.
struct QWeight {
  bool int4 = true;
  const uint8_t* codes = nullptr;  // int8 codes are read as int8_t
  const at::Half* scales = nullptr;  // int4: (blocks, K / G, 16)
  const at::Half* mins = nullptr;
  const float* lane_scales = nullptr;  // int8: (blocks * 16,)
  int64_t n = 0, k = 0, group = 0, blocks = 0;
};

// Block b of 16 output rows for the M tokens of a (quantized with w.group's sums), into out (row
// r at out + r * ldo, the block's first column at out), in tiles of at most kTile tokens.
void project_block(const QWeight& w, const Acts& a, int64_t M, int64_t b, float* out, int64_t ldo) {
  const __mmask16 mask = lanes_mask(w.n - b * kLanes);
  const int64_t K = w.k, C = K / kGroup, KG = K / w.group;
  for (int64_t r0 = 0; r0 < M; r0 += kTile) {
    auto run = [&](auto R) {
      constexpr int kR = decltype(R)::value;
      if (w.int4)
        int4_block<kR>(w.codes + b * K * 8, w.scales + b * KG * kLanes, w.mins + b * KG * kLanes, K, w.group,
                       a.q.data() + r0 * K, a.d.data() + r0 * C, a.sum.data() + r0 * KG, ldo, out + r0 * ldo, mask);
      else
        int8_block<kR>(reinterpret_cast<const int8_t*>(w.codes) + b * K * kLanes, w.lane_scales + b * kLanes, K,
                       a.q.data() + r0 * K, a.d.data() + r0 * C, a.qsum.data() + r0 * C, ldo, out + r0 * ldo, mask);
    };
    switch (std::min(kTile, M - r0)) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 4: run(std::integral_constant<int, 4>()); break;
      case 5: run(std::integral_constant<int, 5>()); break;
      case 6: run(std::integral_constant<int, 6>()); break;
      case 7: run(std::integral_constant<int, 7>()); break;
      default: run(std::integral_constant<int, 8>()); break;
    }
  }
}

// The bytes of block b that project_block reads before its own prefetches reach them: the first
// kAheadBytes of its codes and the scales and mins as far.
void prefetch_block(const QWeight& w, int64_t b) {
  if (b >= w.blocks) return;
  const int64_t row_bytes = w.int4 ? w.k / 2 : w.k, codes = std::min(kAheadBytes, row_bytes * kLanes);
  const char* c = reinterpret_cast<const char*>(w.codes) + b * row_bytes * kLanes;
  for (int64_t i = 0; i < codes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
  if (!w.int4) return;
  const int64_t KG = w.k / w.group, side = std::min<int64_t>(2 * kAheadBytes / w.group, KG * kLanes) * 2;
  const char* d = reinterpret_cast<const char*>(w.scales + b * KG * kLanes);
  const char* m = reinterpret_cast<const char*>(w.mins + b * KG * kLanes);
  for (int64_t i = 0; i < side; i += 64) _mm_prefetch(d + i, _MM_HINT_T1), _mm_prefetch(m + i, _MM_HINT_T1);
}

// x (M, K) @ w.T -> out (M, n), the blocks split over torch's threads.
void project(const QWeight& w, const float* x, int64_t M, float* out) {
  Acts a;
  quantize_acts(x, M, w.k, w.int4 ? w.group : w.k, a);
  at::parallel_for(0, w.blocks, grain(w.blocks), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) project_block(w, a, M, b, out + b * kLanes, w.n);
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
  QWeight w;
  w.codes = codes.data_ptr<uint8_t>();
  w.scales = scales.data_ptr<at::Half>();
  w.mins = mins.data_ptr<at::Half>();
  w.n = n, w.k = K, w.group = group_size, w.blocks = codes.size(0);
  project(w, x.data_ptr<float>(), M, out.data_ptr<float>());
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
  QWeight w;
  w.int4 = false;
  w.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>());
  w.lane_scales = scales.data_ptr<float>();
  w.n = n, w.k = K, w.group = K, w.blocks = codes.size(0);
  project(w, x.data_ptr<float>(), M, out.data_ptr<float>());
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
// (flash-decoding: each part's softmax is merged by its largest score). The work is tasks
// (pair, part), run by task(), then one merge() per pair.
struct Attention {
  const float* q;     // (B, KV, S, G, D): a pair's G query heads together
  const float* k;     // (B, KV, T, D), as v
  const float* v;
  const bool* mask;   // (B, S, T)
  const float* bias;  // (B, H, S, T) or null
  int64_t B, KV, S, G, D, T, used, pairs, parts, span;
  float scale;
  std::vector<float> top, total, acc;

  Attention(const float* q_, const float* k_, const float* v_, const bool* mask_, const float* bias_, int64_t B_,
            int64_t KV_, int64_t S_, int64_t G_, int64_t D_, int64_t T_, float scale_, int64_t threads)
      : q(q_), k(k_), v(v_), mask(mask_), bias(bias_), B(B_), KV(KV_), S(S_), G(G_), D(D_), T(T_), scale(scale_) {
    pairs = B * KV * S;
    // keys past the last one any query may see are never touched: a static buffer is mostly
    // unwritten, and splitting the whole buffer gave the parts near its end nothing to do
    used = 0;
    for (int64_t r = 0; r < B * S; ++r)
      for (int64_t j = T - 1; j >= used; --j)
        if (mask[r * T + j]) {
          used = j + 1;
          break;
        }
    // parts of at least 64 keys, enough for two tasks a thread
    parts = std::max<int64_t>(1, std::min<int64_t>(used / 64, (2 * threads + pairs - 1) / pairs));
    span = (used + parts - 1) / parts;
    top.resize(pairs * parts * G);
    total.resize(pairs * parts * G);
    acc.resize(pairs * parts * G * D);
  }

  int64_t tasks() const { return pairs * parts; }

  // Task t = pair * parts + part; s: G * span floats of scratch.
  void task(int64_t t, float* s) {
    const int64_t pair = t / parts, b = pair / (KV * S), h = (pair / S) % KV, i = pair % S;
    const int64_t j0 = std::min(used, (t % parts) * span), j1 = std::min(used, j0 + span);
    const float* kt = k + (b * KV + h) * T * D;
    const float* vt = v + (b * KV + h) * T * D;
    const bool* mt = mask + (b * S + i) * T;
    // bias (b, h * G + g, i, :): heads of a group are S * T apart
    const float* bt = bias ? bias + ((b * KV * G + h * G) * S + i) * T : nullptr;
    float *tp = top.data() + t * G, *sp = total.data() + t * G, *ap = acc.data() + t * G * D;
    switch (D / kLanes) {
#define LLM_ATTEND(DV) \
  case DV: attend<DV>(q + pair * G * D, G, kt, vt, mt, bt, S * T, j0, j1, scale, s, tp, sp, ap); break;
      LLM_ATTEND(1) LLM_ATTEND(2) LLM_ATTEND(3) LLM_ATTEND(4) LLM_ATTEND(5) LLM_ATTEND(6) LLM_ATTEND(7) LLM_ATTEND(8)
#undef LLM_ATTEND
    }
  }

  // The pair's G heads of output, (G, D) at o.
  void merge(int64_t pair, float* o_pair) const {
    for (int64_t g = 0; g < G; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) {
        const float x = top[(pair * parts + p) * G + g];
        if (!(x <= best)) best = x;
      }
      float weight_sum = 0.f;
      float* o = o_pair + g * D;
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
};

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
  const int64_t G = H / KV;
  const at::Tensor q = q_in.view({B, KV, G, S, D}).transpose(2, 3).contiguous();
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous(), mask = mask_in.contiguous();
  at::Tensor out = at::empty({B, KV, S, G, D}, q.options());
  if (out.numel() == 0 || T == 0) return out.zero_().transpose(2, 3).reshape({B, H, S, D});
  Attention attn(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<bool>(),
                 bias.defined() ? bias.data_ptr<float>() : nullptr, B, KV, S, G, D, T, static_cast<float>(scale),
                 at::get_num_threads());
  at::parallel_for(0, attn.tasks(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(G * attn.span);
    for (int64_t t = t0; t < t1; ++t) attn.task(t, s.data());
  });
  float* op = out.data_ptr<float>();
  for (int64_t pair = 0; pair < attn.pairs; ++pair) attn.merge(pair, op + pair * G * D);
  return out.transpose(2, 3).reshape({B, H, S, D});
}

// out (M, D) = rmsnorm(x) * weight per row, as torch's rms_norm in float32: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_rows(const float* x, const float* weight, int64_t M, int64_t D, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * D;
    double ss = 0.0;  // in double: the mean is then float's rounding of the exact one, whatever the order
    for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(r[d]) * r[d];
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = (r[d] * inv) * weight[d];
  }
}

// x rotated by rotary position embedding in transformers' Llama layout (rotate_half): out =
// x * cos + roll(x, D / 2) * sin, sin's first half negated by the caller (RotaryEmbedding's).
void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  if (!cos) {
    std::memcpy(out, x, D * sizeof(float));
    return;
  }
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) out[d] = x[d] * cos[d] + x[(d + half) % D] * sin[d];
}

QWeight qweight(const c10::List<c10::optional<at::Tensor>>& weights, int64_t i, int64_t n, int64_t k, const char* name) {
  const c10::optional<at::Tensor> codes = weights.get(3 * i), scales = weights.get(3 * i + 1), mins = weights.get(3 * i + 2);
  TORCH_CHECK(codes.has_value() && scales.has_value(), name, ": codes and scales are required");
  QWeight w;
  w.n = n, w.k = k, w.blocks = (n + kLanes - 1) / kLanes;
  TORCH_CHECK(n > 0, name, ": out_features ", n, " must be positive");
  TORCH_CHECK(k > 0 && k % kGroup == 0, name, ": in_features ", k, " is not a positive multiple of 32");
  TORCH_CHECK(codes->is_cpu() && scales->is_cpu() && (!mins.has_value() || mins->is_cpu()), name,
              ": weights must be on the CPU");
  TORCH_CHECK(codes->is_contiguous() && codes->dim() == 4 && codes->size(0) == w.blocks && codes->size(2) == kLanes &&
                  codes->size(3) == 4 && scales->is_contiguous(),
              name, ": codes of shape ", codes->sizes(), " do not match ", n, " outputs of ", k, " inputs");
  if (codes->scalar_type() == at::kByte) {
    TORCH_CHECK(codes->size(1) == k / 8 && mins.has_value() && mins->is_contiguous() &&
                    scales->scalar_type() == at::kHalf && mins->scalar_type() == at::kHalf &&
                    mins->numel() == scales->numel() && scales->numel() % (w.blocks * kLanes) == 0,
                name, ": int4 codes need float16 scales and mins (blocks, K / group_size, 16)");
    const int64_t groups = scales->numel() / (w.blocks * kLanes);
    TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % kGroup == 0, name, ": ", groups,
                " groups do not divide ", k, " inputs into multiples of 32");
    w.group = k / groups;
    w.codes = codes->data_ptr<uint8_t>();
    w.scales = scales->data_ptr<at::Half>();
    w.mins = mins->data_ptr<at::Half>();
  } else {
    TORCH_CHECK(codes->scalar_type() == at::kChar && codes->size(1) == k / 4 && scales->scalar_type() == at::kFloat &&
                    scales->numel() == w.blocks * kLanes,
                name, ": int8 codes need float32 scales (blocks * 16,)");
    w.int4 = false;
    w.group = k;
    w.codes = reinterpret_cast<const uint8_t*>(codes->data_ptr<int8_t>());
    w.lane_scales = scales->data_ptr<float>();
  }
  return w;
}

// x (M, n) += block b of w's product with a (a residual connection); tmp: M * 16 floats.
void add_block(const QWeight& w, const Acts& a, int64_t M, int64_t b, float* tmp, float* x, int64_t n) {
  project_block(w, a, M, b, tmp, kLanes);
  const int64_t width = std::min(kLanes, n - b * kLanes);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t l = 0; l < width; ++l) x[m * n + b * kLanes + l] += tmp[m * kLanes + l];
}

// Consecutive pre-norm Llama blocks (RMSNorm, attention with rotary positions over a static
// cache, RMSNorm, SiLU-gated FFN, no biases) for a few new tokens, in one call: one OpenMP team
// for all of them, the steps separated by its barriers (llama.cpp's graph compute: one thread
// pool, a barrier between nodes), instead of a call (and a wake-up of the threads) per operation
// and one from Python per block. The arithmetic is the separate kernels': int8 activations per 32
// inputs for every projection. Steps whose input is small (the norms, the quantized activations,
// the merge of attention's parts) are done by every thread into its own buffers rather than by
// one behind a barrier; each thread, done with its share of a projection, prefetches the start of
// its share of the next one while it waits for the others.
at::Tensor decoder_blocks_cpu(const at::Tensor& x_in, at::TensorList norms, double eps,
                              const c10::List<c10::optional<at::Tensor>>& weights, at::IntArrayRef out_features,
                              const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in,
                              at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cache_position_in,
                              const at::Tensor& mask_in, int64_t n_heads, double scale) {
  TORCH_CHECK(supported(), "llm CPU kernels need AVX512-VNNI");
  TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat && x_in.is_cpu(),
              "x must be a float32 CPU tensor (batch, seq, d_model), got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && v_caches.size() == k_caches.size() && norms.size() == 2 * k_caches.size() &&
                  weights.size() == 15 * k_caches.size(),
              "one block's k_cache and v_cache, two norm weights and 15 weights each: got ", k_caches.size(), ", ",
              v_caches.size(), ", ", norms.size(), " and ", weights.size());
  const int64_t B = x_in.size(0), S = x_in.size(1), Dm = x_in.size(2), M = B * S;
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 4 && k0.size(0) == B, "k_cache must be (batch, kv_n_heads, capacity, head_dim), got ",
              k0.sizes());
  const int64_t KV = k0.size(1), T = k0.size(2), D = k0.size(3), H = n_heads;
  TORCH_CHECK(KV > 0 && H % KV == 0 && D % kLanes == 0 && D > 0 && D <= 8 * kLanes,
              "n_heads ", H, " must be a multiple of kv_n_heads ", KV, " and head_dim ", D,
              " a multiple of 16 up to 128");
  TORCH_CHECK(out_features.size() == 5, "out_features must be those of Wqkv, out_proj, gate_proj, up_proj, down_proj");
  const int64_t Nqkv = (H + 2 * KV) * D, hidden = out_features[2];
  TORCH_CHECK(out_features[0] == Nqkv && out_features[1] == Dm && out_features[3] == hidden && out_features[4] == Dm,
              "out_features ", out_features, " do not fit d_model ", Dm, " and ", H, " + 2 * ", KV, " heads of ", D);
  struct Layer {
    QWeight wqkv, wo, wgate, wup, wdown;
    const float *n1, *n2;
    float *kc, *vc;
  };
  std::vector<Layer> layers(L);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
    TORCH_CHECK(kc.sizes() == k0.sizes() && vc.sizes() == k0.sizes() && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_cpu() && vc.is_cpu(),
                "k_cache and v_cache must be contiguous float32 CPU tensors (batch, kv_n_heads, capacity, head_dim) = ",
                k0.sizes(), ", got ", kc.sizes(), " and ", vc.sizes(), " for block ", l);
    const at::Tensor &n1 = norms[2 * l], &n2 = norms[2 * l + 1];
    TORCH_CHECK(n1.numel() == Dm && n2.numel() == Dm && n1.scalar_type() == at::kFloat &&
                    n2.scalar_type() == at::kFloat && n1.is_contiguous() && n2.is_contiguous() && n1.is_cpu() &&
                    n2.is_cpu(),
                "norm weights must be contiguous float32 CPU tensors (d_model,)");
    const int64_t w = 5 * l;
    Layer& y = layers[l];
    y.wqkv = qweight(weights, w, Nqkv, Dm, "Wqkv"), y.wo = qweight(weights, w + 1, Dm, H * D, "out_proj");
    y.wgate = qweight(weights, w + 2, hidden, Dm, "gate_proj"), y.wup = qweight(weights, w + 3, hidden, Dm, "up_proj");
    y.wdown = qweight(weights, w + 4, Dm, hidden, "down_proj");
    TORCH_CHECK(y.wgate.int4 == y.wup.int4 && y.wgate.group == y.wup.group,
                "gate_proj and up_proj must be quantized alike (they share the quantized input)");
    y.n1 = n1.data_ptr<float>(), y.n2 = n2.data_ptr<float>();
    y.kc = kc.data_ptr<float>(), y.vc = vc.data_ptr<float>();
  }
  TORCH_CHECK(cos_in.has_value() == sin_in.has_value(), "cos and sin come together");
  at::Tensor cos, sin;
  if (cos_in.has_value()) {
    cos = cos_in->contiguous(), sin = sin_in->contiguous();
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_cpu() && sin.is_cpu() && cos.sizes() == sin.sizes() &&
                    cos.dim() == 3 &&
                    (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == S && cos.size(2) == D,
                "cos and sin must be float32 (batch or 1, seq, head_dim), got ", cos.sizes(), " and ", sin.sizes());
  }
  TORCH_CHECK(cache_position_in.is_cpu() && !at::isFloatingType(cache_position_in.scalar_type()) &&
                  cache_position_in.scalar_type() != at::kBool,
              "cache_position must be an integer CPU tensor, got ", cache_position_in.scalar_type());
  const at::Tensor positions = cache_position_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == S, "cache_position must be (seq,), got ", positions.sizes());
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(pos[s] >= 0 && pos[s] < T, "cache_position ", pos[s], " is outside the buffer of ", T);
  const at::Tensor mask = mask_in.contiguous();
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_cpu() && mask.dim() == 3 && mask.size(0) == B &&
                  mask.size(1) == S && mask.size(2) == T,
              "mask must be bool (batch, seq, capacity) = (", B, ", ", S, ", ", T, "), got ", mask.sizes());

  at::Tensor out = x_in.contiguous().clone();
  if (M == 0) return out;
  float* x = out.data_ptr<float>();
  const int64_t G = H / KV;
  std::vector<float> qkv(M * Nqkv), q(M * H * D), act(M * hidden);
  const float* cp = cos.defined() ? cos.data_ptr<float>() : nullptr;
  const float* sp = cos.defined() ? sin.data_ptr<float>() : nullptr;
  const int64_t cos_rows = cos.defined() ? cos.size(0) : 1;
  const int threads = at::get_num_threads();
  Attention attn(q.data(), layers[0].kc, layers[0].vc, mask.data_ptr<bool>(), nullptr, B, KV, S, G, D, T,
                 static_cast<float>(scale), threads);
  const float feps = static_cast<float>(eps);

#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t team = 1, me = 0;
#endif
    // this thread's blocks of a projection under schedule(static): the first `blocks % team` threads one more
    auto share = [&](int64_t blocks) {
      const int64_t base = blocks / team, extra = blocks % team;
      return me * base + std::min(me, extra);
    };
    auto warm = [&](const QWeight& w) { prefetch_block(w, share(w.blocks)); };
    std::vector<float> s(G * attn.span), t1(M * kLanes), t2(M * kLanes), h(M * std::max(Dm, hidden)),
        attn_out(M * H * D);
    Acts a;
    for (int64_t l = 0; l < L; ++l) {
      const Layer& y = layers[l];
      // x + out_proj(attention(norm_1(x)))
      rms_norm_rows(x, y.n1, M, Dm, feps, h.data());
      quantize_acts(h.data(), M, Dm, y.wqkv.group, a);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wqkv.blocks; ++b) project_block(y.wqkv, a, M, b, qkv.data() + b * kLanes, Nqkv);
      warm(y.wo);
#pragma omp barrier
#pragma omp single
      {
        // rotate the query and key heads; queries to (batch, kv head, seq, group, head_dim), keys and
        // values to their buffer positions
        attn.k = y.kc, attn.v = y.vc;
        for (int64_t m = 0; m < M; ++m) {
          const int64_t b = m / S, i = m % S;
          const float* row = qkv.data() + m * Nqkv;
          const float* c = cp ? cp + ((b % cos_rows) * S + i) * D : nullptr;
          const float* sn = sp ? sp + ((b % cos_rows) * S + i) * D : nullptr;
          for (int64_t hd = 0; hd < H; ++hd)
            rotate(row + hd * D, c, sn, D, q.data() + (((b * KV + hd / G) * S + i) * G + hd % G) * D);
          for (int64_t j = 0; j < KV; ++j) {
            const int64_t at_ = ((b * KV + j) * T + pos[i]) * D;
            rotate(row + (H + j) * D, c, sn, D, y.kc + at_);
            std::memcpy(y.vc + at_, row + (H + KV + j) * D, D * sizeof(float));
          }
        }
      }
#pragma omp for schedule(static) nowait
      for (int64_t t = 0; t < attn.tasks(); ++t) attn.task(t, s.data());
#pragma omp barrier
      for (int64_t pair = 0; pair < attn.pairs; ++pair) {
        const int64_t b = pair / (KV * S), j = (pair / S) % KV, i = pair % S;
        attn.merge(pair, attn_out.data() + ((b * S + i) * H + j * G) * D);
      }
      quantize_acts(attn_out.data(), M, H * D, y.wo.group, a);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wo.blocks; ++b) add_block(y.wo, a, M, b, t1.data(), x, Dm);
      warm(y.wgate), warm(y.wup);
#pragma omp barrier
      // x + down_proj(silu(gate_proj(h)) * up_proj(h)), h = norm_2(x)
      rms_norm_rows(x, y.n2, M, Dm, feps, h.data());
      quantize_acts(h.data(), M, Dm, y.wgate.group, a);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wgate.blocks; ++b) {
        project_block(y.wgate, a, M, b, t1.data(), kLanes);
        project_block(y.wup, a, M, b, t2.data(), kLanes);
        const int64_t width = std::min(kLanes, hidden - b * kLanes);
        for (int64_t m = 0; m < M; ++m) {
          const __m512 g = _mm512_loadu_ps(t1.data() + m * kLanes), u = _mm512_loadu_ps(t2.data() + m * kLanes);
          const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
          _mm512_mask_storeu_ps(act.data() + m * hidden + b * kLanes, lanes_mask(width), _mm512_mul_ps(silu, u));
        }
      }
      warm(y.wdown);
#pragma omp barrier
      quantize_acts(act.data(), M, hidden, y.wdown.group, a);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wdown.blocks; ++b) add_block(y.wdown, a, M, b, t1.data(), x, Dm);
      if (l + 1 < L) warm(layers[l + 1].wqkv);
#pragma omp barrier
    }
  }
  return out;
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
at::Tensor decoder_blocks_cpu(const at::Tensor&, at::TensorList, double, const c10::List<c10::optional<at::Tensor>>&,
                              at::IntArrayRef, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                              at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&, int64_t, double) {
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
  m.def("decoder_blocks(Tensor x, Tensor[] norms, float eps, Tensor?[] weights, int[] out_features, Tensor? cos, "
        "Tensor? sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cache_position, Tensor mask, int n_heads, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm, CPU, m) {
  m.impl("int4_linear", &int4_linear_cpu);
  m.impl("int8_linear", &int8_linear_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("decoder_blocks", &decoder_blocks_cpu);
}
