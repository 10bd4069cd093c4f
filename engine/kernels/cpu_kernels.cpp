// Tokenpath's CPU kernels, built by engine/cpu_kernels.py.
//
// int8_linear: int8 weights times int8 activations with int32 accumulation (the int8-dyn level). On
// CPUs with AVX-512 VNNI one instruction multiplies and sums 64 byte pairs; elsewhere a plain loop
// gives the same integers.
//
// sparse_gemv: activation-sparse matrix-vector product that reads only the weight rows of active
// inputs. w_t is the weight stored transposed, [in_features, out_features], so each input channel's
// weights are one contiguous row: an input below the threshold means its row is never loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

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

// Sum of a[k] * b[k] for unsigned a and signed b, exact in int32 for the widths used here.
static inline int32_t dot_u8s8(const uint8_t* a, const int8_t* b, int64_t n) {
  int64_t k = 0;
  int32_t sum = 0;
#ifdef __AVX512VNNI__
  __m512i acc = _mm512_setzero_si512();
  for (; k + 64 <= n; k += 64)
    acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(a + k), _mm512_loadu_si512(b + k));
  sum = _mm512_reduce_add_epi32(acc);
#endif
  for (; k < n; ++k) sum += static_cast<int32_t>(a[k]) * static_cast<int32_t>(b[k]);
  return sum;
}

// y = x w^T for x [M, K] float32 and w [N, K] int8 with one scale per output row (w_scale) and the
// sum of each row's integers (w_sum). Each row of x is quantized here, symmetric:
// s = max|x| / 127, q = round(x / s) in [-127, 127], stored as q + 128 so that it is unsigned; the
// 128 * w_sum[n] this adds to every dot product is taken back out. Output threads take shares of
// the weight rows, so every weight row is read once whatever M is.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor w_sum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kChar, "w must be contiguous int8");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat && w_sum.scalar_type() == torch::kInt,
              "w_scale must be float32 and w_sum int32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && w_scale.numel() == N && w_sum.numel() == N, "shapes disagree");
  const float* xp = x.data_ptr<float>();
  std::vector<uint8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    xs[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::min(std::max(std::nearbyint(row[k] / s), -127.f), 127.f);
      xq[m * K + k] = static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
    }
  }
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = w_scale.data_ptr<float>();
  const int32_t* cp = w_sum.data_ptr<int32_t>();
  at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* wr = wp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const int32_t acc = dot_u8s8(xq.data() + m * K, wr, K) - 128 * cp[n];
        yp[m * N + n] = static_cast<float>(acc) * xs[m] * sp[n];
      }
    }
  });
  return y;
}

// Dot products of R weight rows with MC rows of x, each y[m][n] summed in the same order whatever
// M is (16 lanes, then the lanes added in a fixed order): a row's result does not depend on how
// many rows share the call, so verifying drafts gives the logits a one-row step gives.
#ifdef __AVX512F__
template <int R, int MC>
static inline void dot_block(const float* const* w, const float* x, int64_t K, float* y, int64_t N) {
  __m512 acc[R][MC];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w[r] + k);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail, w[r] + k);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MC; ++m) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int R>
static inline void dot_rows(const float* const* w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_block<R, 4>(w, x + m * K, K, y + m * N, N);
  switch (M - m) {
    case 3: dot_block<R, 3>(w, x + m * K, K, y + m * N, N); break;
    case 2: dot_block<R, 2>(w, x + m * K, K, y + m * N, N); break;
    case 1: dot_block<R, 1>(w, x + m * K, K, y + m * N, N); break;
  }
}

#endif

// y = x w^T (+ bias) for the few rows of a decode or verification step: x [M, K], w [N, K], float32.
// Threads take shares of the weight rows and each weight row is read from memory once for all M rows
// of x. With AVX-512 the rows go four at a time (on a 2-core AVX-512 machine, 5 rows took 1.5x the
// one-row time, MKL 1.8x; 9 rows 1.6x, MKL 2.4x); elsewhere one at a time through dot_lanes, which
// the compiler vectorizes for the CPU at hand. Either way a row's sums run in an order that does not
// depend on M.
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "small_linear takes float32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous 2-D tensor");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "x and w disagree on the input width");
  x = x.contiguous();
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX512F__
  constexpr int R = 4;
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * R;
      if (n + R <= N) {
        const float* rows[R] = {wp + n * K, wp + (n + 1) * K, wp + (n + 2) * K, wp + (n + 3) * K};
        dot_rows<R>(rows, xp, M, K, yp + n, N);
      } else {
        for (int64_t j = n; j < N; ++j) {
          const float* rows[1] = {wp + j * K};
          dot_rows<1>(rows, xp, M, K, yp + j, N);
        }
      }
    }
  });
#else
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_lanes(xp + m * K, wp + n * K, K);
  });
#endif
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

bool has_avx512() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// RMSNorm of each row of x (float32, last dimension contiguous): w * (x / sqrt(mean(x^2) + eps)),
// the products in the same order as transformers' LlamaRMSNorm. One small loop: the operations
// PyTorch would chain for it each cost several microseconds on a decode step, whose caches the
// weight stream has just flushed.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "rms_norm takes float32");
  x = x.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "the weight's width differs from x's");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * H;
    double squares = 0.0;
    for (int64_t k = 0; k < H; ++k) squares += static_cast<double>(row[k]) * row[k];
    const float scale = 1.f / std::sqrt(static_cast<float>(squares / H) + static_cast<float>(eps));
    for (int64_t k = 0; k < H; ++k) op[r * H + k] = wp[k] * (row[k] * scale);
  }
  return out;
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
  const int64_t B = x.size(0), L = x.size(1), width = x.size(2), half = D / 2;
  TORCH_CHECK(width >= heads * D && cos.size(-1) == D && cos.numel() == B * L * D, "rotary: shapes disagree");
  auto out = torch::empty({B, heads, L, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const float* c = cp + (b * L + l) * D;
      const float* s = sp + (b * L + l) * D;
      for (int64_t h = 0; h < heads; ++h) {
        const float* v = xp + (b * L + l) * width + h * D;
        float* o = op + ((b * heads + h) * L + l) * D;
        for (int64_t d = 0; d < half; ++d) {
          const float rotated = -v[d + half];
          o[d] = v[d] * c[d] + rotated * s[d];
        }
        for (int64_t d = half; d < D; ++d) o[d] = v[d] * c[d] + v[d - half] * s[d];
      }
    }
  return out;
}

// silu(gate) * up for x [..., 2 * I] holding gate then up (a fused gate/up projection's output).
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "silu_mul takes float32");
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = xp + r * 2 * I;
    const float* up = gate + I;
    for (int64_t k = 0; k < I; ++k) op[r * I + k] = gate[k] / (1.f + std::exp(-gate[k])) * up[k];
  }
  return out;
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / KV;
  const float s = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (T * D));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(T));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* qh = qp + bh * D;
      const float* kh = kp + (b * KV + h / group) * T * D;
      const float* vh = vp + (b * KV + h / group) * T * D;
      float top = -INFINITY;
      for (int64_t t = 0; t < T; ++t) {
        w[t] = dot_lanes(qh, kh + t * D, D) * s;
        top = std::max(top, w[t]);
      }
      float total = 0.f;
      for (int64_t t = 0; t < T; ++t) {
        w[t] = std::exp(w[t] - top);
        total += w[t];
      }
      float* o = op + bh * D;
      std::fill(o, o + D, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float p = w[t] / total;
        const float* vt = vh + t * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * vt[d];
      }
    }
  });
  return out;
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
  m.def("has_avx512", &has_avx512, "whether small_linear was built with AVX-512 instructions");
  m.def("has_vnni", &has_vnni, "whether int8_linear was built with AVX-512 VNNI instructions");
  m.def("sparse_gemv", &sparse_gemv, "y = W x reading only the rows of W^T whose input is active");
  m.def("mask_small", &mask_small, "zero the entries below a magnitude threshold, and count them");
}
