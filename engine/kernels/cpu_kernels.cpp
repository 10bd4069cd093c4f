// Tokenpath's CPU kernels, built by engine/cpu_kernels.py.
//
// sparse_gemv: activation-sparse matrix-vector product that reads only the weight rows of active
// inputs. w_t is the weight stored transposed, [in_features, out_features], so each input channel's
// weights are one contiguous row: an input below the threshold means its row is never loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <int R>
static inline void add_rows(float* __restrict y, const float* const* rows, const float* v, int64_t out) {
  for (int64_t j = 0; j < out; ++j) {
    float acc = y[j];
    for (int q = 0; q < R; ++q) acc += v[q] * rows[q][j];
    y[j] = acc;
  }
}

// Returns y and the number of active inputs. Each thread takes a contiguous share of the active
// rows and streams them whole into its own partial output (long contiguous reads, which the
// hardware prefetcher follows); the partial outputs are summed at the end.
std::tuple<torch::Tensor, int64_t> sparse_gemv(torch::Tensor x, torch::Tensor w_t, double threshold) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == torch::kFloat, "x must be a 1-D float32 tensor");
  TORCH_CHECK(w_t.dim() == 2 && w_t.is_contiguous() && w_t.scalar_type() == torch::kFloat,
              "w_t must be a contiguous 2-D float32 tensor");
  const int64_t in = w_t.size(0), out = w_t.size(1);
  TORCH_CHECK(x.size(0) == in, "x and w_t disagree on the input width");
  x = x.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  std::vector<int64_t> active;
  active.reserve(in);
  for (int64_t i = 0; i < in; ++i)
    if (std::fabs(xp[i]) >= threshold) active.push_back(i);
  const int64_t n = static_cast<int64_t>(active.size());
  const int threads = at::get_num_threads();
  // one partial output per thread, summed here: cheaper than an ATen sum call per layer
  std::vector<float> partial(static_cast<size_t>(threads) * out, 0.f);
  float* pp = partial.data();
  constexpr int R = 4;  // rows per pass: each output element is loaded and stored once per four rows
  at::parallel_for(0, n, std::max<int64_t>((n + threads - 1) / threads, 1), [&](int64_t begin, int64_t end) {
    float* y = pp + at::get_thread_num() * out;
    int64_t k = begin;
    for (; k + R <= end; k += R) {
      const float* rows[R];
      float v[R];
      for (int q = 0; q < R; ++q) {
        rows[q] = wp + active[k + q] * out;
        v[q] = xp[active[k + q]];
      }
      add_rows<R>(y, rows, v, out);
    }
    for (; k < end; ++k) {
      const float* rows[1] = {wp + active[k] * out};
      const float v[1] = {xp[active[k]]};
      add_rows<1>(y, rows, v, out);
    }
  });
  auto y = torch::empty({out}, x.options());
  float* yp = y.data_ptr<float>();
  std::copy(pp, pp + out, yp);
  for (int t = 1; t < threads; ++t)
    for (int64_t j = 0; j < out; ++j) yp[j] += pp[t * out + j];
  return {y, n};
}

// x with every entry below the threshold in magnitude set to zero, and how many were zeroed:
// one pass instead of abs, compare, multiply and count as separate operations.
std::tuple<torch::Tensor, int64_t> mask_small(torch::Tensor x, double threshold) {
  x = x.contiguous();
  auto out = torch::empty_like(x);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_gemv", &sparse_gemv, "y = W x reading only the rows of W^T whose input is active");
  m.def("mask_small", &mask_small, "zero the entries below a magnitude threshold, and count them");
}
