// Activation sparsity (engine/switches/sparsity.py): sparse_linear, the product whose inputs below a
// threshold count as zero, either skipping the weight rows of those inputs or multiplying their zeros,
// with the same sums either way; and mask_small, the zeroing alone, for the products PyTorch runs.
#include "kernels.h"

namespace tokenpath {

constexpr int64_t kColumnBlock = 16;  // outputs per share: a cache line of float32

// y[m] += sum over the R rows w[q] of v[m * R + q] * w[q][j] for outputs j in [lo, hi), each output
// updated one term after another: vectorized across outputs, never reassociated within one.
template <int R>
static inline void add_rows(float* __restrict y, const float* const* w, const float* v, int64_t lo, int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    float acc = y[j];
    for (int q = 0; q < R; ++q) acc += v[q] * w[q][j];
    y[j] = acc;
  }
}

// y = x w for x [..., K] float32 (M rows of K inputs) and w_t [K, N] float32, the weights stored
// transposed so that one input's weights are one contiguous row. Inputs below `threshold` in magnitude
// count as zero. Each output is the sum over inputs in ascending order of x[m][k] * w_t[k][n], one term
// after another from zero: a zero input's term adds exactly nothing, so leaving it out changes no bit.
// skip: a weight row is read only where some row of x has an active input; otherwise every weight row
// is read and its zeros multiplied. Threads take shares of the outputs, so a result depends neither on
// the thread count nor on M. Returns (y shaped like x with N last, inputs zeroed, weight rows skipped).
std::tuple<at::Tensor, int64_t, int64_t> sparse_linear(at::Tensor x, at::Tensor w_t, double threshold, bool skip) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(w_t.dim() == 2 && w_t.is_contiguous() && w_t.scalar_type() == at::kFloat,
              "w_t must be a contiguous 2-D float32 tensor");
  const int64_t K = w_t.size(0), N = w_t.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "x and w_t disagree on the input width");
  x = x.contiguous();
  const int64_t M = x.numel() / K;
  const float* xp = x.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  // the inputs masked, input by input (v[k * M + m]), and the weight rows to read
  std::vector<float> v(static_cast<size_t>(K * M));
  std::vector<int64_t> rows;
  rows.reserve(K);
  int64_t zeroed = 0;
  for (int64_t k = 0; k < K; ++k) {
    bool any = false;
    for (int64_t m = 0; m < M; ++m) {
      const float value = xp[m * K + k];
      const bool keep = std::fabs(value) >= threshold;
      v[k * M + m] = keep ? value : 0.f;
      zeroed += !keep;
      any |= keep;
    }
    if (any || !skip) rows.push_back(k);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = x.new_zeros(sizes);
  float* yp = y.data_ptr<float>();
  const int64_t R = static_cast<int64_t>(rows.size()), blocks = (N + kColumnBlock - 1) / kColumnBlock;
  const int64_t grain = R * N * 4 < kParallelBytes ? blocks : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    const int64_t lo = first * kColumnBlock, hi = std::min(N, last * kColumnBlock);
    constexpr int G = 4;  // weight rows per pass: each output is loaded and stored once per four rows
    float vg[G];
    int64_t g = 0;
    for (; g + G <= R; g += G) {
      const float* w[G];
      for (int q = 0; q < G; ++q) w[q] = wp + rows[g + q] * N;
      for (int64_t m = 0; m < M; ++m) {
        for (int q = 0; q < G; ++q) vg[q] = v[rows[g + q] * M + m];
        add_rows<G>(yp + m * N, w, vg, lo, hi);
      }
    }
    for (; g < R; ++g) {
      const float* w[1] = {wp + rows[g] * N};
      for (int64_t m = 0; m < M; ++m) add_rows<1>(yp + m * N, w, &v[rows[g] * M + m], lo, hi);
    }
  });
  return {y, zeroed, K - R};
}

// x with every entry below the threshold in magnitude set to zero, and how many were zeroed:
// one pass instead of abs, compare, multiply and count as separate operations.
std::tuple<at::Tensor, int64_t> mask_small(at::Tensor x, double threshold) {
  x = x.contiguous();
  auto out = x.new_empty(x.sizes());
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

}  // namespace tokenpath
