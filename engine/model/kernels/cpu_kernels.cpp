// Tokenpath's CPU kernels, built by engine/cpu_kernels.py.
//
// int8_linear: int8 weights times int8 activations with int32 accumulation (the int8-dyn level). On
// CPUs with AVX-512 VNNI one instruction multiplies and sums 64 byte pairs, with AVX2 a few multiply
// 32; elsewhere a plain loop gives the same integers.
//
// sparse_gemv: activation-sparse matrix-vector product that reads only the weight rows of active
// inputs. w_t is the weight stored transposed, [in_features, out_features], so each input channel's
// weights are one contiguous row: an input below the threshold means its row is never loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512VNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Below this many bytes of float32 weights a product runs on the calling thread: waking a sleeping
// thread costs more than the second core saves on so few bytes. Products that widen int8 weights to
// floats do as much work per weight as a float32 one and count their weights at four bytes; the
// integer product counts its actual bytes.
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

// The fewest rows a thread takes at a time: 8 KB of weights, so that a thread that runs out of its
// own share waits for no more than that.
constexpr int64_t kChunkBytes = int64_t{1} << 13;

// f(begin, end, count) over rows [0, N) of a product whose rows are independent, each row_bytes of
// weights (counted as kParallelBytes counts them), in groups of up to S ranges [begin[j], end[j]) that
// f reads side by side: S streams from far-apart places keep more of memory's bandwidth busy than one
// (the loads of several misses are in flight at once), where one range after another would not.
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

template <int R>
static inline void add_rows(float* __restrict y, const float* const* rows, const float* v, int64_t out) {
  for (int64_t j = 0; j < out; ++j) {
    float acc = y[j];
    for (int q = 0; q < R; ++q) acc += v[q] * rows[q][j];
    y[j] = acc;
  }
}

// x is one token's input (any shape holding in_features values). Returns y, shaped like x with the
// last dimension out_features, and the number of active inputs. Each thread takes a contiguous
// share of the active rows and streams them whole into its own partial output (long contiguous
// reads, which the hardware prefetcher follows); the partial outputs are summed at the end.
std::tuple<torch::Tensor, int64_t> sparse_gemv(torch::Tensor x, torch::Tensor w_t, double threshold) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "x must be float32");
  TORCH_CHECK(w_t.dim() == 2 && w_t.is_contiguous() && w_t.scalar_type() == torch::kFloat,
              "w_t must be a contiguous 2-D float32 tensor");
  const int64_t in = w_t.size(0), out = w_t.size(1);
  TORCH_CHECK(x.numel() == in, "x and w_t disagree on the input width");
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = out;
  x = x.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  std::vector<int64_t> active;
  active.reserve(in);
  for (int64_t i = 0; i < in; ++i)
    if (std::fabs(xp[i]) >= threshold) active.push_back(i);
  const int64_t n = static_cast<int64_t>(active.size());
  const int threads = at::get_num_threads();
  // one partial output per thread, summed here: cheaper than an ATen sum call per layer
  std::vector<float> partial(static_cast<size_t>(threads) * out, 0.f);
  float* pp = partial.data();
  constexpr int R = 4;  // rows per pass: each output element is loaded and stored once per four rows
  at::parallel_for(0, n, std::max<int64_t>((n + threads - 1) / threads, 1), [&](int64_t begin, int64_t end) {
    float* y = pp + at::get_thread_num() * out;
    int64_t k = begin;
    for (; k + R <= end; k += R) {
      const float* rows[R];
      float v[R];
      for (int q = 0; q < R; ++q) {
        rows[q] = wp + active[k + q] * out;
        v[q] = xp[active[k + q]];
      }
      add_rows<R>(y, rows, v, out);
    }
    for (; k < end; ++k) {
      const float* rows[1] = {wp + active[k] * out};
      const float v[1] = {xp[active[k]]};
      add_rows<1>(y, rows, v, out);
    }
  });
  auto y = torch::empty(out_sizes, x.options());
  float* yp = y.data_ptr<float>();
  std::copy(pp, pp + out, yp);
  for (int t = 1; t < threads; ++t)
    for (int64_t j = 0; j < out; ++j) yp[j] += pp[t * out + j];
  return {y, n};
}

// x with every entry below the threshold in magnitude set to zero, and how many were zeroed:
// one pass instead of abs, compare, multiply and count as separate operations.
std::tuple<torch::Tensor, int64_t> mask_small(torch::Tensor x, double threshold) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
  int64_t zeroed = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mask_small", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t n = x.numel();
    for (int64_t i = 0; i < n; ++i) {
      const bool keep = std::fabs(static_cast<float>(xp[i])) >= threshold;
      op[i] = keep ? xp[i] : scalar_t(0);
      zeroed += !keep;
    }
  });
  return {out, zeroed};
}

#ifdef __AVX512VNNI__
// Sum of a[k] * b[k] for unsigned a and signed b, exact in int32 for the widths used here: one
// instruction multiplies and sums 64 byte pairs.
static inline int32_t dot_u8s8(const uint8_t* a, const int8_t* b, int64_t n) {
  int64_t k = 0;
  __m512i acc = _mm512_setzero_si512();
  for (; k + 64 <= n; k += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(a + k), _mm512_loadu_si512(b + k));
  int32_t sum = _mm512_reduce_add_epi32(acc);
  for (; k < n; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
  return sum;
}
#endif

// Sum of a[k] * b[k] for signed a and b in [-127, 127], exact in int32 for the widths used here. With
// AVX2, 32 byte pairs at a time: |b| times a with b's sign (maddubs takes an unsigned and a signed
// byte), so each pair sum is at most 2 * 127 * 127 and nothing saturates.
static inline int32_t dot_s8s8(const int8_t* a, const int8_t* b, int64_t n) {
  int64_t k = 0;
  int32_t sum = 0;
#if defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (; k + 32 <= n; k += 32) {
    const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k));
    const __m256i bv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(bv), _mm256_sign_epi8(av, bv));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
  }
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  sum = _mm_cvtsi128_si32(s);
#endif
  for (; k < n; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
  return sum;
}

// y = x w^T for x [M, K] float32 and w [N, K] int8 with one scale per output row (w_scale) and the
// sum of each row's integers (w_sum). Each row of x is quantized here, symmetric:
// s = max|x| / 127, q = round(x / s) in [-127, 127]. With AVX-512 VNNI the products take q + 128,
// unsigned, and the 128 * w_sum[n] this adds to every dot product is taken back out; elsewhere
// dot_s8s8 multiplies the signed bytes. Either way the integers are exact. Output threads take
// shares of the weight rows, so every weight row is read once whatever M is.
static void int8_dyn_rows(const float* xp, int64_t M, const int8_t* wp, const float* sp, const int32_t* cp,
                          int64_t N, int64_t K, float* yp) {
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    xs[m] = s;
    for (int64_t k = 0; k < K; ++k)
      xq[m * K + k] = static_cast<int8_t>(std::min(std::max(std::nearbyint(row[k] / s), -127.f), 127.f));
  }
#ifdef __AVX512VNNI__
  std::vector<uint8_t> xu(xq.size());
  for (size_t i = 0; i < xq.size(); ++i) xu[i] = static_cast<uint8_t>(xq[i] + 128);
#endif
  shared_rows(N, K, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* wr = wp + n * K;
      for (int64_t m = 0; m < M; ++m) {
#ifdef __AVX512VNNI__
        const int32_t acc = dot_u8s8(xu.data() + m * K, wr, K) - 128 * cp[n];
#else
        const int32_t acc = dot_s8s8(xq.data() + m * K, wr, K);
#endif
        yp[m * N + n] = static_cast<float>(acc) * xs[m] * sp[n];
      }
    }
  });
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor w_sum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kChar, "w must be contiguous int8");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_sum.scalar_type() == torch::kInt,
              "w_scale must be float32 and w_sum int32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && w_scale.numel() == N && w_sum.numel() == N, "shapes disagree");
  auto y = torch::empty({M, N}, x.options());
  int8_dyn_rows(x.data_ptr<float>(), M, w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(),
                N, K, y.data_ptr<float>());
  return y;
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

// Sum of a[k] * b[r][k] for each of R rows b[r], all read side by side: per row two registers of lanes,
// then the registers and the lanes added in a fixed order, and the last few products one by one, so a
// row's sum does not depend on the rows read beside it or on where the call comes from.
template <int R>
static inline void dot_rows(const float* __restrict a, const float* const* b, int64_t n, float* out) {
#ifdef HAVE_LANES
  using V = Lanes::V;
  constexpr int W = Lanes::W;
  V acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = Lanes::zero();
  int64_t k = 0;
  for (; k + 2 * W <= n; k += 2 * W) {
    const V x0 = Lanes::load(a + k), x1 = Lanes::load(a + k + W);
    for (int r = 0; r < R; ++r) {
      acc0[r] = Lanes::fma(x0, Lanes::load(b[r] + k), acc0[r]);
      acc1[r] = Lanes::fma(x1, Lanes::load(b[r] + k + W), acc1[r]);
    }
  }
  if (k + W <= n) {
    const V x0 = Lanes::load(a + k);
    for (int r = 0; r < R; ++r) acc0[r] = Lanes::fma(x0, Lanes::load(b[r] + k), acc0[r]);
    k += W;
  }
  for (int r = 0; r < R; ++r) {
    float sum = Lanes::sum(Lanes::add(acc0[r], acc1[r]));
    for (int64_t j = k; j < n; ++j) sum += a[j] * b[r][j];
    out[r] = sum;
  }
#else
  for (int r = 0; r < R; ++r) out[r] = dot_lanes(a, b[r], n);
#endif
}

static inline float dot(const float* a, const float* b, int64_t n) {
  float out;
  dot_rows<1>(a, &b, n, &out);
  return out;
}

// Rows of float32 weights small_linear_rows reads side by side (its switch takes groups of 1 to 4).
constexpr int kStreams = 4;

// y = x w^T (+ bias) for the few rows of a decode or verification step: x [M, K], w [N, K], float32.
// Threads take shares of the weight rows and read kStreams rows from far-apart parts of their shares
// side by side (adjacent rows would be one stream), and each row, read from memory once, serves all M
// rows of x from the nearest cache. A row's sums run in an order that does not depend on M (MKL's
// few-row kernels pack the weights first and sum in another order).
static void small_linear_rows(const float* xp, int64_t M, const float* wp, int64_t N, int64_t K, float* yp) {
  shared_streams<kStreams>(N, K * 4, [&](const int64_t* begin, const int64_t* end, int ranges) {
    side_by_side<kStreams>(begin, end, ranges, [&](const int64_t* rows, int count) {
      const float* w[kStreams];
      float y[kStreams];
      for (int r = 0; r < count; ++r) w[r] = wp + rows[r] * K;
      for (int64_t m = 0; m < M; ++m) {
        switch (count) {
          case 4: dot_rows<4>(xp + m * K, w, K, y); break;
          case 3: dot_rows<3>(xp + m * K, w, K, y); break;
          case 2: dot_rows<2>(xp + m * K, w, K, y); break;
          default: dot_rows<1>(xp + m * K, w, K, y);
        }
        for (int r = 0; r < count; ++r) yp[m * N + rows[r]] = y[r];
      }
    });
  });
}

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "small_linear takes float32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous 2-D tensor");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "x and w disagree on the input width");
  x = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  small_linear_rows(x.data_ptr<float>(), x.numel() / K, w.data_ptr<float>(), N, K, y.data_ptr<float>());
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// Up to this many rows of x the int8 weight-only product reads the weights row by row (a decode or
// verification step); more rows (a prefill) expand the weights once and multiply in MKL.
constexpr int64_t kFewRows = 24;

static inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// Sum of w[k] * x[k] for int8 w, widened eight at a time into four registers of float lanes that
// are added in a fixed order, then the last few one by one.
static inline float dot_int8(const int8_t* __restrict w, const float* __restrict x, int64_t n) {
  int64_t k = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  auto widened = [&](int64_t at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + at))));
  };
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (; k + 32 <= n; k += 32) {
    acc0 = _mm256_fmadd_ps(widened(k), _mm256_loadu_ps(x + k), acc0);
    acc1 = _mm256_fmadd_ps(widened(k + 8), _mm256_loadu_ps(x + k + 8), acc1);
    acc2 = _mm256_fmadd_ps(widened(k + 16), _mm256_loadu_ps(x + k + 16), acc2);
    acc3 = _mm256_fmadd_ps(widened(k + 24), _mm256_loadu_ps(x + k + 24), acc3);
  }
  for (; k + 8 <= n; k += 8) acc0 = _mm256_fmadd_ps(widened(k), _mm256_loadu_ps(x + k), acc0);
  sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
  for (; k < n; ++k) sum += static_cast<float>(w[k]) * x[k];
  return sum;
}

// int8 weight-only product: x [M, K] float32, w [N, K] int8, one bfloat16 scale per output row
// (w = q * scale). Few rows: each output alone (dot_int8), so a row's result does not depend on M.
static void int8_wo_rows(const float* xp, int64_t M, const int8_t* wp, const uint16_t* sp, int64_t N, int64_t K,
                         float* yp) {
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float scale = bf16_to_float(sp[n]);
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_int8(wp + n * K, xp + m * K, K) * scale;
    }
  });
}

torch::Tensor int8_wo_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.numel() == w.size(0), "scales: one bfloat16 per row");
  x = x.contiguous();
  scales = scales.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on the input width");
  const int8_t* wp = w.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  if (M > kFewRows) {
    auto expanded = torch::empty({N, K}, x.options());
    float* ep = expanded.data_ptr<float>();
    at::parallel_for(0, N, N * K * 4 >= kParallelBytes ? 16 : N, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const float scale = bf16_to_float(sp[n]);
        for (int64_t k = 0; k < K; ++k) ep[n * K + k] = static_cast<float>(wp[n * K + k]) * scale;
      }
    });
    return at::matmul(x, expanded.t());
  }
  auto y = torch::empty({M, N}, x.options());
  int8_wo_rows(x.data_ptr<float>(), M, wp, sp, N, K, y.data_ptr<float>());
  return y;
}

// The int4-dyn level: 4-bit weights in blocks of 32 along the input, each block with an fp16 scale d
// and minimum m (w = q * d + m, q in 0..15: the format of llama.cpp's Q4_1), times activations
// quantized to int8 per block of 32 at run time (x = xq * dx). Per block the product is
// d * dx * sum(q * xq) + m * dx * sum(xq): the first sum is exact in integers, the second is the
// activations' own. The weights of a block are 16 bytes, byte j holding q[j] in its low half and
// q[j + 16] in its high half.
constexpr int64_t kBlock = 32;

static inline float half_to_float(const at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// One row of activations quantized per block: q = round(x / dx) in [-127, 127], dx = max|x| / 127
// (1 where the block is all zero), and each block's dx * sum(q).
static void quantize_blocks(const float* x, int64_t K, int8_t* q, float* dx, float* dsum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float d = amax > 0.f ? amax / 127.f : 1.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      const int32_t v = static_cast<int32_t>(std::min(std::max(std::nearbyint(xb[k] / d), -127.f), 127.f));
      q[b * kBlock + k] = static_cast<int8_t>(v);
      sum += v;
    }
    dx[b] = d;
    dsum[b] = d * static_cast<float>(sum);
  }
}

// M rows of K activations quantized per block, as the block kernels take them.
struct BlockActivations {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  BlockActivations(const float* x, int64_t M, int64_t K)
      : q(static_cast<size_t>(M * K)), d(static_cast<size_t>(M * K / kBlock)), dsum(d.size()) {
    for (int64_t r = 0; r < M; ++r)
      quantize_blocks(x + r * K, K, q.data() + r * K, d.data() + r * K / kBlock, dsum.data() + r * K / kBlock);
  }
};

// One row of packed weights (wr, with its blocks' d and m) against one row of activations quantized
// per block (xq, dx, dx * sum): sum over blocks of d * dx * sum(q * xq) + m * dx * sum(xq).
static inline float int4_row_dot(const uint8_t* wr, const at::Half* d, const at::Half* m, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t blocks) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // A block's 16 bytes go to both halves of a register, the upper half shifted down by four bits:
  // masked, that is q[0..15] then q[16..31], in the order of the activations. maddubs multiplies
  // those unsigned bytes by the signed activations (a pair sums to at most 2 * 15 * 127, so nothing
  // saturates); the scales of eight blocks are multiplied in one go, two accumulators alternate.
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, mins = acc0;
  alignas(32) float scale[8];
  int64_t b = 0;
  for (; b < blocks; b += 8) {
    const int64_t n = std::min<int64_t>(8, blocks - b);
    if (n == 8) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b)));
      _mm256_store_ps(scale, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + b)));
      mins = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b))),
                             _mm256_loadu_ps(dsum + b), mins);
    } else {
      for (int64_t j = 0; j < n; ++j) scale[j] = _cvtsh_ss(d[b + j].x) * dx[b + j];
    }
    for (int64_t j = 0; j < n; ++j) {
      const auto* raw = reinterpret_cast<const __m128i*>(wr + (b + j) * kBlock / 2);
      const __m256i q = _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128(raw)), shift), low);
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b + j) * kBlock));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones));
      if (j & 1)
        acc1 = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(scale + j), acc1);
      else
        acc0 = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(scale + j), acc0);
    }
  }
  float total = hsum8(mins);
  for (b = blocks - blocks % 8; b < blocks; ++b) total += _cvtsh_ss(m[b].x) * dsum[b];
  return hsum8(_mm256_add_ps(acc0, acc1)) + total;
#else
  float acc = 0.f, total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = wr + b * kBlock / 2;
    const int8_t* x = xq + b * kBlock;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock / 2; ++j)
      sum += static_cast<int32_t>(w[j] & 0xF) * x[j] + static_cast<int32_t>(w[j] >> 4) * x[j + kBlock / 2];
    acc += static_cast<float>(sum) * (half_to_float(d[b]) * dx[b]);
    total += half_to_float(m[b]) * dsum[b];
  }
  return acc + total;
#endif
}

// y = x w^T for x [M, K] float32 and the packed weights w [N, K / 2] uint8 with d and m [N, K / 32]
// fp16. Threads take shares of the weight rows; each row of y is computed on its own, so a row's
// result does not depend on M.
static void int4_dyn_rows(const float* xp, int64_t M, const uint8_t* wp, const at::Half* dp, const at::Half* mp,
                          int64_t N, int64_t K, float* yp) {
  const int64_t KB = K / kBlock;
  const BlockActivations a(xp, M, K);
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r = 0; r < M; ++r)
        yp[r * N + n] = int4_row_dot(wp + n * (K / 2), dp + n * KB, mp + n * KB, a.q.data() + r * K,
                                     a.d.data() + r * KB, a.dsum.data() + r * KB, KB);
  });
}

torch::Tensor int4_dyn_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), KB = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(w.scalar_type() == torch::kByte && w.is_contiguous() && w.dim() == 2 && w.size(1) * 2 == K,
              "w must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(d.scalar_type() == torch::kHalf && m.scalar_type() == torch::kHalf && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == N * KB && m.numel() == N * KB, "d and m: fp16 [N, K / 32]");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  int4_dyn_rows(x.data_ptr<float>(), M, w.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), N, K,
                y.data_ptr<float>());
  return y;
}

// int8 weights in blocks of 32 along the input with an fp16 scale d each (w = q * d, q in
// [-127, 127]: the layout of llama.cpp's Q8_0), times activations quantized per block as above:
// sum over blocks of d * dx * sum(q * xq), each block's sum exact in integers.
static inline float int8_block_row_dot(const int8_t* wr, const at::Half* d, const int8_t* xq, const float* dx,
                                       int64_t blocks) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // |w| times x with w's sign, as dot_s8s8 does: no pair sum saturates
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  alignas(32) float scale[8];
  for (int64_t b = 0; b < blocks; b += 8) {
    const int64_t n = std::min<int64_t>(8, blocks - b);
    if (n == 8)
      _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))),
                                           _mm256_loadu_ps(dx + b)));
    else
      for (int64_t j = 0; j < n; ++j) scale[j] = _cvtsh_ss(d[b + j].x) * dx[b + j];
    for (int64_t j = 0; j < n; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + (b + j) * kBlock));
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b + j) * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      if (j & 1)
        acc1 = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(scale + j), acc1);
      else
        acc0 = _mm256_fmadd_ps(sums, _mm256_broadcast_ss(scale + j), acc0);
    }
  }
  return hsum8(_mm256_add_ps(acc0, acc1));
#else
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t k = 0; k < kBlock; ++k) sum += static_cast<int32_t>(wr[b * kBlock + k]) * xq[b * kBlock + k];
    acc += static_cast<float>(sum) * (half_to_float(d[b]) * dx[b]);
  }
  return acc;
#endif
}

static void int8_block_rows(const float* xp, int64_t M, const int8_t* wp, const at::Half* dp, int64_t N, int64_t K,
                            float* yp) {
  const int64_t KB = K / kBlock;
  const BlockActivations a(xp, M, K);
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t r = 0; r < M; ++r)
        yp[r * N + n] = int8_block_row_dot(wp + n * K, dp + n * KB, a.q.data() + r * K, a.d.data() + r * KB, KB);
  });
}

// y = x w^T for x [M, K] float32, w [N, K] int8 and d [N, K / 32] fp16; each row of y on its own.
torch::Tensor int8_block_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.dim() == 2 && w.size(1) == K,
              "w must be contiguous int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == torch::kHalf && d.is_contiguous() && d.numel() == N * (K / kBlock),
              "d: fp16 [N, K / 32]");
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  int8_block_rows(x.data_ptr<float>(), M, w.data_ptr<int8_t>(), d.data_ptr<at::Half>(), N, K, y.data_ptr<float>());
  return y;
}

// RMSNorm of each row of x (float32, last dimension contiguous): w * (x / sqrt(mean(x^2) + eps)),
// the products in the same order as transformers' LlamaRMSNorm. One small loop: the operations
// PyTorch would chain for it each cost several microseconds on a decode step, whose caches the
// weight stream has just flushed.
static void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t H, float* op) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * H;
    double squares = 0.0;
    for (int64_t k = 0; k < H; ++k) squares += static_cast<double>(row[k]) * row[k];
    const float scale = 1.f / std::sqrt(static_cast<float>(squares / H) + static_cast<float>(eps));
    for (int64_t k = 0; k < H; ++k) op[r * H + k] = wp[k] * (row[k] * scale);
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "rms_norm takes float32");
  x = x.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "the weight's width differs from x's");
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.contiguous().data_ptr<float>(), eps, rows, H, out.data_ptr<float>());
  return out;
}

// The first `heads` heads of one row v rotated: head h goes to out + h * stride.
static void rotary_row(const float* v, const float* c, const float* s, int64_t heads, int64_t D, float* out,
                       int64_t stride) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* vh = v + h * D;
    float* o = out + h * stride;
    for (int64_t d = 0; d < half; ++d) {
      const float rotated = -vh[d + half];
      o[d] = vh[d] * c[d] + rotated * s[d];
    }
    for (int64_t d = half; d < D; ++d) o[d] = vh[d] * c[d] + vh[d - half] * s[d];
  }
}

// Rotary embedding of the first `heads` heads of each row of x [B, L, >= heads * D] (e.g. a fused
// q/k/v projection's output): returns [B, heads, L, D] with out = x * cos + rotate_half(x) * sin,
// cos and sin [B, L, D]. Same arithmetic as the PyTorch expression, element by element.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t D) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && cos.scalar_type() == torch::kFloat &&
              sin.scalar_type() == torch::kFloat, "rotary takes float32");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t B = x.size(0), L = x.size(1), width = x.size(2);
  TORCH_CHECK(width >= heads * D && cos.size(-1) == D && cos.numel() == B * L * D, "rotary: shapes disagree");
  auto out = torch::empty({B, heads, L, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l)
      rotary_row(xp + (b * L + l) * width, cp + (b * L + l) * D, sp + (b * L + l) * D, heads, D,
                 op + (b * heads * L + l) * D, L * D);
  return out;
}

// e^x within about two units in the last place for x in [-87, 88], and e^-87 or e^88 beyond (silu and
// softmax need no more: 1 + e^-87 is 1): x = n ln 2 + r with |r| <= ln 2 / 2, e^r from a polynomial
// (Cephes' coefficients), times 2^n built in the exponent bits. The vector form below does the same
// operations on eight lanes, so a value gets the same bits in either. The library's expf, one value at
// a time, cost a decode step several times as much: silu takes tens of thousands of them a step.
constexpr float kExpHigh = 88.f, kExpLow = -87.f;  // 2^n stays a normal float
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
  if (std::isnan(x)) return x;
  x = std::max(std::min(x, kExpHigh), kExpLow);
  const float n = std::nearbyint(x * kLog2e);
  const float r = (x - n * kLn2High) - n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  const float e = (p * (r * r) + r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

#if defined(__AVX2__)
static inline __m256 exp_approx8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(kExpHigh)), _mm256_set1_ps(kExpLow));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2High))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Low)));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kExpPoly[i]));
  const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}
#endif

// w[t] = e^(w[t] - top) for t < T.
static void exp_shifted(float* w, int64_t T, float top) {
  int64_t t = 0;
#if defined(__AVX2__)
  for (; t + 8 <= T; t += 8)
    _mm256_storeu_ps(w + t, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(w + t), _mm256_set1_ps(top))));
#endif
  for (; t < T; ++t) w[t] = exp_approx(w[t] - top);
}

// silu(g) * u = g / (1 + e^-g) * u, for each row of x [rows, 2 * I] holding g then u.
static void silu_mul_rows(const float* xp, int64_t rows, int64_t I, float* op) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = xp + r * 2 * I;
    const float* up = gate + I;
    float* out = op + r * I;
    int64_t k = 0;
#if defined(__AVX2__)
    for (; k + 8 <= I; k += 8) {
      const __m256 g = _mm256_loadu_ps(gate + k);
      const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
      _mm256_storeu_ps(out + k, _mm256_mul_ps(silu, _mm256_loadu_ps(up + k)));
    }
#endif
    for (; k < I; ++k) out[k] = gate[k] / (1.f + exp_approx(-gate[k])) * up[k];
  }
}

// silu(gate) * up for x [..., 2 * I] holding gate then up (a fused gate/up projection's output).
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "silu_mul takes float32");
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  silu_mul_rows(x.data_ptr<float>(), rows, I, out.data_ptr<float>());
  return out;
}

// k_stride, v_stride: floats from one key (value) head to the next, T * D when they are contiguous.
static void attend(const float* qp, const float* kp, const float* vp, int64_t B, int64_t H, int64_t KV, int64_t T,
                   int64_t D, int64_t k_stride, int64_t v_stride, float s, float* op) {
  const int64_t group = H / KV;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (T * D));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(T));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qh = qp + bh * D;
      const float* kh = kp + (b * KV + h / group) * k_stride;
      const float* vh = vp + (b * KV + h / group) * v_stride;
      float top = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        w[t] = dot(qh, kh + t * D, D) * s;
        top = std::max(top, w[t]);
      }
      exp_shifted(w.data(), T, top);
      float total = 0.f;
      for (int64_t t = 0; t < T; ++t) total += w[t];
      float* o = op + bh * D;
      std::fill(o, o + D, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float p = w[t] / total;
        const float* vt = vh + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vt[d];
      }
    }
  });
}

// Attention of one new token per sequence over all cached positions (a decode step: every key is
// visible): q [B, H, 1, D], k and v [B, KV, T, D] with H a multiple of KV (grouped-query heads share
// a key/value head), float32. Returns [B, 1, H * D], the heads side by side as the output projection
// takes them. PyTorch's CPU flash-attention kernel sets up blocks and threads for every call, which
// for one query row costs far more than the arithmetic; this is one plain pass per head, split over
// threads only when there is enough work to pay for them.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
              v.scalar_type() == torch::kFloat, "decode_attention takes float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == 1,
              "decode_attention: q [B, H, 1, D], k and v [B, KV, T, D]");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), KV = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && KV > 0 && H % KV == 0 && T > 0, "decode_attention: shapes disagree");
  auto out = torch::empty({B, 1, H * D}, q.options());
  attend(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), B, H, KV, T, D, T * D, T * D,
         static_cast<float>(scale), out.data_ptr<float>());
  return out;
}

// One linear layer as decode_layers takes it from Python (each layer class's decode_form()):
// (kind, weight, scales, row sums, inverse smoothing factors, group size, bias), where kind says
// which of the kernels above reads the weight: 0 float32 (small_linear), 1 int8 weight-only,
// 2 int8 weights and activations, 3 PyTorch's packed int4, 4 int4 weights and int8 activations
// (scales holding d, sums m), 5 int8 weights in blocks and int8 activations (scales holding d). The arithmetic is the layer's own forward.
using LinearForm = std::tuple<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                              c10::optional<torch::Tensor>, int64_t, c10::optional<torch::Tensor>>;

static int64_t linear_outputs(const LinearForm& form) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  return kind == 3 ? scales->size(1) : w.size(0);  // PyTorch's int4 packing keeps N in its scales' shape
}

// y = the layer applied to the M rows of x, K values each: the row functions above, no tensors in
// between. Each weight row is read once for all M rows, and a row's result does not depend on M.
static void apply_linear(const LinearForm& form, const float* x, int64_t M, int64_t K, float* y) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  const int64_t N = linear_outputs(form);
  std::vector<float> smoothed;
  switch (kind) {
    case 0: small_linear_rows(x, M, w.data_ptr<float>(), N, K, y); break;
    case 1:
      int8_wo_rows(x, M, w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::BFloat16>()), N,
                   K, y);
      break;
    case 2:
      if (inv_smooth.has_value()) {
        const float* f = inv_smooth->data_ptr<float>();
        smoothed.resize(static_cast<size_t>(M * K));
        for (int64_t m = 0; m < M; ++m)
          for (int64_t k = 0; k < K; ++k) smoothed[m * K + k] = x[m * K + k] * f[k];
        x = smoothed.data();
      }
      int8_dyn_rows(x, M, w.data_ptr<int8_t>(), scales->data_ptr<float>(), sums->data_ptr<int32_t>(), N, K, y);
      break;
    case 3: {
      const auto rows = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat);
      const auto out = at::_weight_int4pack_mm_for_cpu(rows.to(torch::kBFloat16), w, group, *scales).to(torch::kFloat);
      std::memcpy(y, out.data_ptr<float>(), sizeof(float) * M * N);
      break;
    }
    case 5: int8_block_rows(x, M, w.data_ptr<int8_t>(), scales->data_ptr<at::Half>(), N, K, y); break;
    case 4: int4_dyn_rows(x, M, w.data_ptr<uint8_t>(), scales->data_ptr<at::Half>(), sums->data_ptr<at::Half>(), N, K, y); break;
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
  }
}

// Positions a growing cache reserves at a time: copying a layer's keys and values to add each token
// would move the whole cache on every step.
constexpr int64_t kCacheRoom = 128;

// Whether cache [1, KV, T, D] is a view into storage with room for one more position after its last
// (the caches decode_layers grows or copies; a crop keeps the room).
static bool has_room(const torch::Tensor& cache, int64_t KV, int64_t D) {
  const int64_t T = cache.size(2), head = cache.stride(1);
  return cache.stride(3) == 1 && cache.stride(2) == D && head >= (T + 1) * D && head % D == 0 &&
         cache.stride(0) == KV * head && cache.storage_offset() == 0 &&
         cache.storage().nbytes() >= static_cast<size_t>(KV * head) * sizeof(float);
}

// Head g's new row, from row + g * D, written at position `at` of cache [1, KV, >at, D] (or of its
// storage's room just after it).
static void write_position(const torch::Tensor& cache, int64_t at, const float* row, int64_t KV, int64_t D) {
  float* dst = cache.data_ptr<float>();
  for (int64_t g = 0; g < KV; ++g) std::memcpy(dst + g * cache.stride(1) + at * D, row + g * D, sizeof(float) * D);
}

// cache [1, KV, T, D] copied into new storage with room for kCacheRoom more positions, as
// [1, KV, T + 1, D] with the new rows from row written at T.
static torch::Tensor regrown(const torch::Tensor& cache, const float* row, int64_t KV, int64_t D) {
  const int64_t T = cache.size(2), capacity = (T + 1 + kCacheRoom - 1) / kCacheRoom * kCacheRoom;
  auto out = torch::empty({1, KV, capacity, D}, cache.options()).narrow(2, 0, T + 1);
  for (int64_t g = 0; g < KV; ++g)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.data_ptr<float>() + g * out.stride(1) + t * D,
                  cache.data_ptr<float>() + g * cache.stride(1) + t * cache.stride(2), sizeof(float) * D);
  write_position(out, T, row, KV, D);
  return out;
}

// A layer as decode_layers takes it: its two norms' weights, their eps, qkv, o, gate_up and down.
using LayerForm = std::tuple<torch::Tensor, torch::Tensor, double, LinearForm, LinearForm, LinearForm, LinearForm>;

// The model's last norm and its output head: (norm weight, eps, head).
using HeadForm = std::tuple<torch::Tensor, double, LinearForm>;

// The token embedding's weight, every layer's form and the head's, converted from Python once and kept
// by the model: converting the nested tuples of tensors on every call would cost a hundred
// microseconds a step.
struct DecodeForms {
  torch::Tensor embedding;  // [vocabulary, hidden] float32
  std::vector<LayerForm> layers;
  HeadForm head;
};

// A decode step of B sequences in one call from Python: each one's new token's embedding (ids [B]),
// every Llama decoder layer, then the last norm and the output head; sequence b's cos and sin are row
// rows[b] of the rotary tables [1, rows, head_dim], and its caches are keys and values [b * layers + i]
// (each [1, kv_heads, T_b, head_dim], the lengths free to differ). Every product takes the B rows at
// once, so each weight is read once for all of them; attention runs per sequence over its own caches.
// The same row functions, in the same order, as the lean forward's modules run one by one, and a row's
// result does not depend on the rows beside it, so each sequence's logits are the same to the bit as
// when it is decoded alone, with no tensor made between the functions but a cache copied when its
// storage has no room left. A cache with room grows in place: the tensor given becomes [1, kv_heads,
// T + 1, head_dim]. Returns (logits [B, 1, vocabulary], (index, keys, values) of each cache pair that
// was copied instead, cache bytes read, cache bytes written); the bytes are what attention and the
// caches' growth moved, all sequences together.
std::tuple<torch::Tensor, std::vector<std::tuple<int64_t, torch::Tensor, torch::Tensor>>, int64_t, int64_t> decode_layers(
    torch::Tensor ids, const DecodeForms& forms, torch::Tensor cos_table, torch::Tensor sin_table,
    std::vector<int64_t> rows, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, int64_t heads,
    int64_t kv_heads, int64_t head_dim, double scaling) {
  const auto& layers = forms.layers;
  const auto& embedding = forms.embedding;
  const int64_t B = static_cast<int64_t>(rows.size()), L = static_cast<int64_t>(layers.size());
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.numel() == B && B > 0, "decode_layers takes one token id per row");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B * L && static_cast<int64_t>(values.size()) == B * L,
              "one cache per sequence and layer");
  for (const auto* table : {&cos_table, &sin_table})
    for (int64_t row : rows)
      TORCH_CHECK(table->scalar_type() == torch::kFloat && table->is_contiguous() && table->dim() == 3 &&
                      table->size(2) == head_dim && row >= 0 && row < table->size(1),
                  "cos and sin: float32 tables [1, rows, head_dim] holding the rows");
  const auto id_tensor = ids.contiguous();
  const int64_t* tokens = id_tensor.data_ptr<int64_t>();
  const int64_t H = embedding.size(1), D = head_dim, KV = kv_heads, rotated_heads = heads + kv_heads;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK_INDEX(tokens[b] >= 0 && tokens[b] < embedding.size(0), "token id ", tokens[b],
                      " is out of the embedding's range");
  auto out = torch::empty({B, 1, H}, embedding.options());
  float* residual = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(residual + b * H, embedding.data_ptr<float>() + tokens[b] * H, sizeof(float) * H);
  const float* cos = cos_table.data_ptr<float>();
  const float* sin = sin_table.data_ptr<float>();
  std::vector<float> normed(B * H), delta(B * H), rotated(B * rotated_heads * D), attended(B * heads * D), fused,
      gate_up, act;
  // A cache with room gets its new position written in place, and its size one position longer after
  // the last layer, all together: a longer view made per layer between the products cost several
  // microseconds each, and a step that fails part-way leaves every cache's size as it was.
  std::vector<char> longer(2 * keys.size());
  const int64_t position_bytes = KV * D * static_cast<int64_t>(sizeof(float));
  int64_t cache_read = 0, cache_written = 0;
  auto appended = [&](torch::Tensor& cache, const float* row) {
    const int64_t T = cache.size(2);
    cache_read += (T + 1) * position_bytes;  // attention reads the grown cache
    cache_written += position_bytes;
    if (has_room(cache, KV, D)) {
      write_position(cache, T, row, KV, D);
      return true;
    }
    cache_read += T * position_bytes;  // and a cache without room is copied first
    cache_written += T * position_bytes;
    cache = regrown(cache, row, KV, D);
    return false;
  };
  auto add_residual = [&]() {
    for (int64_t k = 0; k < B * H; ++k) residual[k] += delta[k];
  };
  for (int64_t i = 0; i < L; ++i) {
    const auto& [norm1, norm2, eps, qkv, o, up, down] = layers[i];
    rms_norm_rows(residual, norm1.data_ptr<float>(), eps, B, H, normed.data());
    const int64_t width = linear_outputs(qkv);
    fused.resize(static_cast<size_t>(B * width));
    apply_linear(qkv, normed.data(), B, H, fused.data());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t c = b * L + i;
      TORCH_CHECK(keys[c].dim() == 4 && keys[c].size(1) == KV && keys[c].size(3) == D &&
                      values[c].sizes() == keys[c].sizes(), "a cache is not [1, kv_heads, T, head_dim]");
      float* rot = rotated.data() + b * rotated_heads * D;
      const float* row = fused.data() + b * width;
      rotary_row(row, cos + rows[b] * D, sin + rows[b] * D, rotated_heads, D, rot, D);
      const int64_t T = keys[c].size(2);
      longer[2 * c] = appended(keys[c], rot + heads * D);
      longer[2 * c + 1] = appended(values[c], row + rotated_heads * D);
      attend(rot, keys[c].data_ptr<float>(), values[c].data_ptr<float>(), 1, heads, KV, T + 1, D, keys[c].stride(1),
             values[c].stride(1), static_cast<float>(scaling), attended.data() + b * heads * D);
    }
    apply_linear(o, attended.data(), B, heads * D, delta.data());
    add_residual();
    rms_norm_rows(residual, norm2.data_ptr<float>(), eps, B, H, normed.data());
    const int64_t inner = linear_outputs(up) / 2;
    gate_up.resize(static_cast<size_t>(B * 2 * inner));
    act.resize(static_cast<size_t>(B * inner));
    apply_linear(up, normed.data(), B, H, gate_up.data());
    silu_mul_rows(gate_up.data(), B, inner, act.data());
    apply_linear(down, act.data(), B, inner, delta.data());
    add_residual();
  }
  const auto& [norm, eps, linear] = forms.head;
  rms_norm_rows(residual, norm.data_ptr<float>(), eps, B, H, normed.data());
  auto logits = torch::empty({B, 1, linear_outputs(linear)}, out.options());
  apply_linear(linear, normed.data(), B, H, logits.data_ptr<float>());
  // The caches with room grow by changing the given tensors' sizes, not by new tensors: none is made
  // or freed, and Python's caches need no new objects.
  std::vector<std::tuple<int64_t, torch::Tensor, torch::Tensor>> copied;
  for (size_t c = 0; c < keys.size(); ++c) {
    for (auto [cache, grown] : {std::pair{&keys[c], longer[2 * c]}, std::pair{&values[c], longer[2 * c + 1]}})
      if (grown) {
        const std::vector<int64_t> strides = cache->strides().vec();  // not a view of what it overwrites
        cache->unsafeGetTensorImpl()->set_sizes_and_strides({1, KV, cache->size(2) + 1, D}, strides);
      }
    if (!longer[2 * c] || !longer[2 * c + 1]) copied.emplace_back(static_cast<int64_t>(c), keys[c], values[c]);
  }
  return {logits, copied, cache_read, cache_written};
}

// The index of the largest of n floats, the first one where several are equal, and the first NaN
// where there is one: what torch.argmax returns, which on a decode step's 49152 logits costs tens of
// microseconds in a scalar loop.
int64_t argmax(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 1 && x.numel() > 0, "argmax takes a 1-D float32 tensor");
  x = x.contiguous();
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  float top = p[0];
  int64_t k = 0;
#if defined(__AVX2__)
  __m256 best = _mm256_set1_ps(p[0]);
  __m256 unordered = _mm256_setzero_ps();
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_loadu_ps(p + k);
    best = _mm256_max_ps(best, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(unordered)) k = 0;  // a NaN: the plain loop below finds the first
  else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    for (float lane : lanes) top = std::max(top, lane);
  }
#endif
  for (; k < n; ++k) {
    if (std::isnan(p[k])) return k;
    top = std::max(top, p[k]);
  }
  for (k = 0; k < n; ++k)
    if (p[k] == top) return k;
  return 0;
}

bool has_vnni() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x w^T with int8 weights, activations quantized to int8 per row");
  m.def("small_linear", &small_linear, "x w^T (+ bias) for a few rows of x, float32, each row's result independent of M");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, float32");
  m.def("rotary", &rotary, "rotary embedding of the first heads of each row, float32");
  m.def("decode_attention", &decode_attention, "attention of one new token over every cached position, float32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate/up output, float32");
  m.def("int8_wo_linear", &int8_wo_linear, "x w^T with int8 weights and one scale per row, float32 x");
  m.def("int4_dyn_linear", &int4_dyn_linear, "x w^T with Q4_1-format int4 weights, x quantized to int8 per block of 32");
  py::class_<DecodeForms>(m, "DecodeForms", "the embedding, every layer's form and the head's, as decode_layers reads them")
      .def(py::init<torch::Tensor, std::vector<LayerForm>, HeadForm>());
  m.def("decode_layers", &decode_layers, "the logits of one new token per sequence: its embedding, every Llama decoder layer, appending to each sequence's KV caches, then the last norm and the head");
  m.def("argmax", &argmax, "index of the largest value (the first among equals, the first NaN if any)");
  m.def("int8_block_linear", &int8_block_linear, "x w^T with Q8_0-layout int8 weights, x quantized to int8 per block of 32");
  m.def("has_vnni", &has_vnni, "whether int8_linear was built with AVX-512 VNNI instructions");
  m.def("sparse_gemv", &sparse_gemv, "y = W x reading only the rows of W^T whose input is active");
  m.def("mask_small", &mask_small, "zero the entries below a magnitude threshold, and count them");
}
