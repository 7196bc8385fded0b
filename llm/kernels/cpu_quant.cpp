// Weight-only int4 and int8 matrix products, attention over a cache buffer and whole Llama blocks
// for x86-64 CPUs with AVX2 (+ FMA, F16C) or AVX512-VNNI, built by llm/kernels/cpu_quant.py
// (torch.utils.cpp_extension) and registered as torch operators (llm::*). The kernels themselves
// are in cpu_quant_simd.h, compiled here once for each instruction set; the CPU picks one at run
// time. This file holds what does not depend on it: the checks of the operators' arguments.
//
// The method is llama.cpp's (ggml-cpu's Q4_1 x Q8_0 and Q8_0 x Q8_0 dot products): activations
// are quantized to int8 in groups of 32 per token (scale = max|x| / 127, round to nearest), the
// products are integer dot products (4 bytes at a time into int32), and the float scales are
// applied once per group of 32. Unlike ggml, the lanes of a vector are 16 output features (a
// "block" of rows), not 16 inputs, so the weights of 16 rows are read once per token tile and no
// horizontal sums are needed (torch's int4 CPU kernel's layout).
//
// Layouts (made by llm/kernels/cpu_quant.py; NB = ceil(N / 16) blocks of 16 output rows, padded):
//   int4 codes  (NB, K / 8, 16, 4) uint8: for block b, inputs 8t..8t+7 of row 16b+i: byte j holds
//               q[8t + j] in its low nibble and q[8t + 4 + j] in its high nibble.
//   int4 scales, mins (NB, K / G, 16) fp16: w = q * scale + min (GGUF Q4_1's convention); without
//               mins, symmetric codes: min = -8 * scale (GGUF Q4_0's w = (q - 8) d).
//   int8 codes  (NB, K / 4, 16, 4) int8: bytes j of row 16b+i at (b, t, i, j) = q[4t + j].
//   int8 scales (NB * 16,) float32: w = q * scale; or, in groups of G inputs (GGUF Q8_0's blocks),
//               (NB, K / G, 16) fp16: w = q * scale of its group.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstring>
#include <functional>
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

constexpr int64_t kLanes = 16;  // output rows per block: one vector of int32 or float
constexpr int64_t kTile = 8;    // tokens per pass over a block's weights
constexpr int64_t kGroup = 32;  // inputs per activation scale
constexpr int64_t kSpan = 64;   // keys per part of a query's attention (see Attention)
// Weight bytes prefetched ahead of use: without it SmolLM2's 150 int4 projections of one token took
// 4.1 ms on one thread instead of 3.1 (each thread's stretch of blocks is short: the hardware
// prefetcher ramps up too late). Into L2 (T1), which can have more lines in flight than L1: the 30
// fused blocks of SmolLM2 took 3.4-4.0 ms a token against 3.9-5.7 with T0 (AMD EPYC, Zen 4;
// alternating builds, a noisy day).
constexpr int64_t kAheadBytes = 8192;

// The instruction set the kernels run with here: "avx512" (AVX512-VNNI with BW, VL, DQ, F16C),
// "avx2" (AVX2 with FMA and F16C), or "" where neither is there.
const char* isa() {
#ifdef LLM_X86
  static const char* found = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c"))
      return "avx512";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return "avx2";
    return "";
  }();
  return found;
#else
  return "";
#endif
}

bool avx512() { return std::strcmp(isa(), "avx512") == 0; }

void check_isa() { TORCH_CHECK(*isa(), "llm CPU kernels need an x86-64 CPU with AVX2, FMA and F16C"); }

void check(const at::Tensor& x, const at::Tensor& codes, int64_t n, int64_t bytes_per_block) {
  check_isa();
  TORCH_CHECK(x.dim() == 2, "x must be (rows, in_features), got ", x.sizes());
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kGroup == 0,
              "x must be (rows, in_features) with in_features a positive multiple of 32, got ", x.sizes());
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 4 && codes.size(2) == kLanes && codes.size(3) == 4,
              "codes must be a contiguous (blocks, steps, 16, 4) layout, got ", codes.sizes());
  TORCH_CHECK(codes.size(0) == (n + kLanes - 1) / kLanes && codes.size(1) * 4 * kLanes == bytes_per_block,
              "codes of shape ", codes.sizes(), " do not match ", n, " outputs of ", x.size(1), " inputs");
}

// Blocks per task: enough work per thread wake-up, and at least two tasks when there are threads.
int64_t grain(int64_t blocks) { return std::max<int64_t>(1, std::min<int64_t>(16, blocks / (2 * at::get_num_threads()))); }

// A packed int4 or int8 weight (the layouts of the file's header) and its shape.
struct QWeight {
  bool int4 = true;
  const uint8_t* codes = nullptr;  // int8 codes are read as int8_t
  const at::Half* scales = nullptr;  // int4, int8 in groups: (blocks, K / G, 16)
  const at::Half* mins = nullptr;
  const float* lane_scales = nullptr;  // int8 per row: (blocks * 16,)
  int64_t n = 0, k = 0, group = 0, blocks = 0;
};

// The bytes of block b that project_block reads before its own prefetches reach them: the first
// kAheadBytes of its codes and the scales and mins as far.
void prefetch_block(const QWeight& w, int64_t b) {
#ifdef LLM_X86
  if (b >= w.blocks) return;
  const int64_t row_bytes = w.int4 ? w.k / 2 : w.k, codes = std::min(kAheadBytes, row_bytes * kLanes);
  const char* c = reinterpret_cast<const char*>(w.codes) + b * row_bytes * kLanes;
  for (int64_t i = 0; i < codes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
  if (!w.scales) return;
  // the groups' scales (and mins) of the inputs those codes hold: 16 halves a group
  const int64_t KG = w.k / w.group, inputs = kAheadBytes / (row_bytes * kLanes / w.k);
  const int64_t side = std::min<int64_t>(inputs / w.group * kLanes, KG * kLanes) * 2;
  const char* d = reinterpret_cast<const char*>(w.scales + b * KG * kLanes);
  const char* m = w.mins ? reinterpret_cast<const char*>(w.mins + b * KG * kLanes) : nullptr;
  for (int64_t i = 0; i < side; i += 64) {
    _mm_prefetch(d + i, _MM_HINT_T1);
    if (m) _mm_prefetch(m + i, _MM_HINT_T1);
  }
#endif
}

// Pacing on a busy machine. A team of threads that meets at barriers (run_blocks: about 150 a token
// on SmolLM2) waits at each for its slowest member; where another process takes one of the cores, a
// member descheduled for a time slice (milliseconds) holds every barrier up: two threads then decode
// ten times slower than one. So each team call measures how much of its wall time every member
// got on a CPU (CLOCK_THREAD_CPUTIME_ID; a member waiting at a barrier spins, and that counts): if
// one got less than kBusyShare of it, the following calls run on the calling thread alone, for a
// stretch that doubles while the machine stays busy (kSoloFirst .. kSoloMost calls) and is probed
// again after it. Results do not depend on the threads (see cpu_quant_simd.h), only speed does.
constexpr double kBusyShare = 0.6;
constexpr int64_t kSoloFirst = 16, kSoloMost = 256;
constexpr double kJudgedCallS = 1e-3;  // shorter calls are not judged (waking the team weighs on them)

struct Pace {
  std::atomic<int64_t> solo{0};           // calls left to run on one thread
  std::atomic<int64_t> stretch{kSoloFirst};
};

Pace& pace() {
  static Pace p;
  return p;
}

// The threads for the next team call: 1 while the machine was found busy, else `threads`.
int team_threads(int threads) {
  if (threads > 1 && pace().solo.load(std::memory_order_relaxed) > 0) {
    pace().solo.fetch_sub(1, std::memory_order_relaxed);
    return 1;
  }
  return threads;
}

// Whether single-threaded calls (the separate kernels) should keep to the calling thread now.
bool pace_solo() { return pace().solo.load(std::memory_order_relaxed) > 0; }

// A team call of `team` threads took `wall` seconds, its least served member `least_cpu` of CPU.
void observe(int team, double wall, double least_cpu) {
  if (team < 2 || wall < kJudgedCallS) return;
  if (least_cpu < kBusyShare * wall) {
    const int64_t n = pace().stretch.load(std::memory_order_relaxed);
    pace().solo.store(n, std::memory_order_relaxed);
    pace().stretch.store(std::min(2 * n, kSoloMost), std::memory_order_relaxed);
  } else {
    pace().stretch.store(kSoloFirst, std::memory_order_relaxed);
  }
}

double thread_cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// One block's weights and caches for run_blocks.
struct Layer {
  QWeight wqkv, wo, wgate, wup, wdown;
  const float *n1, *n2;
  float *kc, *vc;
};

// What run_blocks needs, checked: the layers, the step's shape, rotation, positions and mask.
struct Blocks {
  std::vector<Layer> layers;
  int64_t B = 0, S = 0, Dm = 0, H = 0, KV = 0, D = 0, T = 0, hidden = 0, cos_rows = 1;
  const float *cos = nullptr, *sin = nullptr;
  const int64_t* pos = nullptr;
  const bool* mask = nullptr;
  float eps = 0.f, scale = 0.f;
};

}  // namespace

#ifdef LLM_X86
namespace llm_avx512 {
namespace {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,f16c,fma")
#define LLM_AVX512 1
#include "cpu_quant_simd.h"
#undef LLM_AVX512
#pragma GCC pop_options
}  // namespace
}  // namespace llm_avx512

namespace llm_avx2 {
namespace {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "cpu_quant_simd.h"
#pragma GCC pop_options
}  // namespace
}  // namespace llm_avx2
#endif

namespace {

// The kernels of this CPU's instruction set (callers have run check_isa()).
#ifdef LLM_X86
#define LLM_DISPATCH(call) (avx512() ? llm_avx512::call : llm_avx2::call)
#else
#define LLM_DISPATCH(call) TORCH_CHECK(false, "llm CPU kernels need an x86-64 CPU")
#endif

void project(const QWeight& w, const float* x, int64_t M, float* out) { LLM_DISPATCH(project(w, x, M, out)); }

// The groups per row of an int8 weight's scales: 0 for float32 per-row scales (blocks * 16,), K / G
// for float16 scales in groups of G inputs (blocks, K / G, 16), G a multiple of 32 dividing K.
int64_t int8_groups(const at::Tensor& scales, int64_t blocks, int64_t K, const char* name) {
  TORCH_CHECK(scales.is_contiguous() && scales.is_cpu(), name, ": scales must be contiguous CPU tensors");
  if (scales.scalar_type() == at::kFloat) {
    TORCH_CHECK(scales.numel() == blocks * kLanes, name, ": float32 scales must be per row (", blocks * kLanes,
                ",), got ", scales.sizes());
    return 0;
  }
  const int64_t groups = scales.numel() / std::max<int64_t>(1, blocks * kLanes);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == blocks &&
                  scales.size(2) == kLanes && groups > 0 && K % groups == 0 && (K / groups) % kGroup == 0,
              name, ": int8 codes need float32 scales (blocks * 16,) or float16 scales (blocks, K / group_size, 16) "
              "with group_size a multiple of 32 dividing ", K, ", got ", scales.scalar_type(), " ", scales.sizes());
  return groups;
}

at::Tensor int4_linear_cpu(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& mins, int64_t group_size, int64_t n) {
  const int64_t K = x_in.dim() == 2 ? x_in.size(1) : 0;
  check(x_in, codes, n, K * 8);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  TORCH_CHECK(group_size > 0 && group_size % kGroup == 0 && K % group_size == 0, "group_size ", group_size,
              " must be a multiple of 32 that divides in_features ", K);
  const int64_t KG = K / group_size;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == codes.size(0) * KG * kLanes &&
                  (!mins.has_value() || (mins->is_contiguous() && mins->scalar_type() == at::kHalf &&
                                         mins->numel() == scales.numel())),
              "scales and mins must be contiguous float16 (", codes.size(0), ", ", KG, ", 16) for group_size ",
              group_size, ", got ", scales.sizes(), " and ", mins.has_value() ? mins->sizes() : at::IntArrayRef{});
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  QWeight w;
  w.codes = codes.data_ptr<uint8_t>();
  w.scales = scales.data_ptr<at::Half>();
  w.mins = mins.has_value() ? mins->data_ptr<at::Half>() : nullptr;
  w.n = n, w.k = K, w.group = group_size, w.blocks = codes.size(0);
  project(w, x.data_ptr<float>(), M, out.data_ptr<float>());
  return out;
}

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, int64_t n) {
  const int64_t K = x_in.dim() == 2 ? x_in.size(1) : 0;
  check(x_in, codes, n, K * kLanes);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  const int64_t groups = int8_groups(scales, codes.size(0), K, "int8_linear");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  QWeight w;
  w.int4 = false;
  w.codes = reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>());
  if (groups)
    w.scales = scales.data_ptr<at::Half>();
  else
    w.lane_scales = scales.data_ptr<float>();
  w.n = n, w.k = K, w.group = groups ? K / groups : K, w.blocks = codes.size(0);
  project(w, x.data_ptr<float>(), M, out.data_ptr<float>());
  return out;
}

// Rows `ids` of a packed int8 table (blocks, K / 4, 16, 4), each times its row's scale (float32
// (rows,)), its groups' (float32 (rows, K / G)), or its groups' as the int8 kernel holds them
// (float16 lanes (blocks, K / G, 16): the output layer's own, shared by a tied table): float32
// (*ids.shape, K), the values of `float(code) * scale` (an embedding lookup in one call, with no
// unpacked copy of a table the output layer shares). `rows`: the table's rows, which lanes do not
// tell (they pad the last 16); -1: those of the scales, all of the lanes' blocks.
at::Tensor int8_embedding_cpu(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& ids_in,
                              int64_t rows_in) {
  TORCH_CHECK(codes.dim() == 4 && codes.size(2) == kLanes && codes.size(3) == 4 && codes.scalar_type() == at::kChar &&
              codes.is_contiguous(), "codes must be the packed int8 layout (blocks, K / 4, 16, 4)");
  const int64_t steps = codes.size(1), K = steps * 4;
  const bool lanes = scales.dim() == 3;
  const int64_t groups = lanes ? scales.size(1) : scales.dim() == 2 ? scales.size(1) : 1;
  TORCH_CHECK(lanes ? (scales.size(0) == codes.size(0) && scales.size(2) == kLanes && groups > 0 && K % groups == 0 &&
                       scales.scalar_type() == at::kHalf && scales.is_contiguous())
                    : ((scales.dim() == 1 || (scales.dim() == 2 && groups > 0 && K % groups == 0)) &&
                       scales.scalar_type() == at::kFloat && scales.is_contiguous()),
              "scales must be contiguous float32 (rows,) or (rows, groups), or float16 lanes (", codes.size(0),
              ", groups, 16), with groups dividing ", K, ", got ", scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(ids_in.scalar_type() == at::kLong, "ids must be int64");
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel(), G = K / groups;
  const int64_t padded = codes.size(0) * kLanes;
  const int64_t rows = std::min<int64_t>(padded, rows_in >= 0 ? rows_in : lanes ? padded : scales.size(0));
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, codes.options().dtype(at::kFloat));
  const int8_t* table = codes.data_ptr<int8_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const at::Half* lane = lanes ? scales.data_ptr<at::Half>() : nullptr;
  const float* scale = lanes ? nullptr : scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = id[i];
    TORCH_CHECK(0 <= r && r < rows, "id ", r, " is outside the table's ", rows, " rows");
    const int8_t* row = table + ((r / kLanes) * steps * kLanes + r % kLanes) * 4;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t c = 0; c < 4; ++c) {
        const int64_t g = (4 * s + c) / G;
        const float d = lane ? static_cast<float>(lane[((r / kLanes) * groups + g) * kLanes + r % kLanes])
                             : scale[r * groups + g];
        o[i * K + 4 * s + c] = static_cast<float>(row[s * kLanes * 4 + c]) * d;
      }
  }
  return out;
}

// GGUF Q4_0 / Q4_1 rows, (rows, K / 32 * block bytes) uint8 as the file holds them (a block of 32
// weights: fp16 d, for Q4_1 fp16 m, then 16 bytes whose low nibbles are weights 0-15 and high
// nibbles 16-31; ggml-quants.c), straight into the int4 layout of this file's header: [codes, scales]
// for Q4_0 (w = (q - 8) d: symmetric, no mins), [codes, scales, mins] for Q4_1 (w = q d + m), the
// file's own codes, d and m. One pass instead of unpacking every code to a byte and packing it again.
// An output the caller gave (checked to be `shape` and `dtype`, contiguous, on the CPU), or a new zeroed one.
at::Tensor output_or_new(const c10::optional<at::Tensor>& given, at::IntArrayRef shape, at::ScalarType dtype,
                         const char* name) {
  if (!given.has_value()) return at::zeros(shape, at::TensorOptions().dtype(dtype));
  const at::Tensor& t = *given;
  TORCH_CHECK(t.is_cpu() && t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(), name, " must be a contiguous CPU ",
              dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ", t.sizes());
  return t;
}

std::vector<at::Tensor> gguf_q4_pack_cpu(const at::Tensor& blocks_in, int64_t K, const c10::optional<at::Tensor>& codes_out,
                                         const c10::optional<at::Tensor>& scales_out,
                                         const c10::optional<at::Tensor>& mins_out) {
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte && K > 0 && K % kGroup == 0,
              "blocks must be uint8 (rows, bytes) and in_features a positive multiple of 32");
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t rows = blocks.size(0), G = K / kGroup, row_bytes = blocks.size(1), bb = row_bytes / G;
  TORCH_CHECK(row_bytes == G * bb && (bb == 18 || bb == 20), "rows of ", row_bytes, " bytes are not ", G,
              " Q4_0 (18-byte) or Q4_1 (20-byte) blocks");
  const int64_t NB = (rows + kLanes - 1) / kLanes;
  const bool q4_1 = bb == 20;
  TORCH_CHECK(q4_1 || !mins_out.has_value(), "Q4_0 blocks have no mins");
  at::Tensor codes = output_or_new(codes_out, {NB, K / 8, kLanes, 4}, at::kByte, "codes");
  at::Tensor scales = output_or_new(scales_out, {NB, G, kLanes}, at::kHalf, "scales");
  at::Tensor mins = q4_1 ? output_or_new(mins_out, {NB, G, kLanes}, at::kHalf, "mins") : at::Tensor();
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  uint16_t* d = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* m = q4_1 ? reinterpret_cast<uint16_t*>(mins.data_ptr<at::Half>()) : nullptr;
  // the last block's lanes past the rows: zeros (a given output may hold anything)
  for (int64_t r = rows; r < NB * kLanes; ++r) {
    const int64_t b = r / kLanes, i = r % kLanes;
    for (int64_t g = 0; g < G; ++g) {
      d[(b * G + g) * kLanes + i] = 0;
      if (m) m[(b * G + g) * kLanes + i] = 0;
    }
    for (int64_t s = 0; s < K / 8; ++s) std::memset(c + ((b * (K / 8) + s) * kLanes + i) * 4, 0, 4);
  }
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / kLanes, i = r % kLanes;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* blk = src + r * row_bytes + g * bb;
        const uint8_t* q = blk + bb - 16;
        std::memcpy(d + (b * G + g) * kLanes + i, blk, 2);
        if (m) std::memcpy(m + (b * G + g) * kLanes + i, blk + 2, 2);
        for (int64_t t = 0; t < 4; ++t) {  // inputs 8t..8t+7 of the group: a byte holds 8t+j and 8t+4+j
          uint8_t* out = c + ((b * (K / 8) + g * 4 + t) * kLanes + i) * 4;
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t lo = 8 * t + j, hi = 8 * t + 4 + j;
            const uint8_t qlo = lo < 16 ? q[lo] & 0x0F : q[lo - 16] >> 4, qhi = hi < 16 ? q[hi] & 0x0F : q[hi - 16] >> 4;
            out[j] = static_cast<uint8_t>(qlo | (qhi << 4));
          }
        }
      }
    }
  });
  return q4_1 ? std::vector<at::Tensor>{codes, scales, mins} : std::vector<at::Tensor>{codes, scales};
}

// GGUF Q8_0 rows, (rows, K / 32 * 34) uint8 as the file holds them (a block of 32 weights: fp16 d,
// then 32 int8 codes; ggml-quants.c), straight into the int8 layout (blocks, K / 4, 16, 4) of
// pack_int8 and float32 scales (rows, K / 32), d as a float: the file's own codes and d, in one pass.
std::vector<at::Tensor> gguf_q8_pack_cpu(const at::Tensor& blocks_in, int64_t K, const c10::optional<at::Tensor>& codes_out,
                                         const c10::optional<at::Tensor>& scales_out) {
  TORCH_CHECK(blocks_in.dim() == 2 && blocks_in.scalar_type() == at::kByte && K > 0 && K % kGroup == 0,
              "blocks must be uint8 (rows, bytes) and in_features a positive multiple of 32");
  const at::Tensor blocks = blocks_in.contiguous();
  const int64_t rows = blocks.size(0), G = K / kGroup, row_bytes = blocks.size(1), bb = 2 + kGroup;
  TORCH_CHECK(row_bytes == G * bb, "rows of ", row_bytes, " bytes are not ", G, " Q8_0 (34-byte) blocks");
  const int64_t NB = (rows + kLanes - 1) / kLanes, steps = K / 4;
  at::Tensor codes = output_or_new(codes_out, {NB, steps, kLanes, 4}, at::kChar, "codes");
  at::Tensor scales = output_or_new(scales_out, {rows, G}, at::kFloat, "scales");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* d = scales.data_ptr<float>();
  for (int64_t r = rows; r < NB * kLanes; ++r)
    for (int64_t s = 0; s < steps; ++s) std::memset(c + (((r / kLanes) * steps + s) * kLanes + r % kLanes) * 4, 0, 4);
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {  // a block of 16 rows at a time, its codes in order
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = std::min(kLanes, rows - b * kLanes);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          at::Half h;
          std::memcpy(&h, src + (b * kLanes + i) * row_bytes + g * bb, 2);
          d[(b * kLanes + i) * G + g] = static_cast<float>(h);
        }
      int8_t* out = c + b * steps * kLanes * 4;
      for (int64_t s = 0; s < steps; ++s, out += kLanes * 4) {
        const int64_t offset = (s / (kGroup / 4)) * bb + 2 + 4 * (s % (kGroup / 4));
        for (int64_t i = 0; i < n; ++i) std::memcpy(out + 4 * i, src + (b * kLanes + i) * row_bytes + offset, 4);
      }
    }
  });
  return {codes, scales};
}

std::vector<at::Tensor> gguf_q4_pack_new(const at::Tensor& blocks, int64_t K) {
  return gguf_q4_pack_cpu(blocks, K, c10::nullopt, c10::nullopt, c10::nullopt);
}
void gguf_q4_pack_into(const at::Tensor& blocks, int64_t K, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(mins.has_value() == (blocks.dim() == 2 && blocks.size(1) == K / kGroup * 20),
              "mins are given for Q4_1 blocks, and only for them");
  gguf_q4_pack_cpu(blocks, K, codes, scales, mins);
}
std::vector<at::Tensor> gguf_q8_pack_new(const at::Tensor& blocks, int64_t K) {
  return gguf_q8_pack_cpu(blocks, K, c10::nullopt, c10::nullopt);
}
void gguf_q8_pack_into(const at::Tensor& blocks, int64_t K, const at::Tensor& codes, const at::Tensor& scales) {
  gguf_q8_pack_cpu(blocks, K, codes, scales);
}

// out = x * rsqrt(mean(x^2) + eps) * weight per row of x (rows, D), float32: the fused blocks' norm
// (the mean summed in double, so that a row's result does not depend on the other rows).
at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_isa();
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.is_cpu(),
              "x must be a float32 CPU tensor (..., d), got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t D = x_in.size(-1);
  TORCH_CHECK(weight_in.scalar_type() == at::kFloat && weight_in.dim() == 1 && weight_in.size(0) == D,
              "weight must be float32 (", D, ",), got ", weight_in.sizes(), " ", weight_in.scalar_type());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t M = D ? x.numel() / D : 0;
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    LLM_DISPATCH(rms_norm_rows(x.data_ptr<float>() + r0 * D, weight.data_ptr<float>(), r1 - r0, D,
                               static_cast<float>(eps), out.data_ptr<float>() + r0 * D));
  });
  return out;
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
    TORCH_CHECK(codes->size(1) == k / 8 && scales->scalar_type() == at::kHalf &&
                    (!mins.has_value() || (mins->is_contiguous() && mins->scalar_type() == at::kHalf &&
                                           mins->numel() == scales->numel())) &&
                    scales->numel() % (w.blocks * kLanes) == 0,
                name, ": int4 codes need float16 scales and mins, or scales alone (symmetric codes), "
                "(blocks, K / group_size, 16)");
    const int64_t groups = scales->numel() / (w.blocks * kLanes);
    TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % kGroup == 0, name, ": ", groups,
                " groups do not divide ", k, " inputs into multiples of 32");
    w.group = k / groups;
    w.codes = codes->data_ptr<uint8_t>();
    w.scales = scales->data_ptr<at::Half>();
    w.mins = mins.has_value() ? mins->data_ptr<at::Half>() : nullptr;
  } else {
    TORCH_CHECK(codes->scalar_type() == at::kChar && codes->size(1) == k / 4, name, ": codes of dtype ",
                codes->scalar_type(), " and shape ", codes->sizes(), " are neither int4 nor int8 codes");
    const int64_t groups = int8_groups(*scales, w.blocks, k, name);
    w.int4 = false;
    w.group = groups ? k / groups : k;
    w.codes = reinterpret_cast<const uint8_t*>(codes->data_ptr<int8_t>());
    if (groups)
      w.scales = scales->data_ptr<at::Half>();
    else
      w.lane_scales = scales->data_ptr<float>();
  }
  return w;
}

at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                const at::Tensor& mask_in, double scale, const c10::optional<at::Tensor>& bias_in) {
  check_isa();
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
  at::Tensor out = at::zeros({B, S, H, D}, q.options());
  if (out.numel() == 0 || T == 0) return out.transpose(1, 2);
#ifdef LLM_X86
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int threads = at::get_num_threads();
  if (avx512()) {
    llm_avx512::Attention attn(q.data_ptr<float>(), mask.data_ptr<bool>(),
                               bp, B, KV, S, G, D, T, static_cast<float>(scale), threads);
    llm_avx512::attention(attn, k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  } else {
    llm_avx2::Attention attn(q.data_ptr<float>(), mask.data_ptr<bool>(),
                             bp, B, KV, S, G, D, T, static_cast<float>(scale), threads);
    llm_avx2::attention(attn, k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  }
#endif
  return out.transpose(1, 2);
}

// Consecutive pre-norm Llama blocks over a cache buffer for any number of new tokens, in one call
// (see run_blocks in cpu_quant_simd.h).
at::Tensor decoder_blocks_cpu(const at::Tensor& x_in, at::TensorList norms, double eps,
                              const c10::List<c10::optional<at::Tensor>>& weights, at::IntArrayRef out_features,
                              const c10::optional<at::Tensor>& cos_in, const c10::optional<at::Tensor>& sin_in,
                              at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cache_position_in,
                              const at::Tensor& mask_in, int64_t n_heads, double scale) {
  check_isa();
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
  Blocks a;
  a.layers = std::move(layers);
  a.B = B, a.S = S, a.Dm = Dm, a.H = H, a.KV = KV, a.D = D, a.T = T, a.hidden = hidden;
  a.cos = cos.defined() ? cos.data_ptr<float>() : nullptr;
  a.sin = cos.defined() ? sin.data_ptr<float>() : nullptr;
  a.cos_rows = cos.defined() ? cos.size(0) : 1;
  a.pos = pos, a.mask = mask.data_ptr<bool>();
  a.eps = static_cast<float>(eps), a.scale = static_cast<float>(scale);
  LLM_DISPATCH(run_blocks(a, out.data_ptr<float>()));
  return out;
}

// The index of each row's largest value, as torch.argmax(x, -1): the first of equal largest
// values, the first NaN where a row has one. One pass in order, a compare an element: torch's
// reduction took 87 us for SmolLM2's 49,152 logits, a fiftieth of a decoding step.
at::Tensor argmax_rows_cpu(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) > 0 && x_in.scalar_type() == at::kFloat,
              "x must be float32 (rows, n) with n > 0, got ", x_in.scalar_type(), " ", x_in.sizes());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = p + r * n;
    float best = row[0];
    int64_t at_ = 0;
    // chunks with no larger value (nor NaN) are passed over by a compare that vectorizes; few are not
    constexpr int64_t kChunk = 64;
    for (int64_t c = 1; c < n && !std::isnan(best); c += kChunk) {
      const int64_t end = std::min(n, c + kChunk);
      int32_t larger = 0;
      for (int64_t i = c; i < end; ++i) larger += row[i] > best || row[i] != row[i];
      if (!larger) continue;
      for (int64_t i = c; i < end; ++i) {
        if (!(row[i] <= best)) {  // larger, or NaN
          at_ = i, best = row[i];
          if (std::isnan(best)) break;
        }
      }
    }
    o[r] = at_;
  }
  return out;
}

// One row's next token drawn from its logits: see sample_row in cpu_quant_simd.h.
int64_t sample_row_cpu(const at::Tensor& logits_in, double temperature, int64_t top_k, double top_p, double min_p,
                       double u) {
  check_isa();
  TORCH_CHECK(logits_in.dim() == 1 && logits_in.size(0) > 0 && logits_in.scalar_type() == at::kFloat &&
                  logits_in.is_cpu(),
              "logits must be float32 CPU (vocab,), got ", logits_in.scalar_type(), " ", logits_in.sizes());
  TORCH_CHECK(temperature > 0 && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1 && u >= 0 && u < 1,
              "temperature must be > 0, top_k >= 0, top_p in (0, 1], min_p in [0, 1] and u in [0, 1)");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t V = logits.size(0);
  thread_local std::vector<float> scratch;  // one allocation a thread: a vocabulary's is mmap'd afresh each time
  scratch.resize(std::max<size_t>(scratch.size(), V));
  int64_t token = 0;
  LLM_DISPATCH(sample_row(logits.data_ptr<float>(), V, static_cast<float>(temperature), top_k,
                          static_cast<float>(top_p), static_cast<float>(min_p), u, scratch.data(), &token));
  return token;
}

// The next `steps` tokens of one unpadded row after `token`, each fed back: per token the
// embedding lookup, decoder_blocks at buffer position past + i (rotary row position + i, its key
// mask column set), the final norm, the output layer and the pick (argmax_rows, or sample_row with
// uniforms[i] where temperature > 0), stopping after an eos id: the ops a Python decoding step
// calls, in the same order on the same arguments (the same bits), with no return to Python between
// tokens (the interpreter's share of a step was a tenth of it on SmolLM2). Returns the tokens, int64 (n,).
at::Tensor decode_tokens_cpu(int64_t token, int64_t steps, const at::Tensor& embed, const c10::optional<at::Tensor>& embed_scales,
                             int64_t embed_rows, at::TensorList norms, double eps,
                             const c10::List<c10::optional<at::Tensor>>& weights, at::IntArrayRef out_features,
                             const c10::optional<at::Tensor>& cos_table, const c10::optional<at::Tensor>& sin_table,
                             int64_t position, at::TensorList k_caches, at::TensorList v_caches, int64_t past,
                             const at::Tensor& key_mask, int64_t n_heads, double scale, const at::Tensor& final_norm,
                             double final_eps, const c10::List<c10::optional<at::Tensor>>& head, int64_t head_group,
                             int64_t vocab, at::IntArrayRef eos, double temperature, int64_t top_k, double top_p,
                             double min_p, const c10::optional<at::Tensor>& uniforms_in) {
  check_isa();
  TORCH_CHECK(steps >= 0, "steps must be >= 0, got ", steps);
  TORCH_CHECK(!k_caches.empty() && k_caches[0].dim() == 4 && k_caches[0].size(0) == 1,
              "decode_tokens decodes one row: k_caches must be (1, kv_n_heads, capacity, head_dim)");
  const int64_t T = k_caches[0].size(2);
  TORCH_CHECK(key_mask.scalar_type() == at::kBool && key_mask.is_contiguous() && key_mask.dim() == 3 &&
                  key_mask.size(0) == 1 && key_mask.size(1) == 1 && key_mask.size(2) == T,
              "key_mask must be contiguous bool (1, 1, ", T, "), got ", key_mask.sizes());
  TORCH_CHECK(past >= 0 && past + steps <= T, "positions ", past, " to ", past + steps, " do not fit the buffer of ", T);
  TORCH_CHECK(cos_table.has_value() == sin_table.has_value(), "cos_table and sin_table come together");
  if (cos_table.has_value())
    TORCH_CHECK(cos_table->dim() == 2 && position >= 0 && position + steps <= cos_table->size(0),
                "rotary positions ", position, " to ", position + steps, " are outside the table's ",
                cos_table->dim() == 2 ? cos_table->size(0) : 0, " rows");
  const bool greedy = temperature == 0;
  at::Tensor uniforms;
  if (!greedy) {
    TORCH_CHECK(uniforms_in.has_value() && uniforms_in->scalar_type() == at::kDouble && uniforms_in->dim() == 1 &&
                    uniforms_in->size(0) >= steps,
                "sampling (temperature > 0) needs float64 uniforms (steps,) = (", steps, ",)");
    uniforms = uniforms_in->contiguous();
  }
  TORCH_CHECK(head.size() == 3 && head.get(0).has_value() && head.get(1).has_value(),
              "head must be (codes, scales, mins or None)");
  const at::Tensor head_codes = *head.get(0), head_scales = *head.get(1);
  const bool head_int4 = head_codes.scalar_type() == at::kByte;
  at::Tensor out = at::empty({steps}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  at::Tensor ids = at::empty({1, 1}, at::kLong);
  bool* seen = key_mask.data_ptr<bool>();
  const int64_t D = embed_scales.has_value() ? embed.size(1) * 4 : embed.size(-1);
  int64_t n = 0;
  while (n < steps) {
    ids.data_ptr<int64_t>()[0] = token;
    at::Tensor x = embed_scales.has_value() ? int8_embedding_cpu(embed, *embed_scales, ids, embed_rows)
                                            : embed.index_select(0, ids.view({1})).view({1, 1, D});
    c10::optional<at::Tensor> cos, sin;
    if (cos_table.has_value())
      cos = cos_table->narrow(0, position + n, 1).unsqueeze(0), sin = sin_table->narrow(0, position + n, 1).unsqueeze(0);
    const at::Tensor cache_position = at::full({1}, past + n, at::kLong);
    seen[past + n] = true;
    x = decoder_blocks_cpu(x, norms, eps, weights, out_features, cos, sin, k_caches, v_caches, cache_position, key_mask,
                           n_heads, scale);
    const at::Tensor h = rms_norm_cpu(x.view({1, D}), final_norm, final_eps);
    const at::Tensor logits = head_int4 ? int4_linear_cpu(h, head_codes, head_scales, head.get(2), head_group, vocab)
                                        : int8_linear_cpu(h, head_codes, head_scales, vocab);
    token = greedy ? argmax_rows_cpu(logits).data_ptr<int64_t>()[0]
                   : sample_row_cpu(logits[0], temperature, top_k, top_p, min_p, uniforms.data_ptr<double>()[n]);
    o[n++] = token;
    if (std::find(eos.begin(), eos.end(), token) != eos.end()) break;
  }
  return out.narrow(0, 0, n);
}

const std::string cpu_isa() { return isa(); }

// The pacing's state, for tests: (calls left on one thread, the next stretch).
std::vector<int64_t> pace_state() { return {pace().solo.load(), pace().stretch.load()}; }

// Set the pacing's state (tests): calls left on one thread, the next stretch.
void set_pace(int64_t solo, int64_t stretch) { pace().solo.store(solo), pace().stretch.store(stretch); }

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
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("parallel_threads(int tasks) -> int", &parallel_threads);
  m.def("pace_state() -> int[]", &pace_state);
  m.def("set_pace(int solo, int stretch) -> ()", &set_pace);
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, int n) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_row(Tensor logits, float temperature, int top_k, float top_p, float min_p, float u) -> int");
  m.def("int8_embedding(Tensor codes, Tensor scales, Tensor ids, int rows=-1) -> Tensor");
  m.def("gguf_q4_pack(Tensor blocks, int in_features) -> Tensor[]");
  m.def("gguf_q4_pack_out(Tensor blocks, int in_features, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? mins) -> ()");
  m.def("gguf_q8_pack(Tensor blocks, int in_features) -> Tensor[]");
  m.def("gguf_q8_pack_out(Tensor blocks, int in_features, Tensor(a!) codes, Tensor(b!) scales) -> ()");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? bias) -> Tensor");
  m.def("decoder_blocks(Tensor x, Tensor[] norms, float eps, Tensor?[] weights, int[] out_features, Tensor? cos, "
        "Tensor? sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cache_position, Tensor mask, int n_heads, "
        "float scale) -> Tensor");
  m.def("decode_tokens(int token, int steps, Tensor embed, Tensor? embed_scales, int embed_rows, Tensor[] norms, "
        "float eps, Tensor?[] weights, int[] out_features, Tensor? cos_table, Tensor? sin_table, int position, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int past, Tensor(c!) key_mask, int n_heads, float scale, "
        "Tensor final_norm, float final_eps, Tensor?[] head, int head_group, int vocab, int[] eos, float temperature, "
        "int top_k, float top_p, float min_p, Tensor? uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm, CPU, m) {
  m.impl("int4_linear", &int4_linear_cpu);
  m.impl("int8_linear", &int8_linear_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("argmax_rows", &argmax_rows_cpu);
  m.impl("sample_row", &sample_row_cpu);
  m.impl("int8_embedding", &int8_embedding_cpu);
  m.impl("gguf_q4_pack", &gguf_q4_pack_new);
  m.impl("gguf_q4_pack_out", &gguf_q4_pack_into);
  m.impl("gguf_q8_pack", &gguf_q8_pack_new);
  m.impl("gguf_q8_pack_out", &gguf_q8_pack_into);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("decoder_blocks", &decoder_blocks_cpu);
  m.impl("decode_tokens", &decode_tokens_cpu);
}
