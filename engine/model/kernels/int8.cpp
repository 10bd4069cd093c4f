// The int8 products: int8_linear (int8 weights and activations with int32 sums, the int8-dyn level; with
// AVX-512 VNNI one instruction multiplies and sums 64 byte pairs, with AVX2 a few multiply 32, elsewhere a
// plain loop gives the same integers), int8_wo_linear (int8 weights, float activations) and
// int8_block_linear (llama.cpp's Q8_0 layout), and has_vnni.
#include "kernels.h"

namespace tokenpath {


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
void int8_dyn_rows(const float* xp, int64_t M, const int8_t* wp, const float* sp, const int32_t* cp,
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

at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar, "w must be contiguous int8");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt,
              "w_scale must be float32 and w_sum int32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && w_scale.numel() == N && w_sum.numel() == N, "shapes disagree");
  auto y = x.new_empty({M, N});
  int8_dyn_rows(x.data_ptr<float>(), M, w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(),
                N, K, y.data_ptr<float>());
  return y;
}


// Up to this many rows of x the int8 weight-only product reads the weights row by row (a decode or
// verification step); more rows (a prefill) expand the weights once and multiply in MKL.
constexpr int64_t kFewRows = 24;

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
void int8_wo_rows(const float* xp, int64_t M, const int8_t* wp, const uint16_t* sp, int64_t N, int64_t K,
                         float* yp) {
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float scale = bf16_to_float(sp[n]);
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_int8(wp + n * K, xp + m * K, K) * scale;
    }
  });
}

at::Tensor int8_wo_linear(at::Tensor x, at::Tensor w, at::Tensor scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == w.size(0), "scales: one bfloat16 per row");
  x = x.contiguous();
  scales = scales.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on the input width");
  const int8_t* wp = w.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  if (M > kFewRows) {
    auto expanded = x.new_empty({N, K});
    float* ep = expanded.data_ptr<float>();
    at::parallel_for(0, N, N * K * 4 >= kParallelBytes ? 16 : N, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const float scale = bf16_to_float(sp[n]);
        for (int64_t k = 0; k < K; ++k) ep[n * K + k] = static_cast<float>(wp[n * K + k]) * scale;
      }
    });
    return x.matmul(expanded.t());
  }
  auto y = x.new_empty({M, N});
  int8_wo_rows(x.data_ptr<float>(), M, wp, sp, N, K, y.data_ptr<float>());
  return y;
}


// int8 weights in blocks of 32 along the input with an fp16 scale d each (w = q * d, q in
// [-127, 127]: the layout of llama.cpp's Q8_0), times activations quantized per block as above:
// sum over blocks of d * dx * sum(q * xq), each block's sum exact in integers. One weight row against
// R rows of activations (row r: xq + r * K, dx + r * blocks), written to y[r * y_stride]: each weight block
// is read once for all R rows, and every row's operations and their order are those of a lone row.
template <int R>
static inline void int8_block_rows_dot(const int8_t* wr, const at::Half* d, const int8_t* xq, const float* dx,
                                       int64_t blocks, int64_t K, float* y, int64_t y_stride) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  auto load = [&](int64_t r, int64_t b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock));
  };
  // |w| times x with w's sign, as dot_s8s8 does: no pair sum saturates
  auto weight = [&](int64_t b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kBlock));
    return std::pair{w, _mm256_abs_epi8(w)};
  };
  auto ints = [&](const std::pair<__m256i, __m256i>& w, int r, int64_t b) {
    return sum_u8s8(w.second, _mm256_sign_epi8(load(r, b), w.first));
  };
  float dots[R];
  scaled_block_sums<R>(d, dx, blocks, weight, ints, dots);
  for (int r = 0; r < R; ++r) y[r * y_stride] = dots[r];
#else
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xq + r * K;
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum = 0;
      for (int64_t k = 0; k < kBlock; ++k) sum += static_cast<int32_t>(wr[b * kBlock + k]) * xr[b * kBlock + k];
      acc += static_cast<float>(sum) * (half_to_float(d[b]) * dx[r * blocks + b]);
    }
    y[r * y_stride] = acc;
  }
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512DQ__) && defined(__F16C__)
#define HAVE_INT8_BLOCK_PAIRS 1
// The activations as the 512-bit path reads them, made once for all the weight rows: each byte made unsigned
// (xq + 128) for VNNI, and each pair of blocks' scales spread over a register (eight lanes each, zeros beside a
// lone last block).
struct PairedActivations {
  int64_t pairs;
  std::vector<uint8_t> u;
  std::vector<__m512> scales;
  PairedActivations(const BlockActivations& a, int64_t M, int64_t K)
      : pairs((K / kBlock + 1) / 2), u(a.q.size()), scales(static_cast<size_t>(M * pairs)) {
    const int64_t blocks = K / kBlock;
    for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(a.q[i] ^ 0x80);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t p = 0; p < pairs; ++p) {
        const float* dx = a.d.data() + r * blocks + 2 * p;
        scales[r * pairs + p] =
            _mm512_insertf32x8(_mm512_set1_ps(dx[0]), _mm256_set1_ps(2 * p + 1 < blocks ? dx[1] : 0.f), 1);
      }
  }
};

constexpr int64_t kPairsAhead = 1024;  // bytes ahead that the weights are fetched

// int8_block_rows_dot with two blocks a register: lanes 0-7 hold the even block's eight lane sums and lanes 8-15
// the odd one's, which are scaled_block_sums' two accumulators side by side, with the same operations in the same
// order, so the AVX2 build's sums are these to the bit. The 128 * sum(w) that the unsigned activations add is
// taken back out.
template <int R>
static inline void int8_block_pairs_dot(const int8_t* wr, const at::Half* d, const uint8_t* xu, const __m512* scales,
                                        int64_t blocks, int64_t K, float* y, int64_t y_stride) {
  const int64_t pairs = (blocks + 1) / 2;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b = 2 * p;
    const bool both = b + 1 < blocks;
    auto bytes = [&](const void* at) {  // both blocks, or the last one alone with zeros beside it
      return both ? _mm512_loadu_si512(at)
                  : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    };
    // the weights are one stream, row after row, whose loads otherwise wait on memory
    _mm_prefetch(reinterpret_cast<const char*>(wr + b * kBlock + kPairsAhead), _MM_HINT_T0);
    const __m512i w = bytes(wr + b * kBlock);
    const __m512i back = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, w));
    const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(d[b])),
                                         _mm256_set1_ps(both ? half_to_float(d[b + 1]) : 0.f), 1);
    for (int r = 0; r < R; ++r) {
      const __m512i ints = _mm512_dpbusd_epi32(back, bytes(xu + r * K + b * kBlock), w);
      acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(dw, scales[r * pairs + p]), acc[r],
                                     both ? 0xFFFF : 0x00FF);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r * y_stride] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1)));
}
#endif

void int8_block_rows(const float* xp, int64_t M, const int8_t* wp, const at::Half* dp, int64_t N, int64_t K,
                            float* yp) {
  const int64_t KB = K / kBlock;
  const BlockActivations a(xp, M, K);
#ifdef HAVE_INT8_BLOCK_PAIRS
  const PairedActivations paired(a, M, K);
#endif
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      in_row_groups(M, [&](auto rows, int64_t r) {
        constexpr int R = decltype(rows)::value;
#ifdef HAVE_INT8_BLOCK_PAIRS
        int8_block_pairs_dot<R>(wp + n * K, dp + n * KB, paired.u.data() + r * K,
                                paired.scales.data() + r * paired.pairs, KB, K, yp + r * N + n, N);
#else
        int8_block_rows_dot<R>(wp + n * K, dp + n * KB, a.q.data() + r * K, a.d.data() + r * KB, KB, K,
                               yp + r * N + n, N);
#endif
      });
  });
}

// y = x w^T for x [M, K] float32, w [N, K] int8 and d [N, K / 32] fp16; each row of y on its own.
at::Tensor int8_block_linear(at::Tensor x, at::Tensor w, at::Tensor d) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.is_contiguous() && w.dim() == 2 && w.size(1) == K,
              "w must be contiguous int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == N * (K / kBlock),
              "d: fp16 [N, K / 32]");
  x = x.contiguous();
  auto y = x.new_empty({M, N});
  int8_block_rows(x.data_ptr<float>(), M, w.data_ptr<int8_t>(), d.data_ptr<at::Half>(), N, K, y.data_ptr<float>());
  return y;
}

bool has_vnni() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

}  // namespace tokenpath
