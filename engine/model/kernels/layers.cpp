// The pieces of a Llama layer around its products, float32: rms_norm, rotary, silu_mul, decode_attention
// (one query row over a KV cache, which may keep bfloat16 or float16), and argmax over a step's logits.
#include "kernels.h"

namespace tokenpath {

// RMSNorm of each row of x (float32, last dimension contiguous): w * (x / sqrt(mean(x^2) + eps)),
// the products in the same order as transformers' LlamaRMSNorm. One small loop: the operations
// PyTorch would chain for it each cost several microseconds on a decode step, whose caches the
// weight stream has just flushed. The squares are exact in double and summed in eight chains, added
// in a fixed order: one chain waited for each add before the next.
void rms_norm_rows(const float* xp, const float* wp, double eps, int64_t rows, int64_t H, float* op) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xp + r * H;
    double lanes[8] = {};
    int64_t k = 0;
    for (; k + 8 <= H; k += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(row[k + j]) * row[k + j];
    double squares = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; k < H; ++k) squares += static_cast<double>(row[k]) * row[k];
    const float scale = 1.f / std::sqrt(static_cast<float>(squares / H) + static_cast<float>(eps));
    for (int64_t k = 0; k < H; ++k) op[r * H + k] = wp[k] * (row[k] * scale);
  }
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm takes float32");
  x = x.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "the weight's width differs from x's");
  auto out = x.new_empty(x.sizes());
  w = w.contiguous();
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(rows, H, [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp + begin * H, wp, eps, end - begin, H, op + begin * H);
  });
  return out;
}

// The first `heads` heads of one row v rotated: head h goes to out + h * stride.
void rotary_row(const float* v, const float* c, const float* s, int64_t heads, int64_t D, float* out,
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
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t heads, int64_t D) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "rotary takes float32");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t B = x.size(0), L = x.size(1), width = x.size(2);
  TORCH_CHECK(width >= heads * D && cos.size(-1) == D && cos.numel() == B * L * D, "rotary: shapes disagree");
  auto out = x.new_empty({B, heads, L, D});
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(B * L, heads * D, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      rotary_row(xp + i * width, cp + i * D, sp + i * D, heads, D, op + (i / L * heads * L + i % L) * D, L * D);
  });
  return out;
}

// e^x within about two units in the last place for x in [-87, 88], and e^-87 or e^88 beyond (silu and
// softmax need no more: 1 + e^-87 is 1): x = n ln 2 + r with |r| <= ln 2 / 2, e^r from a polynomial
// (Cephes' coefficients), times 2^n built in the exponent bits. The vector forms below do the same
// operations on eight or sixteen lanes, so a value gets the same bits in either. The library's expf, one value at
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

#if defined(__AVX512F__)
// exp_approx8's operations on sixteen lanes: the same bits.
static inline __m512 exp_approx16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kExpHigh)), _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kLn2High))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(kLn2Low)));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kExpPoly[i]));
  const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}
#endif

// w[t] = e^(w[t] - top) for t < T.
static void exp_shifted(float* w, int64_t T, float top) {
  int64_t t = 0;
#if defined(__AVX512F__)
  // the last lanes masked rather than left to the plain loop: a prompt's rows attend over a few keys each
  for (; t < T; t += 16) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, T - t)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, w + t), _mm512_set1_ps(top));
    _mm512_mask_storeu_ps(w + t, lanes, exp_approx16(x));
  }
#endif
#if defined(__AVX2__)
  for (; t + 8 <= T; t += 8)
    _mm256_storeu_ps(w + t, exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(w + t), _mm256_set1_ps(top))));
#endif
  for (; t < T; ++t) w[t] = exp_approx(w[t] - top);
}

// silu(g) * u = g / (1 + e^-g) * u, for each row of x [rows, 2 * I] holding g then u, into rows op_stride apart (I
// where it is 0). A row is a few chains of dependent operations; the loop over the rows lets the core run the next
// row's beside them.
void silu_mul_rows(const float* xp, int64_t rows, int64_t I, float* op, int64_t op_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = xp + r * 2 * I;
    const float* up = gate + I;
    float* out = op + r * (op_stride ? op_stride : I);
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= I; k += 16) {
      const __m512 g = _mm512_loadu_ps(gate + k);
      const __m512 e = exp_approx16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
      _mm512_storeu_ps(out + k, _mm512_mul_ps(silu, _mm512_loadu_ps(up + k)));
    }
#endif
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
at::Tensor silu_mul(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_mul takes float32");
  x = x.contiguous();
  const int64_t I = x.size(-1) / 2, rows = x.numel() / (2 * I);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = x.new_empty(sizes);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_rows(rows, 2 * I, [&](int64_t begin, int64_t end) {
    silu_mul_rows(xp + begin * 2 * I, end - begin, I, op + begin * I);
  });
  return out;
}

// A cached value as float32: a cache keeps float32, bfloat16 or float16, and attention computes in float32 over it
// (the conversions are exact).
static inline float widen(float x) { return x; }
static inline float widen(at::BFloat16 x) { return static_cast<float>(x); }
static inline float widen(at::Half x) { return static_cast<float>(x); }
// A cached row of n values as float32: the row itself where it holds float32, else widened into `buffer`.
template <typename E>
static inline const float* as_floats(const E* row, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<E, float>) return row;
  for (int64_t i = 0; i < n; ++i) buffer[i] = widen(row[i]);
  return buffer;
}
#if defined(__AVX512F__)
static inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 widen16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 widen16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// A head's cached rows of D values (keys or values): the first P at `shared` (a kept prompt's, which other sequences
// read too), the rest at `own`.
template <typename E>
struct HeadRows {
  const E* shared;
  const E* own;
  int64_t P, D;
  const E* at(int64_t t) const { return t < P ? shared + t * D : own + (t - P) * D; }
};

// pair(row t, row t + 1, t) for t = 0, 2, 4, ... while t + 1 < T, then single(row t, t) for the last where T is odd:
// the rows in order, each run's walked with plain pointers (a row's address chosen per position slowed the values'
// sums of a cache that shares nothing).
template <typename E, typename Pair, typename Single>
static inline void in_pairs(const HeadRows<E>& v, int64_t T, Pair&& pair, Single&& single) {
  const int64_t P = std::min(v.P, T), D = v.D;
  int64_t t = 0;
  for (; t + 2 <= P; t += 2) pair(v.shared + t * D, v.shared + (t + 1) * D, t);
  if (t < P) {  // an odd opening: its last row pairs with the first of the sequence's own
    if (t + 1 < T) pair(v.shared + t * D, v.own, t);
    else single(v.shared + t * D, t);
    t += 2;
  }
  for (; t + 2 <= T; t += 2) pair(v.own + (t - P) * D, v.own + (t + 1 - P) * D, t);
  if (t < T) single(v.own + (t - P) * D, t);
}

// Head g's keys (or values, with `values`) of a cache.
template <typename E>
static HeadRows<E> head_rows(const CacheView& c, int64_t g, int64_t D, bool values) {
  return {static_cast<const E*>(values ? c.shared_values : c.shared_keys) + g * (values ? c.sv_stride : c.sk_stride),
          static_cast<const E*>(values ? c.values : c.keys) + g * (values ? c.v_stride : c.k_stride), c.P, D};
}

// o_i[d] = the sum over t of p_i[t] * v[t * D + d] for HC heads over the same values (head i's weights at
// p + i * p_step, its outputs at o + i * D): in each slice of 64 outputs, the even positions' sum and the odd
// positions' sum, each added in the order of t, then added together; outputs past the last full slice in one sum in
// the order of t. Each value is widened once for the HC heads, and a slice is taken in halves of 32 so that every
// head's sums stay in registers, two sets of chains side by side: each add waits for the one before in its chain.
// A head's sums are the same whichever heads are taken with it.
template <int HC, typename E>
static void weighted_values(const float* p, int64_t p_step, HeadRows<E> v, int64_t T, int64_t D, float* o) {
  constexpr int64_t kSlice = 64;
  int64_t d0 = 0;
  for (; d0 + kSlice <= D; d0 += kSlice) {
#if defined(__AVX512F__)  // the lanes written out: a compiler leaves a narrow type's widening to a loop of its own
    for (int64_t half = d0; half < d0 + kSlice; half += 32) {
      __m512 even[HC][2], odd[HC][2];
      for (int i = 0; i < HC; ++i) even[i][0] = even[i][1] = odd[i][0] = odd[i][1] = _mm512_setzero_ps();
      in_pairs(
          v, T,
          [&](const E* a, const E* b, int64_t t) {
            const __m512 a0 = widen16(a + half), a1 = widen16(a + half + 16), b0 = widen16(b + half),
                         b1 = widen16(b + half + 16);
            for (int i = 0; i < HC; ++i) {
              const __m512 we = _mm512_set1_ps(p[i * p_step + t]), wo = _mm512_set1_ps(p[i * p_step + t + 1]);
              even[i][0] = _mm512_fmadd_ps(we, a0, even[i][0]);
              even[i][1] = _mm512_fmadd_ps(we, a1, even[i][1]);
              odd[i][0] = _mm512_fmadd_ps(wo, b0, odd[i][0]);
              odd[i][1] = _mm512_fmadd_ps(wo, b1, odd[i][1]);
            }
          },
          [&](const E* a, int64_t t) {
            const __m512 a0 = widen16(a + half), a1 = widen16(a + half + 16);
            for (int i = 0; i < HC; ++i) {
              const __m512 we = _mm512_set1_ps(p[i * p_step + t]);
              even[i][0] = _mm512_fmadd_ps(we, a0, even[i][0]);
              even[i][1] = _mm512_fmadd_ps(we, a1, even[i][1]);
            }
          });
      for (int i = 0; i < HC; ++i) {
        _mm512_storeu_ps(o + i * D + half, _mm512_add_ps(even[i][0], odd[i][0]));
        _mm512_storeu_ps(o + i * D + half + 16, _mm512_add_ps(even[i][1], odd[i][1]));
      }
    }
#else
    for (int i = 0; i < HC; ++i) {
      const float* w = p + i * p_step;
      float even[kSlice] = {}, odd[kSlice] = {};
      int64_t t = 0;
      for (; t + 2 <= T; t += 2)
        for (int64_t j = 0; j < kSlice; ++j) {
          even[j] += w[t] * widen(v.at(t)[d0 + j]);
          odd[j] += w[t + 1] * widen(v.at(t + 1)[d0 + j]);
        }
      if (t < T)
        for (int64_t j = 0; j < kSlice; ++j) even[j] += w[t] * widen(v.at(t)[d0 + j]);
      for (int64_t j = 0; j < kSlice; ++j) o[i * D + d0 + j] = even[j] + odd[j];
    }
#endif
  }
  for (int i = 0; i < HC; ++i) {
    float* out = o + i * D;
    std::fill(out + d0, out + D, 0.f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = d0; d < D; ++d) out[d] += p[i * p_step + t] * widen(v.at(t)[d]);
  }
}

// The sum of w[0..T) in 16 lanes, added in a fixed order: one running sum waited for each add.
static float lanes_sum(const float* w, int64_t T) {
  float lanes[16] = {};
  int64_t t = 0;
  for (; t + 16 <= T; t += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += w[t + j];
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  float total = lanes[0];
  for (; t < T; ++t) total += w[t];
  return total;
}

// w[0..T) = softmax of the scores w[0..T), whose largest is top.
static void softmax_of_scores(float* w, int64_t T, float top) {
  exp_shifted(w, T, top);
  const float total = lanes_sum(w, T);
  for (int64_t t = 0; t < T; ++t) w[t] /= total;
}

#if defined(__AVX512F__)
// One register whose lane j is the sum of key j's register of lanes, for 16 keys (key j's in v[4 * (j % 4) + j / 4]),
// added in the order _mm512_reduce_add_ps adds one register's lanes (lane i and i + 8, then i and i + 4, i and
// i + 2, i and i + 1): each shuffle and add serves 2 to 16 keys, where reducing each key's register on its own takes
// 8 shuffles and adds for one number. v is overwritten.
static inline __m512 sums_of_16(__m512* v) {
  for (int i = 0; i < 8; ++i)  // 256-bit halves: 2 keys a register, 8 lanes each
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: 4 keys a register, 4 lanes each
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // lanes 2 apart: 8 keys a register, 2 lanes each
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// For HC query heads over the same 16 keys (head i's query at q + i * q_step), w_i[j] = dot(q_i, keys + j * D, D) * s
// bit for bit (head i's scores at w + i * w_step), and tops[i] their lane-wise maximum with what it held. Each key is
// widened once for the HC heads; a head's key sums are dot()'s two registers of lanes (the slices of 16 taken in
// turn) added together, then reduced by sums_of_16. D is a multiple of 16. Only the keys in `lanes` are stored and
// taken into tops (a last block that tail_block padded).
template <int HC, typename E>
static inline void scores16(const float* q, int64_t q_step, const E* keys, int64_t D, float s, float* w,
                            int64_t w_step, __m512* tops, __mmask16 lanes = 0xffff) {
  __m512 v[HC][16];
  for (int j = 0; j < 16; ++j) {
    const E* key = keys + j * D;
    __m512 acc0[HC], acc1[HC];
    for (int i = 0; i < HC; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      const __m512 k0 = widen16(key + d), k1 = widen16(key + d + 16);
      for (int i = 0; i < HC; ++i) {
        acc0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * q_step + d), k0, acc0[i]);
        acc1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * q_step + d + 16), k1, acc1[i]);
      }
    }
    if (d < D) {
      const __m512 k0 = widen16(key + d);
      for (int i = 0; i < HC; ++i) acc0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + i * q_step + d), k0, acc0[i]);
    }
    for (int i = 0; i < HC; ++i) v[i][4 * (j % 4) + j / 4] = _mm512_add_ps(acc0[i], acc1[i]);
  }
  for (int i = 0; i < HC; ++i) {
    const __m512 scores = _mm512_mul_ps(sums_of_16(v[i]), _mm512_set1_ps(s));
    _mm512_mask_storeu_ps(w + i * w_step, lanes, scores);
    tops[i] = _mm512_mask_max_ps(tops[i], lanes, tops[i], scores);
  }
}
#endif

#if defined(__AVX512F__)
// The last n (< 16) of a head's keys copied to the start of `block` (room for 16 keys, made zeros, after which it
// holds earlier keys: a lane's sum is its own key's alone, and only the lanes returned are kept): the last keys go
// through the blocks' sums, the same as dot()'s, rather than dot() a key at a time, which widens each key into a
// buffer and reduces its lanes alone.
template <typename E>
static inline __mmask16 tail_block(const E* keys, int64_t n, int64_t D, E* block) {
  std::copy(keys, keys + n * D, block);
  return static_cast<__mmask16>((1u << n) - 1);
}
#endif

#if defined(__AVX512F__)
// scores16 over n keys in a row (w[j] for key j), in blocks of 16, the last few through tail_block.
template <int HC, typename E>
static inline void scores_of_run(const float* q, int64_t q_step, const E* keys, int64_t n, int64_t D, float s, float* w,
                                 int64_t w_step, __m512* tops, E* block) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) scores16<HC>(q, q_step, keys + t * D, D, s, w + t, w_step, tops);
  if (t < n) scores16<HC>(q, q_step, block, D, s, w + t, w_step, tops, tail_block(keys + t * D, n - t, D, block));
}
#endif

// HC query heads of one grouped-query group (head i's query at q + i * q_step, its output at o + i * D) over the
// group's T cached keys and values: scores, softmax and the weighted values, each head's arithmetic the same
// whichever heads are taken with it and wherever the rows lie. w holds HC rows of at least T floats, w_step apart;
// key D floats, block 16 * D values.
template <int HC, typename E>
static void attend_heads(const float* q, int64_t q_step, HeadRows<E> kh, HeadRows<E> vh, int64_t T, int64_t D,
                         float s, float* w, int64_t w_step, float* key, E* block, float* o) {
  float top[HC];
  std::fill(top, top + HC, -INFINITY);
  int64_t t = 0;
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    // the largest score, lane by lane then across: std::max's one by one but for NaN and the sign of a zero,
    // which give every output the same bits either way
    __m512 tops[HC];
    for (int i = 0; i < HC; ++i) tops[i] = _mm512_set1_ps(-INFINITY);
    // the shared rows, then the sequence's own: each block of 16 keys lies in one of them
    scores_of_run<HC>(q, q_step, kh.shared, kh.P, D, s, w, w_step, tops, block);
    scores_of_run<HC>(q, q_step, kh.own, T - kh.P, D, s, w + kh.P, w_step, tops, block);
    t = T;
    for (int i = 0; i < HC; ++i) top[i] = _mm512_reduce_max_ps(tops[i]);
  }
#endif
  for (int i = 0; i < HC; ++i) {
    float* wi = w + i * w_step;
    for (int64_t u = t; u < T; ++u) {
      wi[u] = dot(q + i * q_step, as_floats(kh.at(u), D, key), D) * s;
      top[i] = std::max(top[i], wi[u]);
    }
    softmax_of_scores(wi, T, top[i]);
  }
  weighted_values<HC>(w, w_step, vh, T, D, o);
}

#if defined(__AVX512F__)
// sums[j] += weight * the 16 values from v + 16 * j, for j < 4 (a slice of 64).
template <typename E>
static inline void add_weighted_slice(__m512* sums, float weight, const E* v) {
  const __m512 w = _mm512_set1_ps(weight);
  for (int j = 0; j < 4; ++j) sums[j] = _mm512_fmadd_ps(w, widen16(v + 16 * j), sums[j]);
}
#endif

// weighted_values for one head, a whole slice of 64 at a time: o[d] = the sum over t of p[t] * v[t * D + d], the
// same sums in the same order.
template <typename E>
static void one_head_values(const float* p, HeadRows<E> v, int64_t T, int64_t D, float* o) {
#if defined(__AVX512F__)  // the lanes written out: a compiler leaves a narrow type's widening to a loop of its own
  constexpr int64_t kSlice = 64;
  int64_t d0 = 0;
  for (; d0 + kSlice <= D; d0 += kSlice) {
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    in_pairs(
        v, T,
        [&](const E* a, const E* b, int64_t t) {
          add_weighted_slice(even, p[t], a + d0);
          add_weighted_slice(odd, p[t + 1], b + d0);
        },
        [&](const E* a, int64_t t) { add_weighted_slice(even, p[t], a + d0); });
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + d0 + 16 * j, _mm512_add_ps(even[j], odd[j]));
  }
  std::fill(o + d0, o + D, 0.f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = d0; d < D; ++d) o[d] += p[t] * widen(v.at(t)[d]);
#else
  weighted_values<1>(p, 0, v, T, D, o);
#endif
}

#if defined(__AVX512F__)
// scores16 for one head, eight keys side by side (each load of q serving the eight): w[j] = dot(q, keys + j * D, D) * s
// for 16 keys, bit for bit, returned as well; where D is a multiple of 16, only the keys in `lanes` are stored.
template <typename E>
static __m512 one_head_scores16(const float* q, const E* keys, int64_t D, float s, float* w, __mmask16 lanes = 0xffff) {
  __m512 v[16];  // key j's in v[4 * (j % 4) + j / 4], which the steps below leave in lane j
#pragma GCC unroll 2  // keeps v in registers
  for (int g = 0; g < 16; g += 8) {
    __m512 acc0[8], acc1[8];
    for (int j = 0; j < 8; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      const __m512 q0 = _mm512_loadu_ps(q + d), q1 = _mm512_loadu_ps(q + d + 16);
      for (int j = 0; j < 8; ++j) {
        acc0[j] = _mm512_fmadd_ps(q0, widen16(keys + (g + j) * D + d), acc0[j]);
        acc1[j] = _mm512_fmadd_ps(q1, widen16(keys + (g + j) * D + d + 16), acc1[j]);
      }
    }
    if (d + 16 <= D)
      for (int j = 0; j < 8; ++j)
        acc0[j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), widen16(keys + (g + j) * D + d), acc0[j]);
    for (int j = 0; j < 8; ++j) v[4 * ((g + j) % 4) + (g + j) / 4] = _mm512_add_ps(acc0[j], acc1[j]);
  }
  const __m512 sums = sums_of_16(v);
  if (D % 16 == 0) {
    const __m512 scores = _mm512_mul_ps(sums, _mm512_set1_ps(s));
    _mm512_mask_storeu_ps(w, lanes, scores);
    return scores;
  }
  float sum[16];  // then the last few products one by one, as dot() adds them
  _mm512_storeu_ps(sum, sums);
  for (int j = 0; j < 16; ++j) {
    for (int64_t d = D - D % 16; d < D; ++d) sum[j] += q[d] * widen(keys[j * D + d]);
    w[j] = sum[j] * s;
  }
  return _mm512_loadu_ps(w);
}
#endif

// attend_over a head at a time, for steps whose groups are too few to share among the threads (a sequence or two):
// one head alone runs faster through these loops than through attend_heads<1>.
template <typename E>
static void attend_each_head(const float* qp, int64_t q_stride, int64_t head_stride,
                             const std::vector<CacheView>& caches, int64_t H, int64_t KV, int64_t D, float s, float* op) {
  const int64_t group = H / KV, B = static_cast<int64_t>(caches.size());
  int64_t longest = 1;
  for (const auto& c : caches) longest = std::max(longest, c.T);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (longest * D));
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(longest)), key(static_cast<size_t>(D));
    std::vector<E> block(static_cast<size_t>(16 * D));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const CacheView& c = caches[b];
      const int64_t T = c.T;
      const float* qh = qp + b * q_stride + h * head_stride;
      const HeadRows<E> kh = head_rows<E>(c, h / group, D, false), vh = head_rows<E>(c, h / group, D, true);
      float top = -INFINITY;
      // the shared rows, then the sequence's own: each block of 16 keys lies in one of them
      const std::tuple<const E*, int64_t, int64_t> runs[] = {{kh.shared, 0, kh.P}, {kh.own, kh.P, T - kh.P}};
      for (const auto& [keys, from, n] : runs) {
        float* wr = w.data() + from;
        int64_t t = 0;
#if defined(__AVX512F__)
        // the largest score, lane by lane then across: std::max's one by one but for NaN and the sign of a zero,
        // which give every output the same bits either way
        __m512 tops = _mm512_set1_ps(-INFINITY);
        for (; t + 16 <= n; t += 16) tops = _mm512_max_ps(tops, one_head_scores16(qh, keys + t * D, D, s, wr + t));
        if (D % 16 == 0 && t < n) {
          const __mmask16 lanes = tail_block(keys + t * D, n - t, D, block.data());
          tops = _mm512_mask_max_ps(tops, lanes, tops, one_head_scores16(qh, block.data(), D, s, wr + t, lanes));
          t = n;
        }
        top = std::max(top, _mm512_reduce_max_ps(tops));
#endif
        for (; t < n; ++t) {
          wr[t] = dot(qh, as_floats(keys + t * D, D, key.data()), D) * s;
          top = std::max(top, wr[t]);
        }
      }
      softmax_of_scores(w.data(), T, top);
      one_head_values(w.data(), vh, T, D, op + bh * D);
    }
  });
}

// The most query heads attend_heads takes at once: weighted_values keeps four sums a head in registers, 16 of the 32.
constexpr int64_t kGroupHeads = 4;

// One new token's H query heads per sequence (sequence b's at qp + b * q_stride) over that sequence's own
// cache of E, all sequences' heads shared by the threads in one go (a region per sequence would wake and wait
// for the threads as many times); each head's arithmetic is the same whatever runs beside it. A group's heads are
// taken together (up to kGroupHeads), each key and value read once for them, where the sequences' groups are enough
// to share among the threads; one at a time otherwise (attend_each_head).
template <typename E>
static void attend_over(const float* qp, int64_t q_stride, int64_t head_stride, const std::vector<CacheView>& caches,
                        int64_t H, int64_t KV, int64_t D, float s, float* op) {
  const int64_t group = H / KV, B = static_cast<int64_t>(caches.size());
  int64_t longest = 1;
  for (const auto& c : caches) longest = std::max(longest, c.T);
  if (B * KV < 4 * at::get_num_threads())
    return attend_each_head<E>(qp, q_stride, head_stride, caches, H, KV, D, s, op);
  const int64_t heads = std::min(group, kGroupHeads);
  const int64_t chunks = (group + heads - 1) / heads;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (longest * D * heads));
  at::parallel_for(0, B * KV * chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(heads * longest)), key(static_cast<size_t>(D));
    std::vector<E> block(static_cast<size_t>(16 * D));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KV * chunks), g = item / chunks % KV;
      const CacheView& c = caches[b];
      const HeadRows<E> kh = head_rows<E>(c, g, D, false), vh = head_rows<E>(c, g, D, true);
      const int64_t h = g * group + item % chunks * heads;
      const float* q = qp + b * q_stride + h * head_stride;
      float* o = op + (b * H + h) * D;
      switch (std::min(heads, (g + 1) * group - h)) {
        case 1: attend_heads<1>(q, head_stride, kh, vh, c.T, D, s, w.data(), longest, key.data(), block.data(), o); break;
        case 2: attend_heads<2>(q, head_stride, kh, vh, c.T, D, s, w.data(), longest, key.data(), block.data(), o); break;
        case 3: attend_heads<3>(q, head_stride, kh, vh, c.T, D, s, w.data(), longest, key.data(), block.data(), o); break;
        default: attend_heads<4>(q, head_stride, kh, vh, c.T, D, s, w.data(), longest, key.data(), block.data(), o); break;
      }
    }
  });
}

bool attends_over(at::ScalarType cache_type) {
  return cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf;
}

void attend(const float* qp, int64_t q_stride, int64_t head_stride, const std::vector<CacheView>& caches, int64_t H,
            int64_t KV, int64_t D, float s, float* op, at::ScalarType cache_type) {
  switch (cache_type) {
    case at::kFloat: return attend_over<float>(qp, q_stride, head_stride, caches, H, KV, D, s, op);
    case at::kBFloat16: return attend_over<at::BFloat16>(qp, q_stride, head_stride, caches, H, KV, D, s, op);
    case at::kHalf: return attend_over<at::Half>(qp, q_stride, head_stride, caches, H, KV, D, s, op);
    default: TORCH_CHECK(false, "attention reads caches of float32, bfloat16 or float16, not ", cache_type);
  }
}

// Where value i of a contiguous tensor lies, whatever its type.
static const void* at_value(const at::Tensor& t, int64_t i) {
  return static_cast<const char*>(t.data_ptr()) + i * t.element_size();
}

// Attention of one new token per sequence over all cached positions (a decode step: every key is
// visible): q [B, H, 1, D] float32, k and v [B, KV, T, D] float32, bfloat16 or float16, with H a multiple
// of KV (grouped-query heads share a key/value head). Returns [B, 1, H * D], the heads side by side as the
// output projection takes them. PyTorch's CPU flash-attention kernel sets up blocks and threads for every
// call, which for one query row costs far more than the arithmetic; this is one plain pass per head, split
// over threads only when there is enough work to pay for them.
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && attends_over(k.scalar_type()) && v.scalar_type() == k.scalar_type(),
              "decode_attention takes a float32 query over float32, bfloat16 or float16 keys and values");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == 1,
              "decode_attention: q [B, H, 1, D], k and v [B, KV, T, D]");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), KV = k.size(1), T = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && KV > 0 && H % KV == 0 && T > 0, "decode_attention: shapes disagree");
  auto out = q.new_empty({B, 1, H * D});
  std::vector<CacheView> caches;
  for (int64_t b = 0; b < B; ++b)
    caches.push_back({at_value(k, b * KV * T * D), at_value(v, b * KV * T * D), T, T * D, T * D});
  attend(q.data_ptr<float>(), H * D, D, caches, H, KV, D, static_cast<float>(scale), out.data_ptr<float>(),
         k.scalar_type());
  return out;
}


// Causal attention of prompts with nothing cached before them, side by side: q [1, H, P, D], k and v [1, KV, P, D]
// hold the prompts' positions one prompt after another (`lengths` of them each). Position t of a prompt attends
// over that prompt's positions up to t, as attend computes a decode step's row over its cache: each row's result is
// the one it gets alone, whatever prompts are beside it, and the prompt's last row the one its next decode step
// computes the same way. PyTorch's flash attention takes such prompts one call each, or padded (other sums), where
// their lengths differ. q is float32, k and v of a type decode_attention takes. Returns [1, P, H * D].
at::Tensor prompt_attention(at::Tensor q, at::Tensor k, at::Tensor v, std::vector<int64_t> lengths, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && attends_over(k.scalar_type()) && v.scalar_type() == k.scalar_type(),
              "prompt_attention takes a float32 query over float32, bfloat16 or float16 keys and values");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.dim() == 4 && k.size(0) == 1 && v.sizes() == k.sizes() &&
                  q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "prompt_attention: q [1, H, P, D], k and v [1, KV, P, D]");
  const int64_t H = q.size(1), P = q.size(2), D = q.size(3), KV = k.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0, "prompt_attention: the heads are not a multiple of the key/value heads");
  int64_t total = 0;
  for (const int64_t length : lengths) {
    TORCH_CHECK(length > 0, "prompt_attention: a prompt has no positions");
    total += length;
  }
  TORCH_CHECK(total == P, "prompt_attention: the lengths do not add up to the positions");
  if (q.stride(3) != 1) q = q.contiguous();  // each head's row read where it lies, a position's heads apart
  k = k.contiguous();
  v = v.contiguous();
  std::vector<CacheView> views;
  views.reserve(static_cast<size_t>(P));
  int64_t start = 0;
  for (const int64_t length : lengths) {
    for (int64_t t = 0; t < length; ++t)
      views.push_back({at_value(k, start * D), at_value(v, start * D), t + 1, P * D, P * D});
    start += length;
  }
  auto out = q.new_empty({1, P, H * D});
  attend(q.data_ptr<float>(), q.stride(2), q.stride(1), views, H, KV, D, static_cast<float>(scale),
         out.data_ptr<float>(), k.scalar_type());
  return out;
}

// t's positions [start, start + length) (t [1, KV, P, D], rows contiguous) copied into new storage with room for
// `room` positions: a [1, KV, length, D] view at the start of a [1, KV, room, D] tensor, a cache's keys or values as
// a decode grows them in place.
at::Tensor copied_with_room(const at::Tensor& t, int64_t start, int64_t length, int64_t room) {
  const int64_t KV = t.size(1), D = t.size(3), bytes = D * t.element_size();
  const char* base = static_cast<const char*>(t.data_ptr());
  auto store = t.new_empty({1, KV, room, D});
  char* to = static_cast<char*>(store.data_ptr());
  for (int64_t h = 0; h < KV; ++h)
    for (int64_t p = 0; p < length; ++p)
      std::memcpy(to + (h * room + p) * bytes, base + (h * t.stride(1) + (start + p) * t.stride(2)) *
                  t.element_size(), static_cast<size_t>(bytes));
  return store.narrow(2, 0, length);
}

// The prompts side by side in t [1, KV, P, D] (lengths of them, one after another), each copied into storage of its
// own with room for rooms[i] positions (copied_with_room): a fresh cache's keys or values. One call for a layer's
// prompts, where making each view and copying into it from Python cost several times the copy.
std::vector<at::Tensor> with_rooms(at::Tensor t, std::vector<int64_t> lengths, std::vector<int64_t> rooms) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.stride(3) == 1, "with_rooms: t [1, KV, P, D], rows contiguous");
  TORCH_CHECK(lengths.size() == rooms.size(), "with_rooms: a room for each prompt");
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    TORCH_CHECK(lengths[i] > 0 && rooms[i] >= lengths[i] && start + lengths[i] <= t.size(2),
                "with_rooms: lengths past the positions, or rooms shorter than them");
    out.push_back(copied_with_room(t, start, lengths[i], rooms[i]));
    start += lengths[i];
  }
  return out;
}

// The index of the largest of n floats, the first one where several are equal, and the first NaN
// where there is one: what torch.argmax returns, which on a decode step's 49152 logits costs tens of
// microseconds in a scalar loop. Four chains of maxima side by side (one waited for each maximum before
// the next), then the first position equal to the largest, eight at a time.
static int64_t argmax_of(const float* p, int64_t n) {
  float top = p[0];
  int64_t k = 0;
#if defined(__AVX2__)
  constexpr int kChains = 4;
  __m256 best[kChains], unordered[kChains];
  for (int j = 0; j < kChains; ++j) best[j] = _mm256_set1_ps(p[0]), unordered[j] = _mm256_setzero_ps();
  for (; k + 8 * kChains <= n; k += 8 * kChains)
    for (int j = 0; j < kChains; ++j) {
      const __m256 v = _mm256_loadu_ps(p + k + 8 * j);
      best[j] = _mm256_max_ps(best[j], v);
      unordered[j] = _mm256_or_ps(unordered[j], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  for (int j = 1; j < kChains; ++j)
    best[0] = _mm256_max_ps(best[0], best[j]), unordered[0] = _mm256_or_ps(unordered[0], unordered[j]);
  if (_mm256_movemask_ps(unordered[0])) k = 0;  // a NaN: the plain loop below finds the first
  else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best[0]);
    for (float lane : lanes) top = std::max(top, lane);
  }
#endif
  for (; k < n; ++k) {
    if (std::isnan(p[k])) return k;
    top = std::max(top, p[k]);
  }
  k = 0;
#if defined(__AVX2__)
  for (const __m256 wanted = _mm256_set1_ps(top); k + 8 <= n; k += 8)
    if (const int equal = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + k), wanted, _CMP_EQ_OQ)))
      return k + __builtin_ctz(static_cast<unsigned>(equal));
#endif
  for (; k < n; ++k)
    if (p[k] == top) return k;
  return 0;
}

int64_t argmax(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 1 && x.numel() > 0, "argmax takes a 1-D float32 tensor");
  x = x.contiguous();
  return argmax_of(x.data_ptr<float>(), x.numel());
}

// argmax of each row of x [rows, n], the rows shared by the threads: a batch's greedy picks in one call, where one
// call a row cost as much again in Python as the search.
std::vector<int64_t> argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0, "argmax_rows takes a 2-D float32 tensor");
  x = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const float* p = x.data_ptr<float>();
  std::vector<int64_t> picks(static_cast<size_t>(rows));
  over_rows(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) picks[r] = argmax_of(p + r * n, n);
  });
  return picks;
}

}  // namespace tokenpath
