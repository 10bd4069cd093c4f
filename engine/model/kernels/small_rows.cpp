// small_linear: the float32 product of the few rows of a decode or verification step, each weight row
// read once for all rows of x, a row's sums in an order that does not depend on how many rows share the call.
#include "kernels.h"

namespace tokenpath {


// Rows of float32 weights small_linear_rows reads side by side (its switch takes groups of 1 to 4).
constexpr int kStreams = 4;

// y = x w^T (+ bias) for the few rows of a decode or verification step: x [M, K], w [N, K], float32.
// Threads take shares of the weight rows and read kStreams rows from far-apart parts of their shares
// side by side (adjacent rows would be one stream), and each row, read from memory once, serves all M
// rows of x from the nearest cache. A row's sums run in an order that does not depend on M (MKL's
// few-row kernels pack the weights first and sum in another order).
void small_linear_rows(const float* xp, int64_t M, const float* wp, int64_t N, int64_t K, float* yp) {
  shared_streams<kStreams>(N, K * 4, [&](const int64_t* begin, const int64_t* end, int ranges) {
    side_by_side<kStreams>(begin, end, ranges, [&](const int64_t* rows, int count) {
      const float* w[kStreams];
      float y[kStreams];
      for (int r = 0; r < count; ++r) w[r] = wp + rows[r] * K;
      for (int64_t m = 0; m < M; ++m) {
        switch (count) {
          case 4: dot_rows<4>(xp + m * K, w, K, y); break;
          case 3: dot_rows<3>(xp + m * K, w, K, y); break;
          case 2: dot_rows<2>(xp + m * K, w, K, y); break;
          default: dot_rows<1>(xp + m * K, w, K, y);
        }
        for (int r = 0; r < count; ++r) yp[m * N + rows[r]] = y[r];
      }
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
  auto y = at::empty(sizes, x.options());
  small_linear_rows(x.data_ptr<float>(), x.numel() / K, w.data_ptr<float>(), N, K, y.data_ptr<float>());
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace tokenpath
