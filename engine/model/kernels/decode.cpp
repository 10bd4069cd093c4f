// decode_layers: a whole decode step of batch 1 in one call (embedding, every layer, the last norm and
// the head), on the row functions the lean model's modules call one by one, growing the KV caches in place.
#include "kernels.h"

namespace tokenpath {

static int64_t linear_outputs(const LinearForm& form) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  return kind == 3 ? scales->size(1) : w.size(0);  // PyTorch's int4 packing keeps N in its scales' shape
}

// y = the layer applied to one row x of K values: the row functions above, no tensors in between.
static void apply_linear(const LinearForm& form, const float* x, int64_t K, float* y) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  const int64_t N = linear_outputs(form);
  std::vector<float> smoothed;
  switch (kind) {
    case 0: small_linear_rows(x, 1, w.data_ptr<float>(), N, K, y); break;
    case 1:
      int8_wo_rows(x, 1, w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::BFloat16>()), N,
                   K, y);
      break;
    case 2:
      if (inv_smooth.has_value()) {
        const float* f = inv_smooth->data_ptr<float>();
        smoothed.resize(static_cast<size_t>(K));
        for (int64_t k = 0; k < K; ++k) smoothed[k] = x[k] * f[k];
        x = smoothed.data();
      }
      int8_dyn_rows(x, 1, w.data_ptr<int8_t>(), scales->data_ptr<float>(), sums->data_ptr<int32_t>(), N, K, y);
      break;
    case 3: {
      const auto row = at::from_blob(const_cast<float*>(x), {1, K}, at::kFloat);
      const auto out = at::_weight_int4pack_mm_for_cpu(row.to(at::kBFloat16), w, group, *scales).to(at::kFloat);
      std::memcpy(y, out.data_ptr<float>(), sizeof(float) * N);
      break;
    }
    case 5: int8_block_rows(x, 1, w.data_ptr<int8_t>(), scales->data_ptr<at::Half>(), N, K, y); break;
    case 4: int4_dyn_rows(x, 1, w.data_ptr<uint8_t>(), scales->data_ptr<at::Half>(), sums->data_ptr<at::Half>(), N, K, y); break;
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) y[n] += b[n];
  }
}

// Positions a growing cache reserves at a time: copying a layer's keys and values to add each token
// would move the whole cache on every step.
constexpr int64_t kCacheRoom = 128;

// Whether cache [1, KV, T, D] is a view into storage with room for one more position after its last
// (the caches decode_layers grows or copies; a crop keeps the room).
static bool has_room(const at::Tensor& cache, int64_t KV, int64_t D) {
  const int64_t T = cache.size(2), head = cache.stride(1);
  return cache.stride(3) == 1 && cache.stride(2) == D && head >= (T + 1) * D && head % D == 0 &&
         cache.stride(0) == KV * head && cache.storage_offset() == 0 &&
         cache.storage().nbytes() >= static_cast<size_t>(KV * head) * sizeof(float);
}

// Head g's new row, from row + g * D, written at `position` of cache [1, KV, >position, D] (or of its
// storage's room just after it).
static void write_position(const at::Tensor& cache, int64_t position, const float* row, int64_t KV, int64_t D) {
  float* dst = cache.data_ptr<float>();
  for (int64_t g = 0; g < KV; ++g) std::memcpy(dst + g * cache.stride(1) + position * D, row + g * D, sizeof(float) * D);
}

// cache [1, KV, T, D] copied into new storage with room for kCacheRoom more positions, as
// [1, KV, T + 1, D] with the new rows from row written at T.
static at::Tensor regrown(const at::Tensor& cache, const float* row, int64_t KV, int64_t D) {
  const int64_t T = cache.size(2), capacity = (T + 1 + kCacheRoom - 1) / kCacheRoom * kCacheRoom;
  auto out = at::empty({1, KV, capacity, D}, cache.options()).narrow(2, 0, T + 1);
  for (int64_t g = 0; g < KV; ++g)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(out.data_ptr<float>() + g * out.stride(1) + t * D,
                  cache.data_ptr<float>() + g * cache.stride(1) + t * cache.stride(2), sizeof(float) * D);
  write_position(out, T, row, KV, D);
  return out;
}


// A decode step of batch 1 in one call from Python: the new token's embedding (ids [1, 1]), every
// Llama decoder layer, then the last norm and the output head; the position's cos and sin are row
// `row` of the rotary tables [1, rows, head_dim]. The same row functions, in the same order, as the
// lean forward's modules run one by one, so the result is the same to the bit, but with no tensor
// made between them but a cache copied when its storage has no room left. A cache with room grows
// in place: the tensor given becomes [1, kv_heads, T + 1, head_dim]. Returns (logits [1, 1,
// vocabulary], (layer, keys, values) of each layer whose caches were copied instead, cache bytes read,
// cache bytes written); the bytes are what attention and the caches' growth moved.
std::tuple<at::Tensor, std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>>, int64_t, int64_t> decode_layers(
    at::Tensor ids, const DecodeForms& forms, at::Tensor cos_table, at::Tensor sin_table, int64_t row,
    std::vector<at::Tensor> keys, std::vector<at::Tensor> values, int64_t heads, int64_t kv_heads,
    int64_t head_dim, double scaling) {
  const auto& layers = forms.layers;
  const auto& embedding = forms.embedding;
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.numel() == 1, "decode_layers takes one token id");
  TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(), "one cache per layer");
  for (const auto* table : {&cos_table, &sin_table})
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 3 &&
                    table->size(2) == head_dim && row >= 0 && row < table->size(1),
                "cos and sin: float32 tables [1, rows, head_dim] holding the row");
  const int64_t token = *ids.contiguous().data_ptr<int64_t>();
  TORCH_CHECK_INDEX(token >= 0 && token < embedding.size(0), "token id ", token, " is out of the embedding's range");
  const int64_t H = embedding.size(1), D = head_dim, KV = kv_heads, rotated_heads = heads + kv_heads;
  auto out = at::empty({1, 1, H}, embedding.options());
  float* residual = out.data_ptr<float>();
  std::memcpy(residual, embedding.data_ptr<float>() + token * H, sizeof(float) * H);
  const float* cos = cos_table.data_ptr<float>() + row * D;
  const float* sin = sin_table.data_ptr<float>() + row * D;
  std::vector<float> normed(H), delta(H), rotated(rotated_heads * D), attended(heads * D), fused, gate_up, act;
  // A cache with room gets its new position written in place, and its size one position longer after
  // the last layer, all together: a longer view made per layer between the products cost several
  // microseconds each, and a step that fails part-way leaves every cache's size as it was.
  std::vector<char> longer(2 * layers.size());
  const int64_t position_bytes = KV * D * static_cast<int64_t>(sizeof(float));
  int64_t cache_read = 0, cache_written = 0;
  auto appended = [&](at::Tensor& cache, const float* row) {
    const int64_t T = cache.size(2);
    cache_read += (T + 1) * position_bytes;  // attention reads the grown cache
    cache_written += position_bytes;
    if (has_room(cache, KV, D)) {
      write_position(cache, T, row, KV, D);
      return true;
    }
    cache_read += T * position_bytes;  // and a cache without room is copied first
    cache_written += T * position_bytes;
    cache = regrown(cache, row, KV, D);
    return false;
  };
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& [norm1, norm2, eps, qkv, o, up, down] = layers[i];
    TORCH_CHECK(keys[i].dim() == 4 && keys[i].size(1) == KV && keys[i].size(3) == D && values[i].sizes() == keys[i].sizes(),
                "a cache is not [1, kv_heads, T, head_dim]");
    rms_norm_rows(residual, norm1.data_ptr<float>(), eps, 1, H, normed.data());
    fused.resize(static_cast<size_t>(linear_outputs(qkv)));
    apply_linear(qkv, normed.data(), H, fused.data());
    rotary_row(fused.data(), cos, sin, rotated_heads, D, rotated.data(), D);
    const int64_t T = keys[i].size(2);
    longer[2 * i] = appended(keys[i], rotated.data() + heads * D);
    longer[2 * i + 1] = appended(values[i], fused.data() + rotated_heads * D);
    attend(rotated.data(), keys[i].data_ptr<float>(), values[i].data_ptr<float>(), 1, heads, KV, T + 1, D,
           keys[i].stride(1), values[i].stride(1), static_cast<float>(scaling), attended.data());
    apply_linear(o, attended.data(), heads * D, delta.data());
    for (int64_t k = 0; k < H; ++k) residual[k] += delta[k];
    rms_norm_rows(residual, norm2.data_ptr<float>(), eps, 1, H, normed.data());
    const int64_t inner = linear_outputs(up) / 2;
    gate_up.resize(static_cast<size_t>(2 * inner));
    act.resize(static_cast<size_t>(inner));
    apply_linear(up, normed.data(), H, gate_up.data());
    silu_mul_rows(gate_up.data(), 1, inner, act.data());
    apply_linear(down, act.data(), inner, delta.data());
    for (int64_t k = 0; k < H; ++k) residual[k] += delta[k];
  }
  const auto& [norm, eps, linear] = forms.head;
  rms_norm_rows(residual, norm.data_ptr<float>(), eps, 1, H, normed.data());
  auto logits = at::empty({1, 1, linear_outputs(linear)}, out.options());
  apply_linear(linear, normed.data(), H, logits.data_ptr<float>());
  // The caches with room grow by changing the given tensors' sizes, not by new tensors: none is made
  // or freed, and Python's caches need no new objects.
  std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> copied;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (auto [cache, grown] : {std::pair{&keys[i], longer[2 * i]}, std::pair{&values[i], longer[2 * i + 1]}})
      if (grown) {
        const std::vector<int64_t> strides = cache->strides().vec();  // not a view of what it overwrites
        cache->unsafeGetTensorImpl()->set_sizes_and_strides({1, KV, cache->size(2) + 1, D}, strides);
      }
    if (!longer[2 * i] || !longer[2 * i + 1]) copied.emplace_back(static_cast<int64_t>(i), keys[i], values[i]);
  }
  return {logits, copied, cache_read, cache_written};
}

}  // namespace tokenpath
