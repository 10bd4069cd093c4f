// int4_dyn_linear, the int4-dyn level: 4-bit weights in blocks of 32 along the input, each block with
// an fp16 scale d and minimum m (w = q * d + m, q in 0..15: the format of llama.cpp's Q4_1), times
// activations quantized to int8 per block of 32 at run time (x = xq * dx). Per block the product is
// d * dx * sum(q * xq) + m * dx * sum(xq): the first sum is exact in integers, the second is the
// activations' own. The weights of a block are 16 bytes, byte j holding q[j] in its low half and
// q[j + 16] in its high half.
#include "kernels.h"

namespace tokenpath {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__FMA__) && defined(__F16C__)
// The activations come interleaved (kGroupBlocks blocks at a time) and the weights of each group are
// rearranged to match in registers: a group's eight block sums end in one register, one lane a block,
// so its conversion to floats and its scales take one instruction each for eight blocks instead of eight.
#define INT4_GROUPS 1
constexpr bool kInterleaved = true;
#else
constexpr bool kInterleaved = false;
#endif

#if defined(INT4_GROUPS)
// Row r's sum over the whole groups of blocks of one weight row, added to acc[r]: for each group, its 128
// bytes of weights (block j's dword s, bytes 4s .. 4s + 3, holding values 4s .. 4s + 3 in their low halves
// and 16 + 4s .. 19 + 4s in their high halves) permuted so that dword s of every block sits side by side
// as the interleaved activations have them, unpacked once for all R rows; per row, four multiply-and-sums
// of 64 byte pairs leave each block's exact integer sum in two lanes, added into lane j for block j, then
// converted and multiplied by the eight blocks' d * dx. Each row's operations are those of a lone row.
template <int R>
static inline void int4_group_sums(const uint8_t* wr, const at::Half* d, const int8_t* xq, const float* dx,
                                   int64_t groups, int64_t K, int64_t KB, __m256* acc) {
  // dword (j, s) of the group's two 64-byte halves is at 4j + s: steps 0 and 1, then steps 2 and 3
  const __m512i steps01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i steps23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const __m512i low = _mm512_set1_epi8(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = wr + g * kGroupBlocks * kBlock / 2;
    const __m512i a = _mm512_loadu_si512(wg), b = _mm512_loadu_si512(wg + 64);
    const __m512i w01 = _mm512_permutex2var_epi32(a, steps01, b), w23 = _mm512_permutex2var_epi32(a, steps23, b);
    const __m512i q01 = _mm512_and_si512(w01, low), q23 = _mm512_and_si512(w23, low);
    const __m512i q45 = _mm512_and_si512(_mm512_srli_epi16(w01, 4), low);
    const __m512i q67 = _mm512_and_si512(_mm512_srli_epi16(w23, 4), low);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kGroupBlocks)));
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xq + r * K + g * kGroupBlocks * kBlock;
      __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q01, _mm512_loadu_si512(x));
      sums = _mm512_dpbusd_epi32(sums, q23, _mm512_loadu_si512(x + 64));
      sums = _mm512_dpbusd_epi32(sums, q45, _mm512_loadu_si512(x + 128));
      sums = _mm512_dpbusd_epi32(sums, q67, _mm512_loadu_si512(x + 192));
      const __m256i blocks = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * KB + g * kGroupBlocks));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), scale, acc[r]);
    }
  }
}
#endif

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
  // those unsigned bytes by the signed activations (with AVX-512 only for the blocks after the whole
  // groups, which int4_group_sums takes); the scales of eight blocks are multiplied in one go
  // (scaled_block_sums), and the minimums' part comes after, eight blocks at a time.
  const __m256i low = _mm256_set1_epi8(0xF);
  const __m256i shift = _mm256_set_epi64x(4, 4, 0, 0);
  auto unpacked = [&](int64_t b) {
    const auto* raw = reinterpret_cast<const __m128i*>(wr + b * kBlock / 2);
    return _mm256_and_si256(_mm256_srlv_epi64(_mm256_broadcastsi128_si256(_mm_loadu_si128(raw)), shift), low);
  };
  auto ints = [&](__m256i q, int r, int64_t b) {
    return sum_u8s8(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + b * kBlock)));
  };
  float dots[R];
#if defined(INT4_GROUPS)
  const auto groups = [&](__m256* acc) { int4_group_sums<R>(wr, d, xq, dx, blocks / kGroupBlocks, K, KB, acc); };
  grouped_block_sums<R>(d, dx, blocks, groups, unpacked, ints, dots);
#else
  scaled_block_sums<R>(d, dx, blocks, unpacked, ints, dots);
#endif
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
  const BlockActivations a(xp, M, K, kInterleaved);
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
