// The int8 products: int8_linear (int8 weights and activations with int32 sums, the int8-dyn level, its weights
// packed in blocks of 16 outputs; several rows on AMX tiles where the CPU has them (amx.cpp), else with AVX-512 VNNI
// one instruction adds 16 outputs' sums of four byte pairs, with AVX2 a few add 8, elsewhere a plain loop gives the
// same integers), int8_wo_linear (int8 weights, float activations) and int8_block_linear (llama.cpp's Q8_0
// arithmetic, rows stored in groups), and has_vnni.
#include <memory>

#include "kernels.h"

namespace tokenpath {


// int8-dyn's weights as the kernels read them, "packed": for each block of kOutBlock outputs and each four inputs,
// the block's four bytes of each output side by side, a 64-byte row ([ceil(N / 16), Kp / 4, 64], Kp the input width
// rounded up to kDepthBytes, zeros where outputs or inputs run past the matrix). A row is what a vector of 16 int32
// sums takes with four activation bytes broadcast to all lanes, and 16 rows are the right-hand tile of an AMX
// multiply: every path streams the weights front to back, and none sums across lanes.
static inline const int8_t* packed_row(const int8_t* wp, int64_t Kp, int64_t block, int64_t k) {
  return wp + block * kOutBlock * Kp + k * 4 * kOutBlock;
}

// s = max|x| / 127, q = round(x / s) in [-127, 127] for the K values of x; q's Kp - K bytes past them are zero.
static float quantize_symmetric(const float* x, int64_t K, int64_t Kp, int8_t* q) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 top = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), top);  // a NaN skipped
  amax = _mm512_reduce_max_ps(top);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  k = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(s), low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
  for (; k + 16 <= K; k += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), scale),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(rounded, low), high);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
  }
#endif
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[k] / s), -127.f), 127.f));
  std::memset(q + K, 0, static_cast<size_t>(Kp - K));
  return s;
}

// y[n] = float(sums[i]) * xs * sp[n] for the block's outputs n = n0 + i below N.
static inline void scale_block(const int32_t* sums, float xs, const float* sp, int64_t n0, int64_t N, float* y) {
  for (int64_t i = 0; i < std::min(kOutBlock, N - n0); ++i) y[n0 + i] = static_cast<float>(sums[i]) * xs * sp[n0 + i];
}

// Blocks read side by side by packed_blocks.
constexpr int64_t kSideBlocks = 4;

#if defined(__AVX512VNNI__)
// sums += the dot products of a's unsigned and w's signed bytes, four to a lane, in place: GCC's intrinsic left
// chains of sums to be copied between registers, or to the stack and back, on every step.
static inline void add_dot_bytes(__m512i& sums, __m512i a, __m512i w) {
  __asm__("vpdpbusd %[w], %[a], %[sums]" : [sums] "+v"(sums) : [a] "v"(a), [w] "vm"(w));
}

// Row x's sums against C blocks of packed weights from b0, less the 128 times each output's weight sum that the
// unsigned activations (q + 128) add, into sums[j].
template <int C>
static inline void side_block_sums(const int8_t* x, int64_t Kp, const int8_t* wp, const int32_t* cp, int64_t N,
                                   int64_t b0, int32_t (*sums)[kOutBlock]) {
  __m512i acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp / 4; ++k) {
    const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(four_bytes(x + 4 * k)), _mm512_set1_epi8(-128));
    for (int j = 0; j < C; ++j) add_dot_bytes(acc[j], a, _mm512_loadu_si512(packed_row(wp, Kp, b0 + j, k)));
  }
  for (int j = 0; j < C; ++j) {
    const int64_t n0 = (b0 + j) * kOutBlock;
    const __m512i offsets = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(outputs_below(n0, N), cp + n0), 7);
    _mm512_store_si512(sums[j], _mm512_sub_epi32(acc[j], offsets));
  }
}
#endif

// Blocks [begin, end) of packed weights against quantized rows xq [M, Kp], kSideBlocks blocks read side by side
// (a block's sums wait on each multiply-add before the next; several blocks' chains run at once).
static void packed_blocks(const int8_t* xq, const float* xs, int64_t M, int64_t Kp, const int8_t* wp,
                          const float* sp, const int32_t* cp, int64_t N, int64_t begin, int64_t end, float* yp) {
  alignas(64) int32_t sums[kSideBlocks][kOutBlock];
  for (int64_t b0 = begin; b0 < end; b0 += kSideBlocks) {
    const int64_t count = std::min(kSideBlocks, end - b0);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* x = xq + m * Kp;
#if defined(__AVX512VNNI__)
      static_assert(kSideBlocks == 4, "a case for each count of blocks");
      switch (count) {  // the count fixed at compile time keeps the sums in registers
        case 4: side_block_sums<4>(x, Kp, wp, cp, N, b0, sums); break;
        case 3: side_block_sums<3>(x, Kp, wp, cp, N, b0, sums); break;
        case 2: side_block_sums<2>(x, Kp, wp, cp, N, b0, sums); break;
        default: side_block_sums<1>(x, Kp, wp, cp, N, b0, sums);
      }
#elif defined(__AVX2__)
      // |w| times q with w's sign, so that no pair's sum saturates 16 bits; eight outputs a register
      __m256i acc[kSideBlocks][2];
      for (int64_t j = 0; j < count; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
      for (int64_t k = 0; k < Kp / 4; ++k) {
        const __m256i a = _mm256_set1_epi32(four_bytes(x + 4 * k));
        for (int64_t j = 0; j < count; ++j)
          for (int h = 0; h < 2; ++h) {
            const int8_t* row = packed_row(wp, Kp, b0 + j, k) + 32 * h;
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
            acc[j][h] = add_u8s8(acc[j][h], _mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
          }
      }
      for (int64_t j = 0; j < count; ++j)
        for (int h = 0; h < 2; ++h) _mm256_store_si256(reinterpret_cast<__m256i*>(sums[j] + 8 * h), acc[j][h]);
#else
      for (int64_t j = 0; j < count; ++j) {
        for (int64_t i = 0; i < kOutBlock; ++i) sums[j][i] = 0;
        for (int64_t k = 0; k < Kp / 4; ++k) {
          const int8_t* w = packed_row(wp, Kp, b0 + j, k);
          for (int64_t i = 0; i < kOutBlock; ++i)
            for (int64_t d = 0; d < 4; ++d) sums[j][i] += static_cast<int32_t>(x[4 * k + d]) * w[4 * i + d];
        }
      }
#endif
      for (int64_t j = 0; j < count; ++j) scale_block(sums[j], xs[m], sp, (b0 + j) * kOutBlock, N, yp + m * N);
    }
  }
}

#if defined(__AVX512F__)
// The block's outputs n0 + i below N of one activation row: float(sums[i]) * xs * sp[n0 + i], the operations of
// int8_dyn_rows in its order.
static inline __m512 scaled(const int32_t* sums, float xs, const float* sp, int64_t n0, __mmask16 inside) {
  const __m512 row = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums));
  return _mm512_mul_ps(_mm512_mul_ps(row, _mm512_set1_ps(xs)), _mm512_maskz_loadu_ps(inside, sp + n0));
}

// Activation rows [m, m + rows)'s sums against blocks b and next written to y (kernels.h).
// Every row is scaled before any SiLU is taken: one row's two exponentials wait on each other, sixteen rows' overlap.
void write_rows(const int32_t* sums, int64_t m, int64_t rows, int64_t b, int64_t next, bool gated, const float* xs,
                const float* sp, int64_t N, float* yp) {
  const int32_t* second = sums + kSumRows * kOutBlock;
  if (gated) {
    alignas(64) float both[kSumRows * 2 * kOutBlock];  // each row's 16 gate outputs, then its 16 up outputs
    for (int64_t j = 0; j < rows; ++j) {
      _mm512_store_ps(both + 2 * kOutBlock * j, scaled(sums + j * kOutBlock, xs[m + j], sp, b * kOutBlock, 0xffff));
      _mm512_store_ps(both + 2 * kOutBlock * j + kOutBlock,
                      scaled(second + j * kOutBlock, xs[m + j], sp, next * kOutBlock, 0xffff));
    }
    silu_mul_rows(both, rows, kOutBlock, yp + m * (N / 2) + b * kOutBlock, N / 2);
    return;
  }
  for (const int64_t n : {b, next}) {
    if (n * kOutBlock >= N) break;
    const __mmask16 inside = outputs_below(n * kOutBlock, N);
    const int32_t* block = n == b ? sums : second;
    for (int64_t j = 0; j < rows; ++j)
      _mm512_mask_storeu_ps(yp + (m + j) * N + n * kOutBlock, inside,
                            scaled(block + j * kOutBlock, xs[m + j], sp, n * kOutBlock, inside));
  }
}
#endif

#if defined(__AVX512VNNI__)
// R activation rows (unsigned bytes q + 128, Kp apart) against blocks b and next of the packed weights (next only
// where Two): each 64-byte weight row is loaded once for the R rows, whose 2R chains of sums run
// side by side. The sums, less the 128 times each output's weight sum that the unsigned bytes add, go to
// sums[block][row][output] as write_rows reads them.
template <int R, bool Two>
static void vnni_pair_sums(const uint8_t* xu, int64_t Kp, const int8_t* wp, const int32_t* cp, int64_t N,
                           int64_t b, int64_t next, int32_t* sums) {
  __m512i first_sums[R], second_sums[R];
  for (int r = 0; r < R; ++r) first_sums[r] = second_sums[r] = _mm512_setzero_si512();
  const int8_t* first_row = packed_row(wp, Kp, b, 0);
  const int8_t* second_row = packed_row(wp, Kp, Two ? next : b, 0);
  for (int64_t k = 0; k < Kp / 4; ++k) {
    const __m512i first = _mm512_loadu_si512(first_row + k * 4 * kOutBlock);
    const __m512i second = Two ? _mm512_loadu_si512(second_row + k * 4 * kOutBlock) : first;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(four_bytes(reinterpret_cast<const int8_t*>(xu + r * Kp + 4 * k)));
      add_dot_bytes(first_sums[r], a, first);
      if constexpr (Two) add_dot_bytes(second_sums[r], a, second);
    }
  }
  for (int h = 0; h < (Two ? 2 : 1); ++h) {
    const int64_t n0 = (h == 0 ? b : next) * kOutBlock;
    const __m512i offsets = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(outputs_below(n0, N), cp + n0), 7);
    for (int r = 0; r < R; ++r)
      _mm512_store_si512(sums + (h * kSumRows + r) * kOutBlock,
                         _mm512_sub_epi32(h == 0 ? first_sums[r] : second_sums[r], offsets));
  }
}

// Several rows with AVX-512 VNNI, as the tiles take them (amx.cpp): each pair of weight blocks (for a fused gate/up
// product, the gate's block p and the up's) against every group of up to 8 rows in turn, so the pair stays in the
// nearest cache and each load of a weight row serves 8 rows. xq's bytes are made unsigned here (q + 128).
static void vnni_rows(int8_t* xq, const float* xs, int64_t M, int64_t Kp, const int8_t* wp, const float* sp,
                      const int32_t* cp, int64_t N, float* yp, bool gated) {
  // a count of its own: the byte stores could alias M and Kp, whose addresses the lambdas below take, and reloading
  // them each byte kept the loop from being vectorized
  const int64_t bytes = M * Kp;
  for (int64_t i = 0; i < bytes; ++i) xq[i] = static_cast<int8_t>(xq[i] ^ 0x80);
  const uint8_t* xu = reinterpret_cast<const uint8_t*>(xq);
  const int64_t blocks = (N + kOutBlock - 1) / kOutBlock, half = N / 2 / kOutBlock;
  shared_rows(gated ? half : (blocks + 1) / 2, 2 * kOutBlock * Kp * M, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[2 * kSumRows * kOutBlock];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t b = gated ? p : 2 * p, next = gated ? p + half : b + 1;
      in_row_groups<8>(M, [&](auto rows, int64_t m) {
        constexpr int R = decltype(rows)::value;
        if (next < blocks)
          vnni_pair_sums<R, true>(xu + m * Kp, Kp, wp, cp, N, b, next, sums);
        else
          vnni_pair_sums<R, false>(xu + m * Kp, Kp, wp, cp, N, b, next, sums);
        write_rows(sums, m, R, b, next, gated, xs, sp, N, yp);
      });
    }
  });
}
#endif

// y = x w^T for x [M, K] float32 and packed int8 weights w (N outputs) with one scale per output (sp) and the sum
// of each output's integers (cp). Each row of x is quantized here, symmetric: s = max|x| / 127, q = round(x / s) in
// [-127, 127]. The sums of q times w are exact integers whichever path takes them (AMX tiles for several rows where
// the CPU has them, else AVX-512 VNNI, AVX2, or a plain loop), so y is the same to the bit on every path and for
// any count of rows beside a row. Threads take shares of the weight blocks, so every weight is read once whatever
// M is.
// inv_smooth (K factors, or null): x's rows are multiplied by them first (SmoothQuant's inverse, where no norm
// before the layer took it in), as PyTorch multiplies them. gated: w is a fused gate/up product's (its first N / 2
// outputs the gate's), and y [M, N / 2] = silu(gate) * up as silu_mul_rows makes it of the product's outputs.
void int8_dyn_rows(const float* xp, int64_t M, const int8_t* wp, const float* sp, const int32_t* cp, int64_t N,
                   int64_t K, float* yp, const float* inv_smooth, bool gated) {
  const int64_t Kp = packed_width(K);
  // rows on cache-line boundaries, as PyTorch's allocator puts the weights: a tile load of rows that straddle two
  // lines each takes several times as long. Not zeroed (a vector's would be, on this thread alone): each row is
  // written whole below.
  const std::unique_ptr<int8_t[]> storage(new int8_t[M * Kp + kDepthBytes]);
  int8_t* xq = storage.get() + (kDepthBytes - reinterpret_cast<uintptr_t>(storage.get()) % kDepthBytes) % kDepthBytes;
  std::vector<float> xs(static_cast<size_t>(M));
  over_rows(M, K, [&](int64_t begin, int64_t end) {
    std::vector<float> smoothed(inv_smooth ? K : 0);
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * K;
      if (inv_smooth) {
        for (int64_t k = 0; k < K; ++k) smoothed[k] = row[k] * inv_smooth[k];
        row = smoothed.data();
      }
      xs[m] = quantize_symmetric(row, K, Kp, xq + m * Kp);
    }
  });
  if (int8_tile_rows(xq, xs.data(), M, Kp, wp, sp, N, yp, gated)) return;
#if defined(__AVX512VNNI__)
  if (M > 1 && (!gated || N % (2 * kOutBlock) == 0)) return vnni_rows(xq, xs.data(), M, Kp, wp, sp, cp, N, yp, gated);
#endif
  std::vector<float> both(gated ? static_cast<size_t>(M * N) : 0);
  float* out = gated ? both.data() : yp;
  shared_rows((N + kOutBlock - 1) / kOutBlock, kOutBlock * Kp * M, [&](int64_t begin, int64_t end) {
    packed_blocks(xq, xs.data(), M, Kp, wp, sp, cp, N, begin, end, out);
  });
  if (gated)
    over_rows(M, N, [&](int64_t begin, int64_t end) {
      silu_mul_rows(out + begin * N, end - begin, N / 2, yp + begin * N / 2);
    });
}

static at::Tensor int8_product(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum,
                               c10::optional<at::Tensor> inv_smooth, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kChar && w.size(2) == 4 * kOutBlock,
              "w must be contiguous packed int8 [blocks, Kp / 4, 64]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_sum.scalar_type() == at::kInt,
              "w_scale must be float32 and w_sum int32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel();
  TORCH_CHECK(w.size(0) == (N + kOutBlock - 1) / kOutBlock && w.size(1) * 4 == packed_width(K) && w_sum.numel() == N,
              "shapes disagree");
  TORCH_CHECK(!gated || N % 2 == 0, "a fused gate/up product has an even count of outputs");
  const bool smooth = inv_smooth.has_value() && inv_smooth->defined();
  TORCH_CHECK(!smooth || (inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() &&
                          inv_smooth->numel() == K), "inv_smooth: K contiguous float32 factors");
  auto y = x.new_empty({M, gated ? N / 2 : N});
  int8_dyn_rows(x.data_ptr<float>(), M, w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(),
                N, K, y.data_ptr<float>(), smooth ? inv_smooth->data_ptr<float>() : nullptr, gated);
  return y;
}

at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum,
                       c10::optional<at::Tensor> inv_smooth) {
  return int8_product(x, w, w_scale, w_sum, inv_smooth, false);
}

at::Tensor int8_silu_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor w_sum,
                            c10::optional<at::Tensor> inv_smooth) {
  return int8_product(x, w, w_scale, w_sum, inv_smooth, true);
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
  shared_rows(N, K * 4 * M, [&](int64_t begin, int64_t end) {
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


// int8 weights in blocks of 32 along the input with an fp16 scale d each (w = q * d, q in [-127, 127]: the
// arithmetic of llama.cpp's Q8_0), times activations quantized per block as above: sum over blocks of
// d * dx * sum(q * xq), each block's sum exact in integers. The weights are stored as int4_dyn_linear's are
// (int4.cpp), for the products of several activation rows: output rows in groups of eight (the last group
// padded with zero rows), a group's blocks one after another, 256 bytes a block. Those are eight runs of 32
// bytes; in run k, row i's four bytes (at 4 * i) hold q[4k .. 4k + 3] + 128, unsigned. A group's d of a block
// are its eight rows' values side by side. So a dot product of a run with four activation bytes copied to every
// lane adds four products to each of the eight rows' sums, and one multiply-add a block scales eight output
// rows' sums, where a register of one row's products would need its lanes summed, then scaling, block by block.
constexpr int64_t kGroupBlock8 = kGroup * kBlock;  // bytes of a group's block
constexpr int kRuns = kBlock / 4;

// One group of weight rows (wg, with its blocks' d) against R rows of activations quantized per block (row r's
// block b at row_block<R>(b, r) of xq, dx and xsums): for each activation row and output row i, the sum over blocks of
// d * dx * sum(q * xq), written to y[r * y_stride + i] for the group's first `outputs` rows. Each run is read
// once for all R rows; every row's own operations and their order are those of a lone row, so a row's result
// does not depend on how many share the weights. With VNNI, which multiplies unsigned bytes by signed ones, the
// weights' + 128 adds 128 * sum(xq) to a block's sum, which starting the sum from -128 * sum(xq) takes back out.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int R>
static inline void int8_group_dot(const uint8_t* wg, const at::Half* dg, const int8_t* xq, const float* dx,
                                  const int32_t* xsums, int64_t KB, float* y, int64_t y_stride,
                                  int64_t outputs) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m256i sums[R];
    for (int r = 0; r < R; ++r) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      sums[r] = _mm256_set1_epi32(-128 * xsums[row_block<R>(b, r)]);
#else
      sums[r] = _mm256_setzero_si256();
#endif
    }
    for (int k = 0; k < kRuns; ++k) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * kGroupBlock8 + k * 32));
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
      // without VNNI the signed weights: |q| times x with q's sign, as dot_s8s8 does, so no pair sum saturates
      const __m256i q = _mm256_xor_si256(raw, _mm256_set1_epi8(static_cast<char>(0x80))), size = _mm256_abs_epi8(q);
#endif
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(four_bytes(xq + row_block<R>(b, r) * kBlock + 4 * k));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        sums[r] = _mm256_dpbusd_epi32(sums[r], raw, x);
#else
        sums[r] = add_u8s8(sums[r], size, _mm256_sign_epi8(x, q));
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + b * kGroup)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[row_block<R>(b, r)])),
                               acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kGroup];
    _mm256_store_ps(out, acc[r]);
    std::memcpy(y + r * y_stride, out, sizeof(float) * outputs);
  }
}
#else
template <int R>
static inline void int8_group_dot(const uint8_t* wg, const at::Half* dg, const int8_t* xq, const float* dx,
                                  const int32_t*, int64_t KB, float* y, int64_t y_stride, int64_t outputs) {
  for (int r = 0; r < R; ++r) {
    float acc[kGroup] = {};
    for (int64_t b = 0; b < KB; ++b) {
      const int8_t* x = xq + row_block<R>(b, r) * kBlock;
      for (int64_t i = 0; i < kGroup; ++i) {
        int32_t sum = 0;
        for (int64_t k = 0; k < kRuns; ++k)
          for (int64_t e = 0; e < 4; ++e)
            sum += (static_cast<int32_t>(wg[b * kGroupBlock8 + k * 32 + i * 4 + e]) - 128) * x[4 * k + e];
        acc[i] += static_cast<float>(sum) * (half_to_float(dg[b * kGroup + i]) * dx[row_block<R>(b, r)]);
      }
    }
    std::memcpy(y + r * y_stride, acc, sizeof(float) * outputs);
  }
}
#endif

#ifdef HAVE_GROUP_PAIRS
// As int4.cpp's int4_pair_dot: two groups at a time in 512-bit registers (the second group's blocks follow the
// first's), each instruction serving sixteen output rows, with int8_group_dot's integers and float operations.
constexpr int64_t kAhead8 = 4;  // blocks ahead that a pair's weights are fetched

template <int R>
static inline void int8_pair_dot(const uint8_t* wg, const at::Half* dg, const int8_t* xq, const float* dx,
                                 const int32_t* xsums, int64_t KB, float* y, int64_t y_stride,
                                 int64_t outputs) {
  const uint8_t* wg1 = wg + KB * kGroupBlock8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    prefetch_pair_block(wg, b + kAhead8, KB, kGroupBlock8);
    __m512i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_set1_epi32(-128 * xsums[row_block<R>(b, r)]);
    for (int k = 0; k < kRuns; ++k) {
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * kGroupBlock8 + k * 32));
      const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg1 + b * kGroupBlock8 + k * 32));
      const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      for (int r = 0; r < R; ++r)
        sums[r] = _mm512_dpbusd_epi32(sums[r], raw,
                                      _mm512_set1_epi32(four_bytes(xq + row_block<R>(b, r) * kBlock + 4 * k)));
    }
    const __m512 d = two_groups_values(dg, b, KB);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[row_block<R>(b, r)])),
                               acc[r]);
  }
  const __mmask16 kept = static_cast<__mmask16>((1u << outputs) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, kept, acc[r]);
}
#endif

// y = x w^T for the rows of activations x quantized in a (BlockActivations) and N output rows stored as above:
// w [ceil(N / 8), K / 32 * 256] uint8 and d [ceil(N / 8), K / 32, 8] fp16, the activation rows in groups past each
// group of weights (past_groups).
void int8_block_rows(const BlockActivations& a, const uint8_t* wp, const at::Half* dp, int64_t N, float* yp) {
  const int64_t K = a.K, KB = K / kBlock, groups = (N + kGroup - 1) / kGroup;
  past_groups(groups, K, a.M, [&](auto rows, int64_t g, int64_t r) {
    constexpr int R = decltype(rows)::value;
    const uint8_t* wg = wp + g * KB * kGroupBlock8;
    const at::Half* dg = dp + g * KB * kGroup;
    const int8_t* xq = a.q.get() + r * K;
    const float* dx = a.d.get() + r * KB;
    const int32_t* xsums = a.sums.get() + r * KB;
#ifdef HAVE_GROUP_PAIRS
    if (g + 1 < groups)
      return int8_pair_dot<R>(wg, dg, xq, dx, xsums, KB, yp + r * N + g * kGroup, N,
                              std::min(2 * kGroup, N - g * kGroup));
#endif
    int8_group_dot<R>(wg, dg, xq, dx, xsums, KB, yp + r * N + g * kGroup, N, std::min(kGroup, N - g * kGroup));
  });
}

// y = x w^T for x [M, K] float32 and N output rows stored as above; each row of y on its own.
at::Tensor int8_block_linear(at::Tensor x, at::Tensor w, at::Tensor d, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock, groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of 32");
  TORCH_CHECK(N > 0 && w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 2 && w.size(0) == groups &&
              w.size(1) == KB * kGroupBlock8, "w must be contiguous uint8 [ceil(N / 8), K / 32 * 256]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == groups * KB * kGroup,
              "d: fp16 [ceil(N / 8), K / 32, 8]");
  x = x.contiguous();
  auto y = x.new_empty({M, N});
  int8_block_rows(BlockActivations(x.data_ptr<float>(), M, K), w.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), N,
                  y.data_ptr<float>());
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
