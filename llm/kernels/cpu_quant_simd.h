// The kernels of cpu_quant.cpp, written once over 16-lane vectors and included twice there: in
// namespace llm_avx512 (AVX512-VNNI: one zmm a vector, vpdpbusd) and in llm_avx2 (AVX2 + FMA + F16C:
// two ymm a vector, vpmaddubsw + vpmaddwd, as ggml's AVX2 dot products). No include guard on purpose.
//
// Exactness: every token's row is computed alone, in an order that depends neither on the other
// rows of the call nor on the threads (see Attention), so a token's outputs are the same bits in a
// prefill, a one-token step, a speculative chunk or a batch.

// ---- 16-lane vectors: F (float), I (int32 or 64 bytes) ------------------------------------------
#ifdef LLM_AVX512
using F = __m512;
using I = __m512i;
inline F fzero() { return _mm512_setzero_ps(); }
inline F fset(float a) { return _mm512_set1_ps(a); }
inline F fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, F a) { _mm512_storeu_ps(p, a); }
inline __mmask16 first(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
inline void fstore_n(float* p, F a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a); }
inline F fload_n(const float* p, int64_t n, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p); }
inline F fadd(F a, F b) { return _mm512_add_ps(a, b); }
inline F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fdiv(F a, F b) { return _mm512_div_ps(a, b); }
inline F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F ffnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
inline F fmax(F a, F b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline F fmin(F a, F b) { return _mm512_min_ps(a, b); }
inline F fabs_(F a) { return _mm512_abs_ps(a); }
inline float fsum(F a) { return _mm512_reduce_add_ps(a); }
inline float fmaxr(F a) { return _mm512_reduce_max_ps(a); }
inline F fhalf(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline F fround(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F fscale2(F p, F n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
// y where x is not -inf (NaN included), else 0
inline F fwhere_real(F x, F y) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), y); }
// y where x >= lo, else 0 (NaN: 0)
inline F fwhere_ge(F x, F lo, F y) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }
inline bool fany_positive(F x) { return _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ) != 0; }
inline bool fany_ge(F x, F lo) { return _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ) != 0; }
inline I izero() { return _mm512_setzero_si512(); }
inline I iset(int32_t a) { return _mm512_set1_epi32(a); }
inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
inline F itof(I a) { return _mm512_cvtepi32_ps(a); }
inline I ftoi(F a) { return _mm512_cvtps_epi32(a); }  // round to nearest even
inline int32_t isum(I a) { return _mm512_reduce_add_epi32(a); }
inline void store_i8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a)); }
inline I bload(const void* p) { return _mm512_loadu_si512(p); }
// int4 codes, 4 bytes a lane: the low nibbles, and the high ones masked in place (16 times too
// large; int4_sum undoes it)
inline void nibbles(I v, I& lo, I& hi) {
  lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
  hi = _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(0xF0)));
}
inline I int4_sum(I lo, I hi) { return _mm512_add_epi32(_mm512_slli_epi32(lo, 4), hi); }  // 16 * (lo + hi)
// acc + 4-byte dot products, unsigned bytes u times signed bytes s
inline I dot_u8(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
// vpdpbusd needs one unsigned operand: int8 weights enter as w + 128, and 128 * sum(x) is taken off
constexpr int32_t kInt8Bias = 128;
inline I int8_weights(const void* p) { return _mm512_xor_si512(bload(p), _mm512_set1_epi8(static_cast<char>(0x80))); }
inline I dot_w8(I acc, I w, I x) { return dot_u8(acc, w, x); }
#else
struct F {
  __m256 a, b;
};
struct I {
  __m256i a, b;
};
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F v) { _mm256_storeu_ps(p, v.a), _mm256_storeu_ps(p + 8, v.b); }
inline void fstore_n(float* p, F v, int64_t n) {
  if (n >= 16) return fstore(p, v);
  alignas(64) float t[16];
  fstore(t, v);
  std::memcpy(p, t, n * sizeof(float));
}
inline F fload_n(const float* p, int64_t n, float fill) {
  if (n >= 16) return fload(p);
  alignas(64) float t[16];
  std::fill(t, t + 16, fill);
  std::memcpy(t, p, n * sizeof(float));
  return fload(t);
}
#define LLM_F2(name, op) \
  inline F name(F x, F y) { return {op(x.a, y.a), op(x.b, y.b)}; }
LLM_F2(fadd, _mm256_add_ps)
LLM_F2(fsub, _mm256_sub_ps)
LLM_F2(fmul, _mm256_mul_ps)
LLM_F2(fdiv, _mm256_div_ps)
LLM_F2(fmax, _mm256_max_ps)  // y where either is NaN
LLM_F2(fmin, _mm256_min_ps)
#undef LLM_F2
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F ffnma(F x, F y, F z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline F fabs_(F x) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m)};
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float fsum(F x) { return hsum8(_mm256_add_ps(x.a, x.b)); }
inline float fmaxr(F x) {
  __m256 m = _mm256_max_ps(x.a, x.b);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline F fhalf(const at::Half* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))};
}
inline F fround(F x) {
  constexpr int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.a, r), _mm256_round_ps(x.b, r)};
}
// p * 2^n for integral n in [-150, 150] (exp's range): two factors 2^(n/2), each a normal float
inline __m256 scale2(__m256 p, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}
inline F fscale2(F p, F n) { return {scale2(p.a, n.a), scale2(p.b, n.b)}; }
inline F fwhere_real(F x, F y) {
  const __m256 inf = _mm256_set1_ps(-INFINITY);
  return {_mm256_and_ps(_mm256_cmp_ps(x.a, inf, _CMP_NEQ_UQ), y.a), _mm256_and_ps(_mm256_cmp_ps(x.b, inf, _CMP_NEQ_UQ), y.b)};
}
inline F fwhere_ge(F x, F lo, F y) {
  return {_mm256_and_ps(_mm256_cmp_ps(x.a, lo.a, _CMP_GE_OQ), y.a), _mm256_and_ps(_mm256_cmp_ps(x.b, lo.b, _CMP_GE_OQ), y.b)};
}
inline bool fany_positive(F x) {
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, zero, _CMP_GT_OQ), _mm256_cmp_ps(x.b, zero, _CMP_GT_OQ))) != 0;
}
inline bool fany_ge(F x, F lo) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, lo.a, _CMP_GE_OQ), _mm256_cmp_ps(x.b, lo.b, _CMP_GE_OQ))) != 0;
}
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I iset(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I iadd(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline F itof(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline I ftoi(F x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
inline int32_t isum(I x) {
  const __m256i s = _mm256_add_epi32(x.a, x.b);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
inline void store_i8(int8_t* p, I x) {
  // saturating packs work within 128-bit halves: put the four 32-bit quarters back in order
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(x.a, x.b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline I bload(const void* p) {
  const __m256i* q = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
// int4 codes, 4 bytes a lane: low and high nibbles as bytes 0..15 (vpmaddubsw's int16 sums of
// 240 * 127 * 2 would saturate, so the high ones are shifted down)
inline void nibbles(I v, I& lo, I& hi) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
}
inline I int4_sum(I lo, I hi) {  // 16 * (lo + hi), as the AVX-512 path's
  return {_mm256_slli_epi32(_mm256_add_epi32(lo.a, hi.a), 4), _mm256_slli_epi32(_mm256_add_epi32(lo.b, hi.b), 4)};
}
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// acc + 4-byte dot products, unsigned bytes u (< 128 here: no int16 saturation) times signed s
inline I dot_u8(I acc, I u, I s) { return {dot4(acc.a, u.a, s.a), dot4(acc.b, u.b, s.b)}; }
// int8 weights times int8 x: |w| times x with w's sign (|pair sums| <= 2 * 128 * 127 fit int16)
constexpr int32_t kInt8Bias = 0;
inline I int8_weights(const void* p) { return bload(p); }
inline I dot_w8(I acc, I w, I x) {
  return {dot4(acc.a, _mm256_abs_epi8(w.a), _mm256_sign_epi8(x.a, w.a)),
          dot4(acc.b, _mm256_abs_epi8(w.b), _mm256_sign_epi8(x.b, w.b))};
}
#endif

inline I broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return iset(v);
}

// ---- quantized projections --------------------------------------------------------------------

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

inline void quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, Acts& a) {
  const int64_t C = K / kGroup, KG = K / G, per = G / kGroup;  // chunks of 32 inputs a weight group
  a.q.resize(M * K);
  a.d.resize(M * C);
  a.qsum.resize(M * C);
  a.sum.assign(M * KG, 0.f);
  // (no division in the loop: by run-time sizes, three a chunk cost as much as quantizing it)
  for (int64_t i = 0, c = 0, g = 0, left = per; i < M * C; ++i) {
    const float* p = x + i * kGroup;
    const F u = fload(p), v = fload(p + 16);
    float amax = fmaxr(fmax(fabs_(u), fabs_(v)));
    // max drops NaN; a NaN or infinite input makes its group's scale NaN, so it reaches the output
    if (!std::isfinite(fsum(fadd(fabs_(u), fabs_(v))))) amax = std::numeric_limits<float>::quiet_NaN();
    const F inv = fset(amax > 0.f ? 127.f / amax : 0.f);  // NaN > 0 is false: codes 0
    const I qu = ftoi(fmul(u, inv)), qv = ftoi(fmul(v, inv));
    store_i8(a.q.data() + i * kGroup, qu);
    store_i8(a.q.data() + i * kGroup + 16, qv);
    a.d[i] = amax / 127.f;
    a.qsum[i] = isum(iadd(qu, qv));
    a.sum[g] += a.d[i] * static_cast<float>(a.qsum[i]);  // g: row i / C's group of chunk i % C
    if (++c == C)
      c = 0, ++g, left = per;
    else if (--left == 0)
      ++g, left = per;
  }
}

// 16 output rows for R tokens of int4 weights (each token's lanes computed alone). kG: the group
// size where it is known when compiling (kGroup, llama.cpp's), else 0 and G says it: a division by
// a run-time G in every group's prefetch address cost SmolLM2's 32-input groups a fifth of their time.
template <int R, int64_t kG>
void int4_block_in(const uint8_t* w, const at::Half* d, const at::Half* m, int64_t K, int64_t G_, const int8_t* xq,
                   const float* xd, const float* xs, int64_t ldo, float* out, int64_t width) {
  const int64_t G = kG ? kG : G_;
  const int64_t C = K / kGroup, KG = K / G;
  const F sixteenth = fset(1.f / 16.f);
  // the codes' products and the mins' terms in two sums, added at the end: one chain of additions
  // through both took SmolLM2's one-token projections two multiply-adds' latency a group
  F acc[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = fzero();
  for (int64_t g = 0; g < KG; ++g) {
    const F dv = fhalf(d + g * kLanes), dv16 = fmul(dv, sixteenth);
    // no mins: symmetric codes (GGUF Q4_0), min = -8 d (exact, as an fp16 min would hold it)
    const F mv = m ? fhalf(m + g * kLanes) : fmul(dv, fset(-8.f));
    // scales and mins as far ahead as the codes: 2 bytes a row per group against G / 2
    _mm_prefetch(reinterpret_cast<const char*>(d + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T1);
    if (m) _mm_prefetch(reinterpret_cast<const char*>(m + g * kLanes + 2 * kAheadBytes / G), _MM_HINT_T1);
    for (int64_t c = g * G / kGroup; c < (g + 1) * G / kGroup; ++c) {
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + c * 256 + kAheadBytes + j * 64), _MM_HINT_T1);
      I lo[4], hi[4];
      for (int j = 0; j < 4; ++j) nibbles(bload(w + (c * 4 + j) * 64), lo[j], hi[j]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + c * kGroup;
        I i0 = izero(), i1 = izero();
        for (int j = 0; j < 4; ++j) {
          i0 = dot_u8(i0, lo[j], broadcast4(xr + 8 * j));
          i1 = dot_u8(i1, hi[j], broadcast4(xr + 8 * j + 4));
        }
        acc[r] = ffma(itof(int4_sum(i0, i1)), fmul(dv16, fset(xd[r * C + c])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) acc_min[r] = ffma(mv, fset(xs[r * KG + g]), acc_min[r]);
  }
  for (int r = 0; r < R; ++r) fstore_n(out + r * ldo, fadd(acc[r], acc_min[r]), width);
}

template <int R>
void int4_block(const uint8_t* w, const at::Half* d, const at::Half* m, int64_t K, int64_t G, const int8_t* xq,
                const float* xd, const float* xs, int64_t ldo, float* out, int64_t width) {
  if (G == kGroup)
    int4_block_in<R, kGroup>(w, d, m, K, G, xq, xd, xs, ldo, out, width);
  else
    int4_block_in<R, 0>(w, d, m, K, G, xq, xd, xs, ldo, out, width);
}

// The int32 dot products of chunk c (32 inputs) of 16 rows of int8 weights with R tokens' codes.
// Always inlined: GCC made it a call per chunk (the dots through memory, a vzeroupper), which took
// the int8 kernel's in-cache rate from 50 to 52 GB/s on one Zen 4 core, and a decode 1-4% of its time.
// One prefetch a chunk (its first line of 8, kAheadBytes ahead), not one a line: the hardware
// prefetchers fetch the lines between, and a prefetch for each line took load slots and miss
// buffers from the loads. SmolLM2 Q8_0 decoded 1.34x as fast on one thread and 1.03-1.21x on two
// (AMD EPYC, Zen 4; paired medians of 8-20 alternating rounds in one process). The int4 kernel's
// chunks are half as long and it keeps a prefetch a line: one a chunk or every other chunk there
// was 10% slower.
template <int R>
__attribute__((always_inline)) inline void int8_dots(const int8_t* w, int64_t c, int64_t K, const int8_t* xq, const int32_t* xqs, I* dots) {
  const int64_t C = K / kGroup;
  I wv[8];
  _mm_prefetch(reinterpret_cast<const char*>(w + c * 512 + kAheadBytes), _MM_HINT_T1);
  for (int j = 0; j < 8; ++j) wv[j] = int8_weights(w + (c * 8 + j) * 64);
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xq + r * K + c * kGroup;
    I i0 = iset(-kInt8Bias * xqs[r * C + c]), i1 = izero();
    for (int j = 0; j < 8; j += 2) {
      i0 = dot_w8(i0, wv[j], broadcast4(xr + 4 * j));
      i1 = dot_w8(i1, wv[j + 1], broadcast4(xr + 4 * j + 4));
    }
    dots[r] = iadd(i0, i1);
  }
}

// 16 output rows for R tokens of int8 weights, a float scale per row.
template <int R>
void int8_block(const int8_t* w, const float* scale, int64_t K, const int8_t* xq, const float* xd,
                const int32_t* xqs, int64_t ldo, float* out, int64_t width) {
  const int64_t C = K / kGroup;
  F acc[R];
  I dots[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t c = 0; c < C; ++c) {
    int8_dots<R>(w, c, K, xq, xqs, dots);
    for (int r = 0; r < R; ++r) acc[r] = ffma(itof(dots[r]), fset(xd[r * C + c]), acc[r]);
  }
  const F sv = fload(scale);
  for (int r = 0; r < R; ++r) fstore_n(out + r * ldo, fmul(acc[r], sv), width);
}

// 16 output rows for R tokens of int8 weights in groups of G inputs, an fp16 scale per row and
// group (GGUF Q8_0's blocks: w = q * d, G = 32), applied per 32 inputs with the activations' scale;
// kG as int4_block_in's.
template <int R, int64_t kG>
void int8_group_block_in(const int8_t* w, const at::Half* d, int64_t K, int64_t G_, const int8_t* xq, const float* xd,
                         const int32_t* xqs, int64_t ldo, float* out, int64_t width) {
  const int64_t G = kG ? kG : G_;
  const int64_t C = K / kGroup, KG = K / G;
  F acc[R];
  I dots[R];
  for (int r = 0; r < R; ++r) acc[r] = fzero();
  for (int64_t g = 0; g < KG; ++g) {
    const F dv = fhalf(d + g * kLanes);
    _mm_prefetch(reinterpret_cast<const char*>(d + g * kLanes + kAheadBytes / G), _MM_HINT_T1);
    for (int64_t c = g * G / kGroup; c < (g + 1) * G / kGroup; ++c) {
      int8_dots<R>(w, c, K, xq, xqs, dots);
      for (int r = 0; r < R; ++r) acc[r] = ffma(itof(dots[r]), fmul(dv, fset(xd[r * C + c])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) fstore_n(out + r * ldo, acc[r], width);
}

template <int R>
void int8_group_block(const int8_t* w, const at::Half* d, int64_t K, int64_t G, const int8_t* xq, const float* xd,
                      const int32_t* xqs, int64_t ldo, float* out, int64_t width) {
  if (G == kGroup)
    int8_group_block_in<R, kGroup>(w, d, K, G, xq, xd, xqs, ldo, out, width);
  else
    int8_group_block_in<R, 0>(w, d, K, G, xq, xd, xqs, ldo, out, width);
}

// Block b of 16 output rows for the M tokens of a (quantized with w.group's sums), into out (row
// r at out + r * ldo, the block's first column at out), in tiles of at most kTile tokens.
inline void project_block(const QWeight& w, const Acts& a, int64_t M, int64_t b, float* out, int64_t ldo) {
  const int64_t width = std::min(kLanes, w.n - b * kLanes);
  const int64_t K = w.k, C = K / kGroup, KG = w.group == kGroup ? K / kGroup : K / w.group;
  for (int64_t r0 = 0; r0 < M; r0 += kTile) {
    auto run = [&](auto R) {
      constexpr int kR = decltype(R)::value;
      if (w.int4)
        int4_block<kR>(w.codes + b * K * 8, w.scales + b * KG * kLanes, w.mins ? w.mins + b * KG * kLanes : nullptr, K, w.group,
                       a.q.data() + r0 * K, a.d.data() + r0 * C, a.sum.data() + r0 * KG, ldo, out + r0 * ldo, width);
      else if (w.scales)
        int8_group_block<kR>(reinterpret_cast<const int8_t*>(w.codes) + b * K * kLanes, w.scales + b * KG * kLanes, K,
                             w.group, a.q.data() + r0 * K, a.d.data() + r0 * C, a.qsum.data() + r0 * C, ldo,
                             out + r0 * ldo, width);
      else
        int8_block<kR>(reinterpret_cast<const int8_t*>(w.codes) + b * K * kLanes, w.lane_scales + b * kLanes, K,
                       a.q.data() + r0 * K, a.d.data() + r0 * C, a.qsum.data() + r0 * C, ldo, out + r0 * ldo, width);
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

// x (M, K) @ w.T -> out (M, n), the blocks split over torch's threads.
inline void project(const QWeight& w, const float* x, int64_t M, float* out) {
  Acts a;
  quantize_acts(x, M, w.k, w.int4 ? w.group : w.k, a);
  at::parallel_for(0, w.blocks, pace_solo() ? w.blocks : grain(w.blocks), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) project_block(w, a, M, b, out + b * kLanes, w.n);
  });
}

// x (M, n) += block b of w's product with a (a residual connection); tmp: M * 16 floats.
inline void add_block(const QWeight& w, const Acts& a, int64_t M, int64_t b, float* tmp, float* x, int64_t n) {
  project_block(w, a, M, b, tmp, kLanes);
  const int64_t width = std::min(kLanes, n - b * kLanes);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t l = 0; l < width; ++l) x[m * n + b * kLanes + l] += tmp[m * kLanes + l];
}

// ---- attention --------------------------------------------------------------------------------

// exp(x) for 16 floats, Cephes' expf (as ggml's and Eigen's vectorized exp): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) from a degree-5 polynomial, times 2^n. About 1 ulp; NaN stays NaN; x
// below -104 (exp underflows to 0) is clamped there, since n ln2 would no longer cancel x, and
// above 100 (exp overflows to inf) to 100.
inline F exp16(F x) {
  x = fmin(fset(100.f), fmax(fset(-104.f), x));  // the second operand is returned for NaN
  const F n = fround(fmul(x, fset(1.44269504088896341f)));
  F r = ffnma(n, fset(0.693359375f), x);
  r = ffnma(n, fset(-2.12194440e-4f), r);
  F p = fset(1.9875691500e-4f);
  p = ffma(p, r, fset(1.3981999507e-3f));
  p = ffma(p, r, fset(8.3334519073e-3f));
  p = ffma(p, r, fset(4.1665795894e-2f));
  p = ffma(p, r, fset(1.6666665459e-1f));
  p = ffma(p, r, fset(5.0000001201e-1f));
  p = ffma(fmul(p, r), r, fadd(r, fset(1.f)));
  return fscale2(p, n);
}

// One query's heads of one kv head (grouped-query attention: G query heads read the same keys, so
// each key and value row is loaded once for all of them), over the keys of columns j0 .. j1 - 1 of
// a cache buffer that mask says to use, at most kSpan of them; head_dim = 16 * DV. Per head g it
// leaves the largest score top[g], the sum of exp(score - top[g]) total[g] and acc (G, D), the sum
// of those weights times the values, for the parts of the keys to be merged (flash-decoding).
// s: G * kSpan floats. The order of every sum counts the keys used alone (the c-th key used is
// the c-th term wherever it stands), so masked columns between them (a rejected draft, padding
// between a prefix and a request) change no bit.
template <int DV>
void attend(const float* q, int64_t G, const float* k, const float* v, const bool* mask, const float* bias,
            int64_t bias_stride, int64_t j0, int64_t j1, float scale, float* s, float* top, float* total,
            float* acc) {
  constexpr int64_t D = DV * kLanes;
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) top[g] = -inf;
  int64_t n = 0;  // keys used so far: s[g * kSpan + c] holds head g's score of the c-th
  for (int64_t j = j0; j < j1; ++j) {
    if (!mask[j]) continue;
    F kr[DV];
    for (int c = 0; c < DV; ++c) kr[c] = fload(k + j * D + c * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      F dot = fmul(fload(q + g * D), kr[0]);
      for (int c = 1; c < DV; ++c) dot = ffma(fload(q + g * D + c * kLanes), kr[c], dot);
      float score = fsum(dot) * scale;
      if (bias) score += bias[g * bias_stride + j];
      s[g * kSpan + n] = score;
      if (!(score <= top[g])) top[g] = score;  // NaN wins, so that it reaches the output
    }
    ++n;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = s + g * kSpan;
    F acc0[DV], acc1[DV];
    for (int c = 0; c < DV; ++c) acc0[c] = acc1[c] = fzero();
    total[g] = 0.f;
    if (n) {
      const F topv = fset(top[g]);
      F sum = fzero();
      for (int64_t c = 0; c < n; c += kLanes) {
        const F x = fload_n(row + c, n - c, -inf);
        // lanes past the last key (-inf) weigh exactly 0; NaN is unordered, so it is kept
        const F p = fwhere_real(x, exp16(fsub(x, topv)));
        fstore_n(row + c, p, n - c);
        sum = fadd(sum, p);
      }
      total[g] = fsum(sum);
      // the keys used alternate between two independent chains of additions per lane. A masked
      // row is never read: a static buffer's unwritten rows may hold anything.
      int64_t c = 0;
      for (int64_t j = j0; j < j1; ++j) {
        if (!mask[j]) continue;
        const F p = fset(row[c]);
        F* chain = (c++ & 1) ? acc1 : acc0;
        for (int d = 0; d < DV; ++d) chain[d] = ffma(p, fload(v + j * D + d * kLanes), chain[d]);
      }
    }
    for (int c = 0; c < DV; ++c) fstore(acc + g * D + c * kLanes, fadd(acc0[c], acc1[c]));
  }
}

// Attention of queries over a cache buffer, the keys each query may see given by a mask (a static
// cache's step, gpt-fast's shape, or a whole prompt), without the two batched products, the softmax
// and the masking as separate passes over the buffer; masked keys are neither read nor weighted.
// Scores, softmax and sums are float32, as the torch path's.
//
// Batch- and call-invariant by construction: the keys a query may see are cut into parts of kSpan
// keys, counting only those it may see, each part reduced in one fixed order and the parts merged
// in order (flash-decoding), whatever the other queries, the batch, the buffer offset (left
// padding), masked columns among its keys or the threads. Only who computes a part changes: with few (query, kv head)
// pairs each part is a task of its own (results kept, then merged), with many each pair is a task.
struct Attention {
  const float* q;     // (B, KV, S, G, D): a pair's G query heads together
  const bool* mask;   // (B, S, T)
  const float* bias;  // (B, H, S, T) or null
  int64_t B, KV, S, G, D, T, pairs, parts;
  float scale;
  bool split;
  // per (b, i) and part p: the buffer column of its first key, starts[(b * S + i) * (parts + 1) + p],
  // then one past its last key (a part of kSpan keys it may see spans more columns where some are masked)
  std::vector<int64_t> starts;
  std::vector<float> top, total, acc;

  Attention(const float* q_, const bool* mask_, const float* bias_, int64_t B_,
            int64_t KV_, int64_t S_, int64_t G_, int64_t D_, int64_t T_, float scale_, int64_t threads)
      : q(q_), mask(mask_), bias(bias_), B(B_), KV(KV_), S(S_), G(G_), D(D_), T(T_), scale(scale_) {
    pairs = B * KV * S;
    int64_t longest = 0;
    for (int64_t r = 0; r < B * S; ++r) {
      const bool* m = mask + r * T;
      longest = std::max<int64_t>(longest, std::count(m, m + T, true));
    }
    parts = std::max<int64_t>(1, (longest + kSpan - 1) / kSpan);
    starts.assign(B * S * (parts + 1), 0);
    for (int64_t r = 0; r < B * S; ++r) {
      const bool* m = mask + r * T;
      int64_t* st = starts.data() + r * (parts + 1);
      int64_t seen = 0, end = 0;
      for (int64_t j = 0; j < T; ++j) {
        if (!m[j]) continue;
        if (seen % kSpan == 0) st[seen / kSpan] = j;
        ++seen, end = j + 1;
      }
      for (int64_t p = (seen + kSpan - 1) / kSpan; p <= parts; ++p) st[p] = end;  // empty parts end it
    }
    split = pairs < 4 * threads && parts > 1;
    if (split) {
      top.resize(pairs * parts * G);
      total.resize(pairs * parts * G);
      acc.resize(pairs * parts * G * D);
    }
  }

  int64_t tasks() const { return split ? pairs * parts : pairs; }
  // scratch floats a thread needs for task(): scores, and a whole pair's parts when not split
  int64_t scratch() const { return G * kSpan + (split ? 0 : parts * G * (D + 2)); }

  // Part p of pair's keys (of k and v, (B, KV, T, D) each) into tp (G), sp (G), ap (G, D); s: G * kSpan floats.
  void part(int64_t pair, int64_t p, const float* k, const float* v, float* s, float* tp, float* sp, float* ap) const {
    const int64_t b = pair / (KV * S), h = (pair / S) % KV, i = pair % S, r = b * S + i;
    const int64_t j0 = starts[r * (parts + 1) + p], j1 = starts[r * (parts + 1) + p + 1];
    const float* kt = k + (b * KV + h) * T * D;
    const float* vt = v + (b * KV + h) * T * D;
    // bias (b, h * G + g, i, :): heads of a group are S * T apart
    const float* bt = bias ? bias + ((b * KV * G + h * G) * S + i) * T : nullptr;
    switch (D / kLanes) {
#define LLM_ATTEND(DV) \
  case DV: attend<DV>(q + pair * G * D, G, kt, vt, mask + r * T, bt, S * T, j0, j1, scale, s, tp, sp, ap); break;
      LLM_ATTEND(1) LLM_ATTEND(2) LLM_ATTEND(3) LLM_ATTEND(4) LLM_ATTEND(5) LLM_ATTEND(6) LLM_ATTEND(7) LLM_ATTEND(8)
#undef LLM_ATTEND
    }
  }

  // Task t over keys k and values v (B, KV, T, D): one part, kept for merge_kept(), or one pair,
  // merged into out (B, S, H, D).
  void task(int64_t t, const float* k, const float* v, float* scratch_, float* out) {
    if (split) {
      const int64_t at_ = t * G;
      part(t / parts, t % parts, k, v, scratch_, top.data() + at_, total.data() + at_, acc.data() + at_ * D);
      return;
    }
    float *tp = scratch_ + G * kSpan, *sp = tp + parts * G, *ap = sp + parts * G;
    for (int64_t p = 0; p < parts; ++p) part(t, p, k, v, scratch_, tp + p * G, sp + p * G, ap + p * G * D);
    merge(t, tp, sp, ap, out);
  }

  void merge_kept(int64_t pair, float* out) const {
    const int64_t at_ = pair * parts * G;
    merge(pair, top.data() + at_, total.data() + at_, acc.data() + at_ * D, out);
  }

  // The pair's G heads from its parts' (parts, G) tops and totals and (parts, G, D) sums, into out (B, S, H, D).
  void merge(int64_t pair, const float* tops, const float* totals, const float* accs, float* out) const {
    const int64_t b = pair / (KV * S), h = (pair / S) % KV, i = pair % S;
    float* o_pair = out + ((b * S + i) * KV + h) * G * D;
    for (int64_t g = 0; g < G; ++g) {
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) {
        const float x = tops[p * G + g];
        if (!(x <= best)) best = x;
      }
      float weight_sum = 0.f;
      float* o = o_pair + g * D;
      std::fill(o, o + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t at_ = p * G + g;
        if (totals[at_] == 0.f) continue;  // no key in this part (and none NaN)
        const float w = std::exp(tops[at_] - best);
        weight_sum += w * totals[at_];
        for (int64_t d = 0; d < D; ++d) o[d] += w * accs[at_ * D + d];
      }
      // nothing to attend to: zeros, as the torch path's (a NaN score makes weight_sum NaN)
      if (weight_sum != 0.f) {
        const float inv = 1.f / weight_sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
};

// attention over (B, KV, S, G, D) queries and keys k, values v (B, KV, T, D) into out (B, S, H, D),
// split over torch's threads
inline void attention(Attention& attn, const float* k, const float* v, float* out) {
  at::parallel_for(0, attn.tasks(), pace_solo() ? attn.tasks() : 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(attn.scratch());
    for (int64_t t = t0; t < t1; ++t) attn.task(t, k, v, s.data(), out);
  });
  if (attn.split)
    at::parallel_for(0, attn.pairs, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) attn.merge_kept(p, out);
    });
}

// ---- the fused blocks -------------------------------------------------------------------------

// out (M, D) = rmsnorm(x) * weight per row, as torch's rms_norm in float32: x * rsqrt(mean(x^2) + eps) * w.
inline void rms_norm_rows(const float* x, const float* weight, int64_t M, int64_t D, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * D;
    // in double: the mean is then float's rounding of the exact one, whatever the order (each square
    // is exact in double, and their sum's rounding error is 1e-13 of it); four chains of additions
    // rather than one of 4-cycle latency
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
      s0 += static_cast<double>(r[d]) * r[d], s1 += static_cast<double>(r[d + 1]) * r[d + 1];
      s2 += static_cast<double>(r[d + 2]) * r[d + 2], s3 += static_cast<double>(r[d + 3]) * r[d + 3];
    }
    for (; d < D; ++d) s0 += static_cast<double>(r[d]) * r[d];
    const double ss = (s0 + s1) + (s2 + s3);
    const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = (r[d] * inv) * (weight ? weight[d] : 1.f);
  }
}

// x rotated by rotary position embedding in transformers' Llama layout (rotate_half): out =
// x * cos + roll(x, D / 2) * sin, sin's first half negated by the caller (RotaryEmbedding's).
inline void rotate(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  if (!cos) {
    std::memcpy(out, x, D * sizeof(float));
    return;
  }
  const int64_t half = D / 2;  // two loops rather than an index modulo D: both vectorize
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin[d];
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// Consecutive pre-norm Llama blocks (RMSNorm, attention with rotary positions over a cache buffer,
// RMSNorm, SiLU-gated FFN, no biases) for any number of new tokens, in one call: one OpenMP team
// for all of them, the steps separated by its barriers (llama.cpp's graph compute: one thread
// pool, a barrier between nodes), instead of a call (and a wake-up of the threads) per operation
// and one from Python per block. Steps whose input is small (the norms, the quantized activations)
// are done by every thread into its own buffers rather than by one behind a barrier; each thread,
// done with its share of a projection, prefetches the start of its share of the next one while it
// waits for the others.
inline void run_blocks(const Blocks& a, float* x) {
  const int64_t M = a.B * a.S, H = a.H, KV = a.KV, D = a.D, T = a.T, S = a.S, G = H / KV, Dm = a.Dm,
                Nqkv = (H + 2 * KV) * D, hidden = a.hidden;
  std::vector<float> qkv(M * Nqkv), q(M * H * D), act(M * hidden), attn_out(M * H * D);
  const int threads = team_threads(at::get_num_threads());
  Attention attn(q.data(), a.mask, nullptr, a.B, KV, S, G, D, T, a.scale, threads);
  std::vector<double> cpu(threads, 0.0);
  int64_t team_size = 1;
  const auto started = std::chrono::steady_clock::now();

#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
#else
    const int64_t team = 1, me = 0;
#endif
    const double cpu0 = thread_cpu_s();
    // this thread's blocks of a projection under schedule(static): the first `blocks % team` threads one more
    auto share = [&](int64_t blocks) {
      const int64_t base = blocks / team, extra = blocks % team;
      return me * base + std::min(me, extra);
    };
    // the fused qkv projection is shared in whole heads (head_dim / 16 blocks each), so that each
    // thread rotates and stores the heads it computed, with no step (and barrier) of its own
    const int64_t heads = H + 2 * KV, per_head = D / kLanes;
    const int64_t h0 = share(heads), h1 = h0 + heads / team + (me < heads % team ? 1 : 0);
    auto warm = [&](const QWeight& w) { prefetch_block(w, share(w.blocks)); };
    std::vector<float> s(attn.scratch()), t1(M * kLanes), t2(M * kLanes), h(M * std::max(Dm, hidden));
    Acts acts;
    for (const Layer& y : a.layers) {
      // x + out_proj(attention(norm_1(x)))
      rms_norm_rows(x, y.n1, M, Dm, a.eps, h.data());
      quantize_acts(h.data(), M, Dm, y.wqkv.group, acts);
      for (int64_t b = h0 * per_head; b < h1 * per_head; ++b)
        project_block(y.wqkv, acts, M, b, qkv.data() + b * kLanes, Nqkv);
      // this thread's heads rotated: queries to (batch, kv head, seq, group, head_dim), keys and
      // values to their buffer positions
      for (int64_t m = 0; m < M; ++m) {
        const int64_t b = m / S, i = m % S;
        const float* row = qkv.data() + m * Nqkv;
        const float* c = a.cos ? a.cos + ((b % a.cos_rows) * S + i) * D : nullptr;
        const float* sn = a.sin ? a.sin + ((b % a.cos_rows) * S + i) * D : nullptr;
        for (int64_t hd = h0; hd < h1; ++hd) {
          if (hd < H) {
            rotate(row + hd * D, c, sn, D, q.data() + (((b * KV + hd / G) * S + i) * G + hd % G) * D);
          } else if (hd < H + KV) {
            rotate(row + hd * D, c, sn, D, y.kc + ((b * KV + hd - H) * T + a.pos[i]) * D);
          } else {
            std::memcpy(y.vc + ((b * KV + hd - H - KV) * T + a.pos[i]) * D, row + hd * D, D * sizeof(float));
          }
        }
      }
      warm(y.wo);
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t t = 0; t < attn.tasks(); ++t) attn.task(t, y.kc, y.vc, s.data(), attn_out.data());
      if (attn.split) {
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < attn.pairs; ++pair) attn.merge_kept(pair, attn_out.data());
      }
      quantize_acts(attn_out.data(), M, H * D, y.wo.group, acts);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wo.blocks; ++b) add_block(y.wo, acts, M, b, t1.data(), x, Dm);
      warm(y.wgate), warm(y.wup);
#pragma omp barrier
      // x + down_proj(silu(gate_proj(h)) * up_proj(h)), h = norm_2(x)
      rms_norm_rows(x, y.n2, M, Dm, a.eps, h.data());
      quantize_acts(h.data(), M, Dm, y.wgate.group, acts);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wgate.blocks; ++b) {
        project_block(y.wgate, acts, M, b, t1.data(), kLanes);
        project_block(y.wup, acts, M, b, t2.data(), kLanes);
        const int64_t width = std::min(kLanes, hidden - b * kLanes);
        for (int64_t m = 0; m < M; ++m) {
          const F g = fload(t1.data() + m * kLanes), u = fload(t2.data() + m * kLanes);
          const F silu = fdiv(g, fadd(fset(1.f), exp16(fsub(fzero(), g))));
          fstore_n(act.data() + m * hidden + b * kLanes, fmul(silu, u), width);
        }
      }
      warm(y.wdown);
#pragma omp barrier
      quantize_acts(act.data(), M, hidden, y.wdown.group, acts);
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < y.wdown.blocks; ++b) add_block(y.wdown, acts, M, b, t1.data(), x, Dm);
      if (&y != &a.layers.back()) prefetch_block((&y + 1)->wqkv, h0 * per_head);
#pragma omp barrier
    }
    cpu[me] = thread_cpu_s() - cpu0;
    if (me == 0) team_size = team;
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  observe(static_cast<int>(team_size), wall, *std::min_element(cpu.begin(), cpu.begin() + team_size));
}

// ---- sampling -----------------------------------------------------------------------------------

// e[i] = exp(x[i] / t - top) for x[i] / t >= floor, else 0, over n floats; returns their sum
// (in double). The quotient is rounded as torch's logits / temperature. An exp below float's
// smallest normal number (x / t - top < -87.34) is 0: subnormal results take the FPU's slow path,
// which at a low temperature, where most of a vocabulary's exps are that small, made this pass
// several times slower. Such a weight (1e-38 of the top one's) changes no running sum of the draw
// that can reach its target; the draw could only have picked it for a uniform number of exactly 0,
// or in the fallback for one within 2^-53 of 1.
inline double exp_shifted(const float* x, int64_t n, float t, float floor_, float top, float* e) {
  const float inf = std::numeric_limits<float>::infinity();
  const F topv = fset(top), tv = fset(t), floorv = fset(floor_), least = fset(-87.33654f);  // ln(FLT_MIN)
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const F v = fdiv(fload_n(x + i, n - i, -inf), tv), d = fsub(v, topv);
    // below the floor (top-k's), -inf (past the end too), a subnormal exp: weight exactly 0
    const F p = fwhere_ge(v, floorv, fwhere_ge(d, least, exp16(fmax(d, least))));
    fstore_n(e + i, p, n - i);
    sum += fsum(p);
  }
  return sum;
}

// Of the tokens ids[0..n) (ascending; ids null: 0..n-1) of probability p = e * inv > 0, the first
// whose running sum of p (double) exceeds u times their total; the last one where rounding leaves
// none (Sampler.draw's inverse transform, the sums in the same order: the same bits).
//
// Over all tokens the products are made 16 at a time, and a run of 16 none of which can change the
// running sum is skipped: a p below half a unit in the last place of the sum leaves it unchanged
// (round to nearest), so the skipped additions are exactly those that do nothing. The bound
// taken, sum * 2^-55, is below every such half unit. Past the few likely tokens of a distribution
// (at a low temperature most of a vocabulary's p are 1e-20 of the top one's or 0), nearly every
// run is skipped, where one addition after another (4 cycles each, and a branch on p > 0 that
// mispredicts) made the draw a tenth of a decoding step.
inline int64_t inverse_transform(const int64_t* ids, int64_t n, const float* e, float inv, double u) {
  if (ids) {
    double total = 0.0;
    int64_t last = 0;
    for (int64_t k = 0; k < n; ++k) {
      const float q = e[ids[k]] * inv;
      if (q > 0.f) total += q, last = ids[k];
    }
    const double target = u * total;
    double running = 0.0;
    for (int64_t k = 0; k < n; ++k) {
      const float q = e[ids[k]] * inv;
      if (q > 0.f && (running += q) > target) return ids[k];
    }
    return last;
  }
  alignas(64) float p[kLanes];
  const F invv = fset(inv);
  // the sum's additions (p = 0 and, here, NaN add nothing), then the run of the last positive p
  double total = 0.0;
  int64_t last_run = -1;
  for (int64_t b = 0; b < n; b += kLanes) {
    const F q = fmul(fload_n(e + b, n - b, 0.f), invv);
    if (!fany_positive(q)) continue;
    last_run = b;
    if (!fany_ge(q, fset(static_cast<float>(total * 0x1p-55)))) continue;
    fstore(p, q);
    for (int64_t j = 0, end = std::min<int64_t>(kLanes, n - b); j < end; ++j) total += p[j] > 0.f ? p[j] : 0.f;
  }
  int64_t last = 0;
  if (last_run >= 0) {
    fstore(p, fmul(fload_n(e + last_run, n - last_run, 0.f), invv));
    for (int64_t j = 0, end = std::min<int64_t>(kLanes, n - last_run); j < end; ++j)
      if (p[j] > 0.f) last = last_run + j;
  }
  const double target = u * total;
  double running = 0.0;
  for (int64_t b = 0; b < n; b += kLanes) {
    const F q = fmul(fload_n(e + b, n - b, 0.f), invv);
    if (!fany_ge(q, fset(static_cast<float>(running * 0x1p-55))) || !fany_positive(q)) continue;
    fstore(p, q);
    for (int64_t j = 0, end = std::min<int64_t>(kLanes, n - b); j < end; ++j)
      if ((running += p[j] > 0.f ? p[j] : 0.f) > target && p[j] > 0.f) return b + j;
  }
  return last;
}

// One row's next token as Sampler.probs + Sampler.draw give it (llm/generation/sampling.py):
// logits / temperature; the top_k largest kept (0: all); min_p: tokens whose probability is at
// least min_p times the top one's (0: all); top_p: the smallest set, by descending probability
// (ties by index), whose probability reaches top_p (1: all); then a draw by inverse transform: the
// first token of the kept ones, in vocabulary order, whose cumulative probability (double) exceeds
// u times their total, the last one where rounding leaves none. x: V floats of scratch.
inline int64_t draw_row(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p,
                        float min_p, double u, float* x) {
  const float inf = std::numeric_limits<float>::infinity();
  // dividing by temperature > 0 keeps the order: the largest quotient is the largest logit's
  float floor_ = -inf;  // top-k: the k-th largest quotient
  if (top_k > 0 && top_k < V) {
    thread_local std::vector<float> sorted;
    sorted.resize(V);
    // NaN as -inf: NaN counts as no token, and nth_element's order must be strict
    for (int64_t i = 0; i < V; ++i) sorted[i] = std::isnan(logits[i]) ? -inf : logits[i] / temperature;
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.begin() + V, std::greater<float>());
    floor_ = sorted[top_k - 1];
  }
  F topv = fset(-inf);
  for (int64_t i = 0; i < V; i += kLanes) topv = fmax(fload_n(logits + i, V - i, -inf), topv);
  const float top = fmaxr(topv) / temperature;
  if (top == inf) {  // an infinite logit (or one that overflows at this temperature) is the token
    for (int64_t i = 0; i < V; ++i)
      if (logits[i] / temperature == inf) return i;
  }
  if (!std::isfinite(top)) return 0;  // no finite logit: nothing to draw (NaN ones count as none)
  float* e = x;
  double total = exp_shifted(logits, V, temperature, floor_, top, e);  // the top token's exp is 1
  if (!(total > 0.0)) {  // no weight left (cannot happen with a finite top): the top token, not a division by 0
    for (int64_t i = 0; i < V; ++i)
      if (logits[i] / temperature == top) return i;
    return 0;
  }
  if (min_p > 0.f) {
    const float inv = static_cast<float>(1.0 / total), least = min_p * inv;
    total = 0.0;
    for (int64_t i = 0; i < V; ++i) {
      if (e[i] * inv < least) e[i] = 0.f;
      total += e[i];
    }
  }
  // the kept tokens in vocabulary order when top_p leaves few of them; else every token with e > 0
  std::vector<int64_t> support;
  if (top_p < 1.f) {
    // the nucleus lies among the tokens of probability >= tau once those before the last of them
    // reach top_p: tau from the top token's probability / 4096 down, 4096 times at a time, to 0
    const float inv = static_cast<float>(1.0 / total);
    std::vector<int64_t> nucleus;
    for (float tau = inv / 4096.f;; tau = tau > 1e-30f ? tau / 4096.f : 0.f) {
      nucleus.clear();
      for (int64_t b = 0; b < V; b += kLanes) {
        const int64_t end = std::min(V, b + kLanes);
        float most = 0.f;
        for (int64_t i = b; i < end; ++i) most = std::max(most, e[i]);
        if (most == 0.f || most * inv < tau) continue;
        for (int64_t i = b; i < end; ++i)
          if (e[i] > 0.f && e[i] * inv >= tau) nucleus.push_back(i);
      }
      std::stable_sort(nucleus.begin(), nucleus.end(), [&](int64_t a, int64_t b) { return e[a] > e[b]; });
      float mass = 0.f, before_last = 0.f;
      for (const int64_t i : nucleus) before_last = mass, mass += e[i] * inv;
      if (before_last >= top_p || tau == 0.f) break;
    }
    float mass = 0.f;
    size_t keep = 0;
    while (keep < nucleus.size() && mass < top_p) mass += e[nucleus[keep++]] * inv;  // mass before < top_p
    support.assign(nucleus.begin(), nucleus.begin() + keep);
    std::sort(support.begin(), support.end());
    total = 0.0;
    for (const int64_t i : support) total += e[i];
  }
  // the distribution as torch's softmax of the kept logits gives it: exp(x - top) times 1 / sum
  const float inv = static_cast<float>(1.0 / total);
  return top_p < 1.f ? inverse_transform(support.data(), static_cast<int64_t>(support.size()), e, inv, u)
                     : inverse_transform(nullptr, V, e, inv, u);
}

inline void sample_row(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                       double u, float* x, int64_t* token) {
  *token = draw_row(logits, V, temperature, top_k, top_p, min_p, u, x);
}
