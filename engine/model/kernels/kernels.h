// What every kernel source shares: how threads share a product's weight rows, the float dot products
// (AVX-512, AVX2 with FMA, or plain lanes where the build targets neither), the number formats, the
// quantized activations of the block kernels, the forms decode_layers reads, and the row functions one
// source calls in another. Built by engine/model/cpu_kernels.py with every .cpp beside it.
#pragma once
// The tensor type, whose methods make the outputs, rather than ATen's operator headers, which take seconds
// each to compile (decode.cpp includes the two operators it calls itself).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tokenpath {


// Below this many bytes of float32 weights a product runs on the calling thread: waking a sleeping
// thread costs more than the second core saves on so few bytes. Products that widen int8 weights to
// floats do as much work per weight as a float32 one and count their weights at four bytes; the
// integer product counts its actual bytes. A product of M rows counts each weight M times: each is
// read once but does M rows' work, so a batch's small product is shared where one row's is not.
constexpr int64_t kParallelBytes = int64_t{1} << 19;

// A thread's share of rows [lo, hi), both in one word so that its owner taking rows from the front
// and another thread taking rows from the back never take the same rows.
struct alignas(64) RowShare {
  std::atomic<uint64_t> span;
  void set(int64_t lo, int64_t hi) { span.store(static_cast<uint64_t>(hi) << 32 | static_cast<uint64_t>(lo)); }
  // rows as [begin, end): from the back n of them, from the front a quarter of what is left and at
  // least n (few claims while the end is far, small ones near it); false once the share is empty
  bool take(int64_t n, bool front, int64_t& begin, int64_t& end) {
    uint64_t word = span.load();
    for (;;) {
      const int64_t lo = static_cast<int64_t>(word & 0xffffffffu), hi = static_cast<int64_t>(word >> 32);
      if (lo >= hi) return false;
      const int64_t take = front ? std::max(n, (hi - lo) / 4) : n;
      begin = front ? lo : std::max(lo, hi - take);
      end = front ? std::min(hi, lo + take) : hi;
      const uint64_t rest = front ? (static_cast<uint64_t>(hi) << 32 | static_cast<uint64_t>(end))
                                  : (static_cast<uint64_t>(begin) << 32 | static_cast<uint64_t>(lo));
      if (span.compare_exchange_weak(word, rest)) return true;
    }
  }
};

// The fewest rows a thread takes at a time: 8 KB of weights (counted as kParallelBytes counts them), so
// that a thread that runs out of its own share waits for no more than that.
constexpr int64_t kChunkBytes = int64_t{1} << 13;

// f(begin, end, count) over rows [0, N) of a product whose rows are independent, each row_bytes of
// weights (counted as kParallelBytes counts them, times the activation rows), in groups of up to S
// ranges [begin[j], end[j]) that f reads side by side: S streams from far-apart places keep more of
// memory's bandwidth busy than one (the loads of several misses are in flight at once), where one
// range after another would not.
// Threads share the rows when there are enough: each starts with S equal contiguous shares of its
// own and walks them from the front, chunk after adjacent chunk; a thread done with its own takes
// chunks from the back of the others'. Equal shares alone leave a core idle while the other, slowed by
// a late start or a neighbour on the machine, finishes its part. Which thread computes a row, and
// beside which others, never changes the row's result.
template <int S, typename F>
static void shared_streams(int64_t N, int64_t row_bytes, const F& f) {
  const int64_t T = at::get_num_threads(), chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(row_bytes, 1));
  if (T == 1 || N * row_bytes < kParallelBytes || N <= chunk || at::in_parallel_region()) {
    int64_t begin[S], end[S];
    for (int j = 0; j < S; ++j) begin[j] = N * j / S, end[j] = N * (j + 1) / S;
    f(begin, end, S);
    return;
  }
  std::vector<RowShare> shares(static_cast<size_t>(T * S));
  for (int64_t i = 0; i < T * S; ++i) shares[i].set(N * i / (T * S), N * (i + 1) / (T * S));
  at::parallel_for(0, T, 1, [&](int64_t first, int64_t last) {
    int64_t begin[S], end[S];
    for (int64_t t = first; t < last; ++t)
      for (int64_t k = 0; k < T; ++k) {
        RowShare* own = shares.data() + (t + k) % T * S;
        for (;;) {
          int count = 0;
          for (int j = 0; j < S; ++j) count += own[j].take(chunk, k == 0, begin[count], end[count]);
          if (count == 0) break;
          f(begin, end, count);
        }
      }
  });
}

// f(begin, end) over independent rows [0, rows) of `width` floats each, split over the threads where each share
// has enough work to pay for waking a thread (a prefill's rows, a large batch's), else on the calling thread.
template <typename F>
static void over_rows(int64_t rows, int64_t width, const F& f) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(width, 1)), f);
}

// f(begin, end) over rows [0, N), one range after another (shared_streams with one stream).
template <typename F>
static void shared_rows(int64_t N, int64_t row_bytes, const F& f) {
  shared_streams<1>(N, row_bytes, [&](const int64_t* begin, const int64_t* end, int) { f(begin[0], end[0]); });
}

// g(rows, count) for the rows of up to S ranges side by side: the first row of each range that has
// one, then the second, and so on.
template <int S, typename G>
static void side_by_side(const int64_t* begin, const int64_t* end, int ranges, const G& g) {
  for (int64_t i = 0;; ++i) {
    int64_t rows[S];
    int count = 0;
    for (int j = 0; j < ranges; ++j)
      if (begin[j] + i < end[j]) rows[count++] = begin[j] + i;
    if (count == 0) return;
    g(rows, count);
  }
}

// Sum of a[d] * b[d] in 8 independent lanes (one vector register), the lanes then added in a fixed
// order: vectorized without reassociating a single running sum.
static inline float dot_lanes(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}


#if defined(__AVX2__)
// The eight lanes of an AVX register added in a fixed order.
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

// One vector register of float lanes and the few operations the dot products need: AVX-512's
// sixteen lanes or AVX2's eight (with FMA). Either sum adds the lanes in a fixed order.
#if defined(__AVX512F__)
#define HAVE_LANES 1
struct Lanes {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_LANES 1
struct Lanes {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) { return hsum8(v); }
};
#endif

// Sum of a[i][k] * b[r][k] for each of A rows a[i] and R rows b[r], all read side by side, into
// out[i * R + r]: per pair of rows two registers of lanes, then the registers and the lanes added in a
// fixed order, and the last few products one by one. Each pair's operations and their order are the
// same whatever A and R are, so a sum does not depend on the rows read beside it or on where the call
// comes from; more rows of a at once let each weight loaded from the cache serve several of them.
template <int A, int R>
static inline void dot_rows_of(const float* const* a, const float* const* b, int64_t n, float* out) {
#ifdef HAVE_LANES
  using V = Lanes::V;
  constexpr int W = Lanes::W;
  V acc0[A][R], acc1[A][R];
  for (int i = 0; i < A; ++i)
    for (int r = 0; r < R; ++r) acc0[i][r] = acc1[i][r] = Lanes::zero();
  int64_t k = 0;
  for (; k + 2 * W <= n; k += 2 * W) {
    V x0[A], x1[A];
    for (int i = 0; i < A; ++i) x0[i] = Lanes::load(a[i] + k), x1[i] = Lanes::load(a[i] + k + W);
    for (int r = 0; r < R; ++r) {
      const V w0 = Lanes::load(b[r] + k), w1 = Lanes::load(b[r] + k + W);
      for (int i = 0; i < A; ++i) {
        acc0[i][r] = Lanes::fma(x0[i], w0, acc0[i][r]);
        acc1[i][r] = Lanes::fma(x1[i], w1, acc1[i][r]);
      }
    }
  }
  if (k + W <= n) {
    for (int r = 0; r < R; ++r) {
      const V w0 = Lanes::load(b[r] + k);
      for (int i = 0; i < A; ++i) acc0[i][r] = Lanes::fma(Lanes::load(a[i] + k), w0, acc0[i][r]);
    }
    k += W;
  }
  for (int i = 0; i < A; ++i)
    for (int r = 0; r < R; ++r) {
      float sum = Lanes::sum(Lanes::add(acc0[i][r], acc1[i][r]));
      for (int64_t j = k; j < n; ++j) sum += a[i][j] * b[r][j];
      out[i * R + r] = sum;
    }
#else
  for (int i = 0; i < A; ++i)
    for (int r = 0; r < R; ++r) out[i * R + r] = dot_lanes(a[i], b[r], n);
#endif
}

static inline float dot(const float* a, const float* b, int64_t n) {
  float out;
  dot_rows_of<1, 1>(&a, &b, n, &out);
  return out;
}

static inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// Inputs per block of the block formats (int4.cpp, int8.cpp): each block has scales of its own.
constexpr int64_t kBlock = 32;

static inline float half_to_float(const at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// int8-dyn's packed weights (int8.cpp): blocks of this many outputs, each input width rounded up to a multiple of
// kDepthBytes (the bytes of a row one AMX tile multiply takes).
constexpr int64_t kOutBlock = 16;
constexpr int64_t kDepthBytes = 64;
static inline int64_t packed_width(int64_t K) { return (K + kDepthBytes - 1) / kDepthBytes * kDepthBytes; }

// The block kernels' weights are stored in groups of this many output rows, whose values of a block lie side by
// side (int4.cpp, int8.cpp).
constexpr int64_t kGroup = 8;

static inline int32_t four_bytes(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

#if defined(__AVX512F__)
// The lanes of a block of kOutBlock outputs from n0 that lie below N.
static inline __mmask16 outputs_below(int64_t n0, int64_t N) {
  return static_cast<__mmask16>((1u << std::min(kOutBlock, N - n0)) - 1);
}

// Two groups' eight fp16 values of block b as sixteen floats, where the second group's blocks follow the
// first's KB blocks.
static inline __m512 two_groups_values(const at::Half* h, int64_t b, int64_t KB) {
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + b * kGroup));
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + (KB + b) * kGroup));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1));
}

// Fetches block `a` of a pair of groups stored one after another from wg (KB blocks of `bytes` each), both
// groups' copies: the pair's own while a < KB, else the next pair's block a - KB, so the fetches run ahead across
// the pairs a thread takes in turn. The two streams' loads would otherwise wait on memory with nothing else in
// flight. A fetch past the weights' end is dropped, never a fault: the address is only a hint.
static inline void prefetch_pair_block(const uint8_t* wg, int64_t a, int64_t KB, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(wg) + static_cast<uintptr_t>((a < KB ? a : KB + a) * bytes);
  for (const uintptr_t at : {first, first + static_cast<uintptr_t>(KB * bytes)})
    for (int64_t line = 0; line < bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(at + static_cast<uintptr_t>(line)), _MM_HINT_T0);
}
#endif

// One row of activations quantized per block: q = round(x / dx) in [-127, 127], dx = max|x| / 127
// (1 where the block is all zero), and each block's sum(q) and dx * sum(q), block b's at q + b * step * 32 and at
// dx, sums and dsum + b * step. With AVX-512 a block is two registers; the division, the rounding to nearest even
// and the integers are the plain loop's.
static void quantize_blocks(const float* x, int64_t K, int64_t step, int8_t* q, float* dx, int32_t* sums,
                            float* dsum) {
  for (int64_t b = 0, at = 0; b < K / kBlock; ++b, at += step) {
    const float* xb = x + b * kBlock;
#if defined(__AVX512F__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float d = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 vd = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    auto ints = [&](__m512 v) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
    };
    const __m512i q0 = ints(x0), q1 = ints(x1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at * kBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + at * kBlock + 16), _mm512_cvtepi32_epi8(q1));
    dx[at] = d;
    sums[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    dsum[at] = d * static_cast<float>(sums[at]);
#else
    float amax = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax > 0.f ? amax / 127.f : 1.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      const int32_t v = static_cast<int32_t>(std::min(std::max(std::nearbyint(xb[k] / d), -127.f), 127.f));
      q[at * kBlock + k] = static_cast<int8_t>(v);
      sum += v;
    }
    dx[at] = d;
    sums[at] = sum;
    dsum[at] = d * static_cast<float>(sum);
#endif
  }
}

// Activation rows a block kernel takes past each weight row at once, each weight block read and unpacked
// once for all of them: as many as keep their accumulators in registers (AVX-512's 32 or AVX2's 16).
#if defined(__AVX512VL__)
constexpr int kRowsAtOnce = 8;
#else
constexpr int kRowsAtOnce = 4;
#endif

// g(std::integral_constant<int, R>{}, r) for rows [r, r + R) of M rows, R in Widest (8 or 4) and the smaller
// powers of two: as many of the widest groups as fit, then one each of the narrower ones the rest needs.
template <int Widest = kRowsAtOnce, typename G>
static inline void in_row_groups(int64_t M, const G& g) {
  int64_t r = 0;
  for (; r + Widest <= M; r += Widest) g(std::integral_constant<int, Widest>{}, r);
  if constexpr (Widest > 4)
    if (r + 4 <= M) g(std::integral_constant<int, 4>{}, r), r += 4;
  if (r + 2 <= M) g(std::integral_constant<int, 2>{}, r), r += 2;
  if (r < M) g(std::integral_constant<int, 1>{}, r);
}

// Where row r of a group of R activation rows that a block kernel takes at once keeps its block b: the rows'
// blocks interleaved block by block, so that one pointer with fixed offsets reaches every row's bytes and scales,
// where a pointer of each row's own left the kernels too few registers.
template <int R>
static constexpr int64_t row_block(int64_t b, int r) {
  return b * R + r;
}

// M rows of K activations quantized per block, as the block kernels take them: each group of rows that
// in_row_groups makes (with its default widest group, as past_groups takes the rows) starts at its first row's place
// (q at r * K, the scales and sums at r * K / 32), its rows' blocks interleaved (row_block). All at once, or room
// for them that quantize_row fills row by row (each row's own memory, so threads may fill different rows).
struct BlockActivations {
  int64_t M, K;
  // not zeroed (a vector's would be, on one thread): quantize_row writes all of a row's
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d;
  std::unique_ptr<int32_t[]> sums;
  std::unique_ptr<float[]> dsum;
  BlockActivations(int64_t M, int64_t K)
      : M(M), K(K), q(new int8_t[M * K]), d(new float[M * K / kBlock]), sums(new int32_t[M * K / kBlock]),
        dsum(new float[M * K / kBlock]) {}
  BlockActivations(const float* x, int64_t M, int64_t K) : BlockActivations(M, K) {
    over_rows(M, K, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row(x + r * K, r);
    });
  }
  void quantize_row(const float* x, int64_t r) {
    int64_t first = r, R = 1;
    in_row_groups(M, [&](auto rows, int64_t from) {
      if (r >= from && r < from + decltype(rows)::value) first = from, R = decltype(rows)::value;
    });
    const int64_t at = first * K / kBlock + (r - first);
    quantize_blocks(x, K, R, q.get() + first * K + (r - first) * kBlock, d.get() + at, sums.get() + at,
                    dsum.get() + at);
  }
};

// The block kernels take their groups two at a time with AVX-512 VNNI, a run of both in a 512-bit register, each
// instruction serving sixteen output rows (int4.cpp, int8.cpp); one at a time elsewhere.
#if defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define HAVE_GROUP_PAIRS 1
constexpr int64_t kGroupsAtOnce = 2;
#else
constexpr int64_t kGroupsAtOnce = 1;
#endif

// f(rows, g, r) for each group g of a block kernel's weights (kGroupsAtOnce at a time, which the pair product takes
// where g + 1 < groups) and each group of activation rows past it, from r (rows as in_row_groups gives it): threads
// take shares of the groups, so every weight is read once for all M rows.
template <typename F>
static void past_groups(int64_t groups, int64_t K, int64_t M, const F& f) {
  shared_rows((groups + kGroupsAtOnce - 1) / kGroupsAtOnce, kGroupsAtOnce * kGroup * K * 4 * M, [&](int64_t begin,
                                                                                                  int64_t end) {
    for (int64_t g = begin * kGroupsAtOnce; g < std::min(groups, end * kGroupsAtOnce); g += kGroupsAtOnce)
      in_row_groups(M, [&](auto rows, int64_t r) { f(rows, g, r); });
  });
}

#if defined(__AVX2__)
// Lane i: the sum of the four products of bytes 4i..4i+3 of unsigned a and signed b, exact in int32 for
// a <= 127 and |b| <= 127 (no pair's sum saturates 16 bits on the way): with AVX-512 VNNI one instruction,
// else two. Either gives the same integers, so the float sums made of them are the same too.
static inline __m256i sum_u8s8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

// acc plus sum_u8s8(a, b): one instruction with VNNI.
static inline __m256i add_u8s8(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, sum_u8s8(a, b));
#endif
}
#endif

// One linear layer as decode_layers takes it from Python (each layer class's decode_form()):
// (kind, weight, scales, row sums, inverse smoothing factors, group size, bias), where kind says
// which of the kernels above reads the weight: 0 float32 (small_linear), 1 int8 weight-only,
// 2 int8 weights and activations, 3 PyTorch's packed int4, 4 int4 weights and int8 activations
// (scales holding d, sums m, and the group size's slot the number of outputs, which its padded weights
// do not say), 5 int8 weights in blocks and int8 activations (scales holding d, and the number of outputs
// in the same slot as 4). The arithmetic is the layer's own forward.
using LinearForm = std::tuple<int64_t, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                              c10::optional<at::Tensor>, int64_t, c10::optional<at::Tensor>>;

// A layer as decode_layers takes it: its two norms' weights, their eps, qkv, o, gate_up and down.
using LayerForm = std::tuple<at::Tensor, at::Tensor, double, LinearForm, LinearForm, LinearForm, LinearForm>;

// The model's last norm and its output head: (norm weight, eps, head).
using HeadForm = std::tuple<at::Tensor, double, LinearForm>;

// The token embedding's weight, every layer's form and the head's, converted from Python once and kept
// by the model: converting the nested tuples of tensors on every call would cost a hundred
// microseconds a step.
struct DecodeForms {
  at::Tensor embedding;  // [vocabulary, hidden] float32
  std::vector<LayerForm> layers;
  HeadForm head;
};

// Row functions: y = x w^T for x [M, K] float32 in each weight format (small_rows.cpp, int8.cpp, int4.cpp), the
// block formats' x already quantized.
void small_linear_rows(const float* xp, int64_t M, const float* wp, int64_t N, int64_t K, float* yp);
void int8_wo_rows(const float* xp, int64_t M, const int8_t* wp, const uint16_t* sp, int64_t N, int64_t K, float* yp);
void int8_dyn_rows(const float* xp, int64_t M, const int8_t* wp, const float* sp, const int32_t* cp, int64_t N,
                   int64_t K, float* yp, const float* inv_smooth = nullptr, bool gated = false);
void int8_block_rows(const BlockActivations& a, const uint8_t* wp, const at::Half* dp, int64_t N, float* yp);
// int8-dyn's sums of x's quantized rows xq [M, Kp] (scales xs) with packed weights w (N outputs, scales sp) on AMX
// tiles, into y [M, N] (gated: [M, N / 2]) as int8_dyn_rows computes it; false, with y untouched, where the tiles do
// not apply (amx.cpp).
bool int8_tile_rows(const int8_t* xq, const float* xs, int64_t M, int64_t Kp, const int8_t* wp, const float* sp,
                    int64_t N, float* yp, bool gated);
// Several rows' sums against two blocks of packed weights, as both the tiles and the VNNI path keep them
// (sums[block][row][output], kSumRows rows a block), scaled and written to y (int8.cpp): as they are, y [M, N], or
// (gated) silu(gate) * up of block b of the gate and block next of the up, y [M, N / 2].
constexpr int64_t kSumRows = 16;
void write_rows(const int32_t* sums, int64_t m, int64_t rows, int64_t b, int64_t next, bool gated, const float* xs,
                const float* sp, int64_t N, float* yp);
void int4_dyn_rows(const BlockActivations& a, const uint8_t* wp, const at::Half* dp, const at::Half* mp, int64_t N,
                   float* yp);

// The layer pieces around the products (layers.cpp).
void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t H, float* op);
void rotary_row(const float* v, const float* c, const float* s, int64_t heads, int64_t D, float* out, int64_t stride);
void silu_mul_rows(const float* xp, int64_t rows, int64_t I, float* op, int64_t op_stride = 0);
// One sequence's cache: key head g's T positions at keys + g * k_stride (values + g * v_stride), D values each, of
// the type attend is given; where P > 0, its first P positions are at shared_keys + g * sk_stride (shared_values +
// g * sv_stride), a kept prompt's that other sequences read too, and keys and values hold the T - P after them.
struct CacheView {
  const void* keys;
  const void* values;
  int64_t T, k_stride, v_stride;
  const void* shared_keys = nullptr;
  const void* shared_values = nullptr;
  int64_t P = 0, sk_stride = 0, sv_stride = 0;
};
// Query head h of sequence b at qp + b * q_stride + h * head_stride; the caches hold float32, bfloat16 or float16
// (cache_type), widened to float32 as they are read.
void attend(const float* qp, int64_t q_stride, int64_t head_stride, const std::vector<CacheView>& caches, int64_t H,
            int64_t KV, int64_t D, float s, float* op, at::ScalarType cache_type = at::kFloat);
// Whether attend reads caches of this type.
bool attends_over(at::ScalarType cache_type);
// t's positions [start, start + length) (t [1, KV, P, D], rows contiguous) copied into new storage with room for
// `room` positions: a [1, KV, length, D] view at the start of a [1, KV, room, D] tensor.
at::Tensor copied_with_room(const at::Tensor& t, int64_t start, int64_t length, int64_t room);

// What bindings.cpp gives Python, each defined in the source named.
at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);  // small_rows.cpp
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum,
                      c10::optional<at::Tensor> inv_smooth);  // int8.cpp
at::Tensor int8_silu_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum,
                      c10::optional<at::Tensor> inv_smooth);  // int8.cpp
at::Tensor int8_wo_linear(at::Tensor x, at::Tensor w, at::Tensor scales);
at::Tensor int8_block_linear(at::Tensor x, at::Tensor w, at::Tensor d, int64_t N);
bool has_vnni();
bool has_amx_tiles();  // amx.cpp
at::Tensor int4_dyn_linear(at::Tensor x, at::Tensor w, at::Tensor d, at::Tensor m, int64_t N);  // int4.cpp
std::tuple<at::Tensor, int64_t, int64_t> sparse_linear(at::Tensor x, at::Tensor w_t, double threshold,
                                                      bool skip);  // sparsity.cpp
std::tuple<at::Tensor, int64_t> mask_small(at::Tensor x, double threshold);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);  // layers.cpp
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t D);
at::Tensor silu_mul(at::Tensor x);
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale);
at::Tensor prompt_attention(at::Tensor q, at::Tensor k, at::Tensor v, std::vector<int64_t> lengths, double scale);
std::vector<at::Tensor> with_rooms(at::Tensor t, std::vector<int64_t> lengths, std::vector<int64_t> rooms);
int64_t argmax(at::Tensor x);
void release_threads();  // decode.cpp
std::vector<int64_t> argmax_rows(at::Tensor x);
std::tuple<at::Tensor, std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>>, int64_t, int64_t> decode_layers(
    at::Tensor ids, const DecodeForms& forms, at::Tensor cos_table, at::Tensor sin_table, std::vector<int64_t> rows,
    std::vector<at::Tensor> keys, std::vector<at::Tensor> values, std::vector<c10::optional<at::Tensor>> shared_keys,
    std::vector<c10::optional<at::Tensor>> shared_values, int64_t heads, int64_t kv_heads, int64_t head_dim,
    double scaling);  // decode.cpp

}  // namespace tokenpath
