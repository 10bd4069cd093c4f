// small_linear: the float32 product of the few rows of a decode or verification step, each weight row
// read once for all rows of x, a row's sums in an order that does not depend on how many rows share the call.
#include "kernels.h"

namespace tokenpath {


// Rows of float32 weights small_linear_rows reads side by side (its switch takes groups of 1 to 4), and
// rows of x each weight row serves at once: two where AVX-512's 32 registers hold their 16 accumulators.
constexpr int kStreams = 4;
#if defined(__AVX512F__)
constexpr int kXRows = 2;
#else
constexpr int kXRows = 1;
#endif

// y = x w^T (+ bias) for the few rows of a decode or verification step: x [M, K], w [N, K], float32.
// Threads take shares of the weight rows and read kStreams rows from far-apart parts of their shares
// side by side (adjacent rows would be one stream), and each row, read from memory once, serves all M
// rows of x from the nearest cache, kXRows of them at a time. A row's sums run in an order that does
// not depend on M (MKL's few-row kernels pack the weights first and sum in another order).
void small_linear_rows(const float* xp, int64_t M, const float* wp, int64_t N, int64_t K, float* yp) {
  shared_streams<kStreams>(N, K * 4 * M, [&](const int64_t* begin, const int64_t* end, int ranges) {
    side_by_side<kStreams>(begin, end, ranges, [&](const int64_t* rows, int count) {
      const float* w[kStreams];
      for (int r = 0; r < count; ++r) w[r] = wp + rows[r] * K;
      // rows [m, m + A) of x against the count weight rows
      auto rows_of_x = [&](auto a_rows, int64_t m) {
        constexpr int A = decltype(a_rows)::value;
        const float* x[A];
        float y[A * kStreams];
        for (int i = 0; i < A; ++i) x[i] = xp + (m + i) * K;
        switch (count) {
          case 4: dot_rows_of<A, 4>(x, w, K, y); break;
          case 3: dot_rows_of<A, 3>(x, w, K, y); break;
          case 2: dot_rows_of<A, 2>(x, w, K, y); break;
          default: dot_rows_of<A, 1>(x, w, K, y);
        }
        for (int i = 0; i < A; ++i)
          for (int r = 0; r < count; ++r) yp[(m + i) * N + rows[r]] = y[i * count + r];
      };
      int64_t m = 0;
      for (; m + kXRows <= M; m += kXRows) rows_of_x(std::integral_constant<int, kXRows>{}, m);
      for (; m < M; ++m) rows_of_x(std::integral_constant<int, 1>{}, m);
    });
  });
}

at::Tensor small_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_linear takes float32");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w must be a contiguous 2-D tensor");
  const int64_t K = w.size(1), N = w.size(0);
  TORCH_CHECK(x.size(-1) == K, "x and w disagree on the input width");
  x = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = x.new_empty(sizes);
  small_linear_rows(x.data_ptr<float>(), x.numel() / K, w.data_ptr<float>(), N, K, y.data_ptr<float>());
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace tokenpath
