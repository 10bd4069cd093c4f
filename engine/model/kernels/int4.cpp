// int4_dyn_linear, the int4-dyn level: 4-bit weights in blocks of 32 along the input, each block with
// an fp16 scale d and minimum m (w = q * d + m, q in 0..15: the format of llama.cpp's Q4_1), times
// activations quantized to int8 per block of 32 at run time (x = xq * dx). Per block the product is
// d * dx * sum(q * xq) + m * dx * sum(xq): the first sum is exact in integers, the second is the
// activations' own. The weights of a block are 16 bytes, byte j holding q[j] in its low half and
// q[j + 16] in its high half.
#include "kernels.h"

namespace tokenpath {

// One row of packed weights (wr, with its blocks' d and m) against R rows of activations quantized per
// block (row r: xq + r * K, dx and dsum + r * KB): for each, the sum over blocks of
// d * dx * sum(q * xq) + m * dx * sum(xq), written to y[r * y_stride]. Each block is unpacked once for
// all R rows, whose accumulators stay in registers (R is known when compiling); every row's own
// operations and their order are those of a lone row, so a row's result does not depend on how many
// share the weights.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// Rows of activations past each weight row at once.
constexpr int kInt4Rows = kRowsAtOnce;

template <int R>
static inline void int4_rows_dot(const uint8_t* wr, const at::Half* d, const at::Half* m, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t blocks, int64_t K, float* y,
                                 int64_t y_stride) {
  const int64_t KB = blocks;
  // A block's 16 bytes go to both halves of a register, the upper half shifted down by four bits:
  // masked, that is q[0..15] then q[16..31], in the order of the activations. sum_u8s8 multiplies
  // those unsigned bytes by the signed activations; the scales of eight blocks are multiplied in one
  // go (scaled_block_sums), and the minimums' part comes after, eight blocks at a time.
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0);
  float dots[R];
  scaled_block_sums<R>(
      d, dx, blocks,
      [&](int64_t b) {
        const auto* raw = reinterpret_cast<const __m128i*>(wr + b * kBlock / 2);
        return _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128(raw)), shift), low);
      },
      [&](__m256i q, int r, int64_t b) {
        return sum_u8s8(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock)));
      },
      dots);
  for (int r = 0; r < R; ++r) {
    __m256 mins = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8)
      mins = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b))),
                             _mm256_loadu_ps(dsum + r * KB + b), mins);
    float total = hsum8(mins);
    for (; b < blocks; ++b) total += _cvtsh_ss(m[b].x) * dsum[r * KB + b];
    y[r * y_stride] = dots[r] + total;
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Without VNNI the byte products come from maddubs (pairs of them summed in 16 bits), which on some CPUs
// (AMD's first Zen cores among them) runs on one port and bounds the kernel once several rows share the
// weights: everything after it is kept small. Each block's 32 products are summed exactly in integers (16
// of them fit 16 bits: 16 * 15 * 127 < 2^15), four blocks' sums side by side in one register, so the floats
// take one multiply-add for four blocks of a row instead of eight lanes per block: lane j of a row's
// accumulator takes d * dx * sum(q * xq), then m * dx * sum(xq), of blocks 4i + j, and the four lanes are
// added at the end. 16-byte registers: on such CPUs a 32-byte operation costs two.
constexpr int kInt4Rows = 8;

template <int R>
static inline void int4_rows_dot(const uint8_t* wr, const at::Half* d, const at::Half* m, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t blocks, int64_t K, float* y,
                                 int64_t y_stride) {
  const int64_t KB = blocks;
  const __m128i low = _mm_set1_epi8(0xF), ones = _mm_set1_epi16(1);
  __m128 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  // blocks b .. b + NB - 1 (NB 1 to 4, known when compiling) into lanes 0 .. NB - 1 of every row's
  // accumulator; a missing block adds zero to its lane
  auto group = [&](auto blocks_here, int64_t b) {
    constexpr int NB = decltype(blocks_here)::value;
    __m128i qlo[NB], qhi[NB];  // q[0..15] and q[16..31] of each block, in the order of the activations
    for (int j = 0; j < NB; ++j) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + (b + j) * kBlock / 2));
      qlo[j] = _mm_and_si128(raw, low);
      qhi[j] = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
    }
    __m128 dw, mw;
    __m128i lanes = _mm_set1_epi32(-1);
    if constexpr (NB == 4) {
      dw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + b)));
      mw = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + b)));
    } else {
      alignas(16) float dv[4] = {0.f, 0.f, 0.f, 0.f}, mv[4] = {0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < NB; ++j) dv[j] = _cvtsh_ss(d[b + j].x), mv[j] = _cvtsh_ss(m[b + j].x);
      dw = _mm_load_ps(dv);
      mw = _mm_load_ps(mv);
      lanes = _mm_setr_epi32(-1, NB > 1 ? -1 : 0, NB > 2 ? -1 : 0, 0);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + b * kBlock;
      __m128i s[4];  // each block's products, two by two (maddubs), then its two halves' added
      for (int j = 0; j < 4; ++j) s[j] = _mm_setzero_si128();
      for (int j = 0; j < NB; ++j)
        s[j] = _mm_add_epi16(
            _mm_maddubs_epi16(qlo[j], _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j * kBlock))),
            _mm_maddubs_epi16(qhi[j], _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j * kBlock + 16))));
      // the four blocks' sums: 16-bit lanes added across blocks' pairs of registers until each block's
      // 32-bit lane holds two halves of 16 products, which madd adds exactly
      const __m128i v01 = _mm_add_epi16(_mm_unpacklo_epi32(s[0], s[1]), _mm_unpackhi_epi32(s[0], s[1]));
      const __m128i v23 = _mm_add_epi16(_mm_unpacklo_epi32(s[2], s[3]), _mm_unpackhi_epi32(s[2], s[3]));
      const __m128i sums =
          _mm_madd_epi16(_mm_add_epi16(_mm_unpacklo_epi64(v01, v23), _mm_unpackhi_epi64(v01, v23)), ones);
      __m128 xd, xs;
      if constexpr (NB == 4) {
        xd = _mm_loadu_ps(dx + r * KB + b);
        xs = _mm_loadu_ps(dsum + r * KB + b);
      } else {
        xd = _mm_maskload_ps(dx + r * KB + b, lanes);
        xs = _mm_maskload_ps(dsum + r * KB + b, lanes);
      }
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(dw, xd), acc[r]);
      acc[r] = _mm_fmadd_ps(mw, xs, acc[r]);
    }
  };
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) group(std::integral_constant<int, 4>{}, b);
  switch (blocks - b) {
    case 3: group(std::integral_constant<int, 3>{}, b); break;
    case 2: group(std::integral_constant<int, 2>{}, b); break;
    case 1: group(std::integral_constant<int, 1>{}, b); break;
    default: break;
  }
  for (int r = 0; r < R; ++r) {
    const __m128 a = _mm_add_ps(acc[r], _mm_movehl_ps(acc[r], acc[r]));
    y[r * y_stride] = _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
  }
}
#else
constexpr int kInt4Rows = kRowsAtOnce;

template <int R>
static inline void int4_rows_dot(const uint8_t* wr, const at::Half* d, const at::Half* m, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t blocks, int64_t K, float* y,
                                 int64_t y_stride) {
  const int64_t KB = blocks;
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = xq + r * K;
    float acc = 0.f, total = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* w = wr + b * kBlock / 2;
      const int8_t* x = xr + b * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock / 2; ++j)
        sum += static_cast<int32_t>(w[j] & 0xF) * x[j] + static_cast<int32_t>(w[j] >> 4) * x[j + kBlock / 2];
      acc += static_cast<float>(sum) * (half_to_float(d[b]) * dx[r * KB + b]);
      total += half_to_float(m[b]) * dsum[r * KB + b];
    }
    y[r * y_stride] = acc + total;
  }
}
#endif

// y = x w^T for x [M, K] float32 and the packed weights w [N, K / 2] uint8 with d and m [N, K / 32]
// fp16. Threads take shares of the weight rows; the activation rows go in groups past each.
void int4_dyn_rows(const float* xp, int64_t M, const uint8_t* wp, const at::Half* dp, const at::Half* mp,
                          int64_t N, int64_t K, float* yp) {
  const int64_t KB = K / kBlock;
  const BlockActivations a(xp, M, K);
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      in_row_groups<kInt4Rows>(M, [&](auto rows, int64_t r) {
        int4_rows_dot<decltype(rows)::value>(wp + n * (K / 2), dp + n * KB, mp + n * KB, a.q.data() + r * K,
                                             a.d.data() + r * KB, a.dsum.data() + r * KB, KB, K, yp + r * N + n, N);
      });
  });
}

at::Tensor int4_dyn_linear(at::Tensor x, at::Tensor w, at::Tensor d, at::Tensor m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), KB = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(1) * 2 == K,
              "w must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == N * KB && m.numel() == N * KB, "d and m: fp16 [N, K / 32]");
  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  int4_dyn_rows(x.data_ptr<float>(), M, w.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(), N, K,
                y.data_ptr<float>());
  return y;
}

}  // namespace tokenpath
