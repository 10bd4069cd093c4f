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
template <int R>
static inline void int4_rows_dot(const uint8_t* wr, const at::Half* d, const at::Half* m, const int8_t* xq,
                                 const float* dx, const float* dsum, int64_t blocks, int64_t K, float* y,
                                 int64_t y_stride) {
  const int64_t KB = blocks;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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
#else
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
#endif
}

// y = x w^T for x [M, K] float32 and the packed weights w [N, K / 2] uint8 with d and m [N, K / 32]
// fp16. Threads take shares of the weight rows; the activation rows go in groups past each.
void int4_dyn_rows(const float* xp, int64_t M, const uint8_t* wp, const at::Half* dp, const at::Half* mp,
                          int64_t N, int64_t K, float* yp) {
  const int64_t KB = K / kBlock;
  const BlockActivations a(xp, M, K);
  shared_rows(N, K * 4, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      in_row_groups(M, [&](auto rows, int64_t r) {
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
