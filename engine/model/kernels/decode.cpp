// decode_layers: a whole decode step of B sequences in one call (embedding, every layer, the last norm and
// the head), on the row functions the lean model's modules call one by one, growing the KV caches in place.
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/from_blob.h>

#include <strings.h>

#include <cstdlib>
#include <optional>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kernels.h"

namespace tokenpath {

static int64_t linear_outputs(const LinearForm& form) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  // PyTorch's int4 packing keeps N in its scales' shape, int8-dyn's packed blocks in their count of scales; the block
  // formats' groups of eight rows are padded, so their forms say N in the slot kind 3 gives its group size
  if (kind == 3) return scales->size(1);
  if (kind == 2) return scales->numel();
  return kind == 4 || kind == 5 ? group : w.size(0);
}

// Whether the layer's kernel takes its activations quantized per block (int4-dyn's, and the int8 blocks of its head).
static bool takes_blocks(const LinearForm& form) {
  const int64_t kind = std::get<0>(form);
  return kind == 4 || kind == 5;
}

// y = the layer applied to the M rows of x, K values each: the row functions above, no tensors in
// between. Each weight row is read once for all M rows, and a row's result does not depend on M. A layer that
// takes blocks takes `blocks` where given (x's rows already quantized), else quantizes x itself. gated (int8-dyn's
// fused gate/up without a bias): y holds silu(gate) * up, M rows of N / 2.
static void apply_linear(const LinearForm& form, const float* x, int64_t M, int64_t K, float* y,
                         const BlockActivations* blocks = nullptr, bool gated = false) {
  const auto& [kind, w, scales, sums, inv_smooth, group, bias] = form;
  const int64_t N = linear_outputs(form);
  std::optional<BlockActivations> own;
  if (takes_blocks(form) && blocks == nullptr) blocks = &own.emplace(x, M, K);
  TORCH_CHECK(!takes_blocks(form) || (blocks->M == M && blocks->K == K), "activations quantized for another shape");
  switch (kind) {
    case 0: small_linear_rows(x, M, w.data_ptr<float>(), N, K, y); break;
    case 1:
      int8_wo_rows(x, M, w.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(scales->data_ptr<at::BFloat16>()), N,
                   K, y);
      break;
    case 2:
      int8_dyn_rows(x, M, w.data_ptr<int8_t>(), scales->data_ptr<float>(), sums->data_ptr<int32_t>(), N, K, y,
                    inv_smooth.has_value() ? inv_smooth->data_ptr<float>() : nullptr, gated);
      break;
    case 3: {
      const auto rows = at::from_blob(const_cast<float*>(x), {M, K}, at::kFloat);
      const auto out = at::_weight_int4pack_mm_for_cpu(rows.to(at::kBFloat16), w, group, *scales).to(at::kFloat);
      std::memcpy(y, out.data_ptr<float>(), sizeof(float) * M * N);
      break;
    }
    case 5: int8_block_rows(*blocks, w.data_ptr<uint8_t>(), scales->data_ptr<at::Half>(), N, y); break;
    case 4:
      int4_dyn_rows(*blocks, w.data_ptr<uint8_t>(), scales->data_ptr<at::Half>(), sums->data_ptr<at::Half>(), N, y);
      break;
    default: TORCH_CHECK(false, "unknown linear kind ", kind);
  }
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
  }
}

// Whether OpenMP's threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, which the engine chooses on a
// busy machine before PyTorch loads OpenMP, or GOMP_SPINCOUNT=0): a region then takes about 8 microseconds to wake
// the other thread, against about 1 for a spinning one. OpenMP reads the variables once, as it loads; this reads
// them at the first decode step, the same values unless the process changed them in between.
static bool threads_sleep() {
  static const bool sleeping = [] {
    const char *policy = std::getenv("OMP_WAIT_POLICY"), *spins = std::getenv("GOMP_SPINCOUNT");
    return (policy != nullptr && strcasecmp(policy, "passive") == 0) ||
           (spins != nullptr && std::strcmp(spins, "0") == 0);
  }();
  return sleeping;
}

// The calling thread's OpenMP threads freed (its next parallel region starts them again). libgomp lets the threads
// of a region spin for the next one only while it manages no more threads than there are cores, and each thread
// that has run a region keeps threads of its own: an engine stepping in its own thread beside another thread's idle
// ones would wake its threads from sleep at every region, its steps taking a third longer or more.
void release_threads() {
#if defined(_OPENMP)  // omp_pause_resource_all: OpenMP 5.0, in GCC 9 and LLVM 8 and later
  omp_pause_resource_all(omp_pause_soft);
#endif
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
         cache.storage().nbytes() >= static_cast<size_t>(KV * head * cache.element_size());
}

// Where a cache's first value lies, or would lie in one that holds no position yet (whose data_ptr() is null).
static void* start_of(const at::Tensor& cache) {
  return static_cast<char*>(cache.storage().mutable_data()) + cache.storage_offset() * cache.element_size();
}

// Head g's new row, from row + g * D, written at position T of the cache of E whose heads start stride apart,
// rounded to nearest even where E is narrower (as a tensor's conversion rounds).
template <typename E>
static void write_position(E* cache, int64_t stride, int64_t T, const float* row, int64_t KV, int64_t D) {
  for (int64_t g = 0; g < KV; ++g)
    for (int64_t d = 0; d < D; ++d) cache[g * stride + T * D + d] = static_cast<E>(row[g * D + d]);
}

static void write_position(void* cache, at::ScalarType type, int64_t stride, int64_t T, const float* row, int64_t KV,
                           int64_t D) {
  switch (type) {
    case at::kFloat: return write_position(static_cast<float*>(cache), stride, T, row, KV, D);
    case at::kBFloat16: return write_position(static_cast<at::BFloat16*>(cache), stride, T, row, KV, D);
    case at::kHalf: return write_position(static_cast<at::Half*>(cache), stride, T, row, KV, D);
    default: TORCH_CHECK(false, "a cache of float32, bfloat16 or float16, not ", type);
  }
}

// A decode step of B sequences in one call from Python: each one's new token's embedding (ids [B]),
// every Llama decoder layer, then the last norm and the output head; sequence b's cos and sin are row
// rows[b] of the rotary tables [1, rows, head_dim], and its caches are keys and values [b * layers + i]
// (each [1, kv_heads, T_b, head_dim], the lengths free to differ; all float32, or all bfloat16 or float16, which
// attention widens to float32 as it reads them and the new positions are rounded to). Where shared_keys and
// shared_values are given (one entry a cache, None or [1, kv_heads, P, head_dim] of the same type, rows contiguous), a
// cache's sequence attends over the P positions there first, a kept prompt's that other sequences read too without a
// copy each, and over its own after them. Every product takes the B rows at
// once, so each weight is read once for all of them; attention runs per sequence over its own caches.
// The same row functions, in the same order, as the lean forward's modules run one by one, and a row's
// result does not depend on the rows beside it, so each sequence's logits are the same to the bit as
// when it is decoded alone, with no tensor made between the functions but a cache copied when its
// storage has no room left. A cache with room grows in place: the tensor given becomes [1, kv_heads,
// T + 1, head_dim]. Returns (logits [B, 1, vocabulary], (index, keys, values) of each cache pair that
// was copied instead, cache bytes read, cache bytes written); the bytes are what attention and the
// caches' growth moved, all sequences together.
std::tuple<at::Tensor, std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>>, int64_t, int64_t> decode_layers(
    at::Tensor ids, const DecodeForms& forms, at::Tensor cos_table, at::Tensor sin_table,
    std::vector<int64_t> rows, std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
    std::vector<c10::optional<at::Tensor>> shared_keys, std::vector<c10::optional<at::Tensor>> shared_values,
    int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling) {
  const auto& layers = forms.layers;
  const auto& embedding = forms.embedding;
  const int64_t B = static_cast<int64_t>(rows.size()), L = static_cast<int64_t>(layers.size());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.numel() == B && B > 0, "decode_layers takes one token id per row");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B * L && static_cast<int64_t>(values.size()) == B * L,
              "one cache per sequence and layer");
  TORCH_CHECK(shared_keys.size() == shared_values.size() && (shared_keys.empty() || shared_keys.size() == keys.size()),
              "a shared opening or None for each cache, or none at all");
  for (const auto* table : {&cos_table, &sin_table})
    for (int64_t row : rows)
      TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 3 &&
                      table->size(2) == head_dim && row >= 0 && row < table->size(1),
                  "cos and sin: float32 tables [1, rows, head_dim] holding the rows");
  const auto id_tensor = ids.contiguous();
  const int64_t* tokens = id_tensor.data_ptr<int64_t>();
  const int64_t H = embedding.size(1), D = head_dim, KV = kv_heads, rotated_heads = heads + kv_heads;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK_INDEX(tokens[b] >= 0 && tokens[b] < embedding.size(0), "token id ", tokens[b],
                      " is out of the embedding's range");
  auto out = embedding.new_empty({B, 1, H});
  float* residual = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(residual + b * H, embedding.data_ptr<float>() + tokens[b] * H, sizeof(float) * H);
  const float* cos = cos_table.data_ptr<float>();
  const float* sin = sin_table.data_ptr<float>();
  std::vector<float> normed(B * H), delta(B * H), rotated(B * rotated_heads * D), attended(B * heads * D), fused,
      gate_up, act;
  // Every cache is checked, and one without room for the new position copied into one with room, before the first
  // layer: a step that fails part-way leaves every cache as it was, and the layers write each sequence's new
  // position from plain pointers (reading 2 x B tensors' sizes and strides between the products of every layer
  // missed the cache for each). The caches grow by a position all together after the last layer.
  const at::ScalarType cache_type = keys.empty() ? at::kFloat : keys[0].scalar_type();
  TORCH_CHECK(attends_over(cache_type), "the caches keep float32, bfloat16 or float16, not ", cache_type);
  const int64_t position_bytes = KV * D * static_cast<int64_t>(c10::elementSize(cache_type));
  int64_t cache_read = 0, cache_written = 0;
  std::vector<CacheView> caches(keys.size());
  std::vector<char> moved(keys.size());  // the pair was copied into new storage
  for (size_t c = 0; c < keys.size(); ++c) {
    TORCH_CHECK(keys[c].dim() == 4 && keys[c].size(1) == KV && keys[c].size(3) == D &&
                    values[c].sizes() == keys[c].sizes() && keys[c].scalar_type() == cache_type &&
                    values[c].scalar_type() == cache_type,
                "a cache is not [1, kv_heads, T, head_dim] of the first one's type");
    const int64_t T = keys[c].size(2);
    const bool shares = !shared_keys.empty() && shared_keys[c].has_value();
    TORCH_CHECK(shares == (!shared_values.empty() && shared_values[c].has_value()),
                "a shared opening has keys and values");
    const int64_t P = shares ? shared_keys[c]->size(2) : 0;
    if (shares)
      for (const at::Tensor* opening : {&*shared_keys[c], &*shared_values[c]})
        TORCH_CHECK(opening->dim() == 4 && opening->size(0) == 1 && opening->size(1) == KV && opening->size(2) == P &&
                        opening->size(3) == D && opening->stride(3) == 1 && opening->stride(2) == D &&
                        opening->scalar_type() == cache_type,
                    "a shared opening is not [1, kv_heads, P, head_dim] of the caches' type, its rows contiguous");
    for (at::Tensor* cache : {&keys[c], &values[c]}) {
      cache_read += (P + T + 1) * position_bytes;  // attention reads the grown cache
      cache_written += position_bytes;
      if (has_room(*cache, KV, D)) continue;
      cache_read += T * position_bytes;  // and a cache without room is copied first
      cache_written += T * position_bytes;
      // copied into new storage with room up to the next multiple of kCacheRoom positions, counting a shared
      // opening's (the room a copy of the opening would have, which the batch engine's KV budget counts)
      *cache = copied_with_room(*cache, 0, T, (P + T + 1 + kCacheRoom - 1) / kCacheRoom * kCacheRoom - P);
      moved[c] = 1;
    }
    caches[c] = {start_of(keys[c]), start_of(values[c]), P + T, keys[c].stride(1), values[c].stride(1)};
    if (shares) {
      caches[c].shared_keys = shared_keys[c]->data_ptr();
      caches[c].shared_values = shared_values[c]->data_ptr();
      caches[c].P = P;
      caches[c].sk_stride = shared_keys[c]->stride(1);
      caches[c].sv_stride = shared_values[c]->stride(1);
    }
  }
  std::vector<CacheView> views(static_cast<size_t>(B));  // each sequence's caches of the layer, attended all together
  // The work row by row between the products, shared by the threads where there are rows enough: with fewer,
  // waking the other thread and waiting for it costs more than its half of the rows saves (a row's norm or SiLU
  // and quantization take a microsecond or two).
  const int64_t rows_to_share = threads_sleep() ? 16 : 4;
  auto each_row = [&](const auto& f) {
    if (B < rows_to_share) {
      for (int64_t b = 0; b < B; ++b) f(b);
      return;
    }
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) f(b);
    });
  };
  // The rows the block products take, quantized where the rows are made: [B, H] for the products of the normed
  // residual, [B, inner] for down's.
  BlockActivations narrow(B, H);
  std::optional<BlockActivations> wide;
  // Row b of the residual plus delta (the last product's rows, unless `added` is false), normed with norm's weight
  // into normed, and quantized where `next` takes blocks.
  auto added_and_normed = [&](int64_t b, bool added, const at::Tensor& norm, double eps, const LinearForm& next) {
    float* row = residual + b * H;
    if (added)
      for (int64_t k = 0; k < H; ++k) row[k] += delta[b * H + k];
    rms_norm_rows(row, norm.data_ptr<float>(), eps, 1, H, normed.data() + b * H);
    if (takes_blocks(next)) narrow.quantize_row(normed.data() + b * H, b);
  };
  for (int64_t i = 0; i < L; ++i) {
    const auto& [norm1, norm2, eps, qkv, o, up, down] = layers[i];
    each_row([&](int64_t b) { added_and_normed(b, i > 0, norm1, eps, qkv); });
    const int64_t width = linear_outputs(qkv);
    fused.resize(static_cast<size_t>(B * width));
    apply_linear(qkv, normed.data(), B, H, fused.data(), &narrow);
    each_row([&](int64_t b) {
      const CacheView& cache = caches[b * L + i];
      float* rot = rotated.data() + b * rotated_heads * D;
      const float* row = fused.data() + b * width;
      rotary_row(row, cos + rows[b] * D, sin + rows[b] * D, rotated_heads, D, rot, D);
      const int64_t own = cache.T - cache.P;  // the new position's index among the cache's own
      write_position(const_cast<void*>(cache.keys), cache_type, cache.k_stride, own, rot + heads * D, KV, D);
      write_position(const_cast<void*>(cache.values), cache_type, cache.v_stride, own, row + rotated_heads * D, KV, D);
      views[b] = cache;
      views[b].T += 1;
    });
    attend(rotated.data(), rotated_heads * D, D, views, heads, KV, D, static_cast<float>(scaling), attended.data(),
           cache_type);
    apply_linear(o, attended.data(), B, heads * D, delta.data());
    each_row([&](int64_t b) { added_and_normed(b, true, norm2, eps, up); });
    const int64_t inner = linear_outputs(up) / 2;
    act.resize(static_cast<size_t>(B * inner));
    // int8-dyn's product makes silu(gate) * up itself
    const bool gated = std::get<0>(up) == 2 && !std::get<6>(up).has_value();
    if (!gated) gate_up.resize(static_cast<size_t>(B * 2 * inner));
    apply_linear(up, normed.data(), B, H, gated ? act.data() : gate_up.data(), &narrow, gated);
    if (takes_blocks(down) && (!wide || wide->K != inner)) wide.emplace(B, inner);
    if (!gated || takes_blocks(down))
      each_row([&](int64_t b) {  // one pass over the rows: a pass can wake the other thread
        if (!gated) silu_mul_rows(gate_up.data() + b * 2 * inner, 1, inner, act.data() + b * inner);
        if (takes_blocks(down)) wide->quantize_row(act.data() + b * inner, b);
      });
    apply_linear(down, act.data(), B, inner, delta.data(), wide ? &*wide : nullptr);
  }
  const auto& [norm, eps, linear] = forms.head;
  each_row([&](int64_t b) { added_and_normed(b, L > 0, norm, eps, linear); });
  auto logits = out.new_empty({B, 1, linear_outputs(linear)});
  apply_linear(linear, normed.data(), B, H, logits.data_ptr<float>(), &narrow);
  // The caches grow by changing the tensors' sizes, not by new tensors: a cache with room is the one given, and
  // Python's caches need no new objects but for those copied.
  std::vector<std::tuple<int64_t, at::Tensor, at::Tensor>> copied;
  for (size_t c = 0; c < keys.size(); ++c) {
    for (at::Tensor* cache : {&keys[c], &values[c]}) {
      const std::vector<int64_t> strides = cache->strides().vec();  // not a view of what it overwrites
      cache->unsafeGetTensorImpl()->set_sizes_and_strides({1, KV, cache->size(2) + 1, D}, strides);
    }
    if (moved[c]) copied.emplace_back(static_cast<int64_t>(c), keys[c], values[c]);
  }
  return {logits, copied, cache_read, cache_written};
}

}  // namespace tokenpath
