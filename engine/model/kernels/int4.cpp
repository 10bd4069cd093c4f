// int4_dyn_linear, the int4-dyn level: 4-bit weights in blocks of 32 along the input, each block with
// an fp16 scale d and minimum m (w = q * d + m, q in 0..15: the arithmetic of llama.cpp's Q4_1), times
// activations quantized to int8 per block of 32 at run time (x = xq * dx). Per block the product is
// d * dx * sum(q * xq) + m * dx * sum(xq): the first sum is exact in integers, the second is the
// activations' own.
//
// The weights are stored for the products of several activation rows: output rows in groups of eight
// (the last group padded with zero rows), a group's blocks one after another, 128 bytes a block. Those
// are four runs of 32 bytes; in run k, row i's four bytes (at 4 * i) hold q[4k .. 4k + 3] in their low
// halves and q[16 + 4k .. 16 + 4k + 3] in their high halves. A group's d (and m) of a block are its
// eight rows' values side by side. So one register holds a run for the eight rows, and a dot product
// of its low (or high) halves with four activation bytes copied to every lane adds four products to
// each of the eight rows' sums: the integers need no shuffling, and the floats after them take one
// multiply-add a block for eight output rows.
#include "kernels.h"

namespace tokenpath {

constexpr int64_t kGroupBlock = kGroup * kBlock / 2;  // bytes of a group's block

// One group of weight rows (wg, with its blocks' d and m) against R rows of activations quantized per
// block (row r's block b at row_block<R>(b, r) of xq, dx and dsum): for each activation row and output row i, the
// sum over blocks of d * dx * sum(q * xq) + m * dx * sum(xq), written to y[r * y_stride + i] for the group's first
// `outputs` rows. Each run of a block is unpacked once for all R rows; every row's own operations and their
// order are those of a lone row, so a row's result does not depend on how many share the weights.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int R>
static inline void int4_group_dot(const uint8_t* wg, const at::Half* dg, const at::Half* mg, const int8_t* xq,
                                  const float* dx, const float* dsum, int64_t KB, float* y,
                                  int64_t y_stride, int64_t outputs) {
  const __m256i low = _mm256_set1_epi8(0xF);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    // the R rows' integer sums side by side, two chains each (the low halves' and the high halves'), a run
    // of the block unpacked at a time
    __m256i lows[R], highs[R];
    for (int r = 0; r < R; ++r) lows[r] = highs[r] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * kGroupBlock + k * 32));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + row_block<R>(b, r) * kBlock;
        lows[r] = add_u8s8(lows[r], lo, _mm256_set1_epi32(four_bytes(x + 4 * k)));
        highs[r] = add_u8s8(highs[r], hi, _mm256_set1_epi32(four_bytes(x + kBlock / 2 + 4 * k)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * kGroup)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + b * kGroup)));
    for (int r = 0; r < R; ++r) {
      const __m256i sums = _mm256_add_epi32(lows[r], highs[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(dx[row_block<R>(b, r)])),
                               acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dsum[row_block<R>(b, r)]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (outputs == kGroup) {
      _mm256_storeu_ps(y + r * y_stride, acc[r]);
    } else {
      alignas(32) float out[kGroup];
      _mm256_store_ps(out, acc[r]);
      std::memcpy(y + r * y_stride, out, sizeof(float) * outputs);
    }
  }
}
#else
template <int R>
static inline void int4_group_dot(const uint8_t* wg, const at::Half* dg, const at::Half* mg, const int8_t* xq,
                                  const float* dx, const float* dsum, int64_t KB, float* y,
                                  int64_t y_stride, int64_t outputs) {
  for (int r = 0; r < R; ++r) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < KB; ++b) {
      const int8_t* x = xq + row_block<R>(b, r) * kBlock;
      for (int64_t i = 0; i < kGroup; ++i) {
        int32_t sum = 0;
        for (int64_t k = 0; k < 4; ++k)
          for (int64_t e = 0; e < 4; ++e) {
            const uint8_t w = wg[b * kGroupBlock + k * 32 + i * 4 + e];
            sum += static_cast<int32_t>(w & 0xF) * x[4 * k + e] + static_cast<int32_t>(w >> 4) * x[kBlock / 2 + 4 * k + e];
          }
        acc[i] += static_cast<float>(sum) * (half_to_float(dg[b * kGroup + i]) * dx[row_block<R>(b, r)]);
        acc[i] += half_to_float(mg[b * kGroup + i]) * dsum[row_block<R>(b, r)];
      }
    }
    std::memcpy(y + r * y_stride, acc, sizeof(float) * outputs);
  }
}
#endif

#ifdef HAVE_GROUP_PAIRS
// With AVX-512, groups two at a time: a 512-bit register holds a run of both (the second group's blocks follow
// the first's), so each instruction serves sixteen output rows, which pays where the cores have 512-bit units
// (and costs nothing where they split the instructions in two). The integers, and each (row, output)'s float
// operations in their order, are int4_group_dot's: a result does not depend on which of the two computed it.
constexpr int64_t kAhead = 8;  // blocks ahead that a pair's weights are fetched

template <int R>
static inline void int4_pair_dot(const uint8_t* wg, const at::Half* dg, const at::Half* mg, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t KB, float* y, int64_t y_stride,
                                 int64_t outputs) {
  const __m512i low = _mm512_set1_epi8(0xF);
  const uint8_t* wg1 = wg + KB * kGroupBlock;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_pair_block(wg, b + kAhead, KB, kGroupBlock);
    __m512i sums[R];  // a row's low and high halves in one chain: no add a block, and the R chains fill the units
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * kGroupBlock + k * 32));
      const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg1 + b * kGroupBlock + k * 32));
      const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + row_block<R>(b, r) * kBlock;
        sums[r] = _mm512_dpbusd_epi32(sums[r], lo, _mm512_set1_epi32(four_bytes(x + 4 * k)));
        sums[r] = _mm512_dpbusd_epi32(sums[r], hi, _mm512_set1_epi32(four_bytes(x + kBlock / 2 + 4 * k)));
      }
    }
    const __m512 d = two_groups_values(dg, b, KB), m = two_groups_values(mg, b, KB);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[row_block<R>(b, r)])),
                               acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dsum[row_block<R>(b, r)]), acc[r]);
    }
  }
  const __mmask16 kept = static_cast<__mmask16>((1u << outputs) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, kept, acc[r]);
}
#endif

// y = x w^T for the rows of activations x quantized in a (BlockActivations) and N output rows stored as above:
// w [ceil(N / 8), K / 32 * 128] uint8, d and m [ceil(N / 8), K / 32, 8] fp16, the activation rows in groups past each
// group of weights (past_groups).
void int4_dyn_rows(const BlockActivations& a, const uint8_t* wp, const at::Half* dp, const at::Half* mp, int64_t N,
                   float* yp) {
  const int64_t K = a.K, KB = K / kBlock, groups = (N + kGroup - 1) / kGroup;
  past_groups(groups, K, a.M, [&](auto rows, int64_t g, int64_t r) {
    constexpr int R = decltype(rows)::value;
    const uint8_t* wg = wp + g * KB * kGroupBlock;
    const at::Half *dg = dp + g * KB * kGroup, *mg = mp + g * KB * kGroup;
    const int8_t* xq = a.q.get() + r * K;
    const float *dx = a.d.get() + r * KB, *dsum = a.dsum.get() + r * KB;
#ifdef HAVE_GROUP_PAIRS
    if (g + 1 < groups)
      return int4_pair_dot<R>(wg, dg, mg, xq, dx, dsum, KB, yp + r * N + g * kGroup, N,
                              std::min(2 * kGroup, N - g * kGroup));
#endif
    int4_group_dot<R>(wg, dg, mg, xq, dx, dsum, KB, yp + r * N + g * kGroup, N, std::min(kGroup, N - g * kGroup));
  });
}

at::Tensor int4_dyn_linear(at::Tensor x, at::Tensor w, at::Tensor d, at::Tensor m, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock, groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(N > 0 && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == groups &&
              w.size(1) == KB * kGroupBlock, "w must be contiguous uint8 [ceil(N / 8), K / 32 * 128]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == groups * KB * kGroup && m.numel() == groups * KB * kGroup,
              "d and m: fp16 [ceil(N / 8), K / 32, 8]");
  x = x.contiguous();
  auto y = x.new_empty({M, N});
  int4_dyn_rows(BlockActivations(x.data_ptr<float>(), M, K), w.data_ptr<uint8_t>(), d.data_ptr<at::Half>(),
                m.data_ptr<at::Half>(), N, y.data_ptr<float>());
  return y;
}

}  // namespace tokenpath
