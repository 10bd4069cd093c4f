// The int8-dyn product on Intel AMX's tile registers, where the CPU has them: int8_dyn_rows (int8.cpp) hands its
// quantized activations here for several rows at once. One tile multiply adds 16 x 16 dot products of 64 byte pairs,
// where a VNNI instruction adds 16 of 4, and its sums are the same exact integers, so every output is the same to
// the bit whichever path computed it.
//
// The weights stay as int8_dyn_rows reads them ([N, K], a row per output): 16 of their rows, 64 bytes of each, are
// the left tile as they lie. The right tile wants each activation row's bytes four at a time down its columns, so
// the activations (far fewer bytes than the weights) are laid out that way once a call.
#include "kernels.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_INT8 1
#endif

namespace tokenpath {

#ifdef HAVE_AMX_INT8
constexpr int64_t kTile = 16;   // rows of a tile (outputs), and columns of the result (activation rows)
constexpr int64_t kDepth = 64;  // bytes of each weight row a tile multiply takes
constexpr int64_t kTileRows = 2;  // the fewest activation rows the tiles take; one row streams its weights as fast

// Linux lets a process use the tile registers once it asks for them (arch_prctl ARCH_REQ_XCOMP_PERM with
// XFEATURE_XTILEDATA); a thread that touches them before faults. Asked once; false where the kernel refuses.
static bool tiles_granted() {
  static const bool granted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

// Tiles 0 and 1: two blocks of 16 outputs' sums for `cols` activation rows (int32); 2 and 3: those blocks'
// weights, 64 bytes of 16 rows; 4: the activations' 64 bytes, four to a column.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void configure_tiles(int64_t cols) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = kTile;
    config.colsb[t] = static_cast<uint16_t>(t == 2 || t == 3 ? kDepth : cols * 4);
  }
  _tile_loadconfig(&config);
}

// The sums of weight rows [n, n + blocks * 16) against activation rows [m, m + cols), the activations laid out by
// tile_activations (their chunk at xt), into sums[b][i][j] (output n + 16 b + i, activation row m + j), each row of
// sums 16 long whatever `cols` is.
template <int Blocks>
static void tile_sums(const int8_t* w, int64_t K, const uint8_t* xt, int64_t cols, int32_t* sums) {
  _tile_zero(0);
  if (Blocks == 2) _tile_zero(1);
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(4, xt + k * cols, static_cast<int>(cols * 4));
    _tile_loadd(2, w + k, static_cast<int>(K));
    _tile_dpbssd(0, 2, 4);
    if (Blocks == 2) {
      _tile_loadd(3, w + kTile * K + k, static_cast<int>(K));
      _tile_dpbssd(1, 3, 4);
    }
  }
  _tile_stored(0, sums, kTile * 4);
  if (Blocks == 2) _tile_stored(1, sums + kTile * kTile, kTile * 4);
}

// The 16 x 16 int32 in r transposed in place: r[j][i] becomes r[i][j]. Four rounds of shuffles (pairs of lanes, of
// 64-bit pairs, of 128-bit quarters twice), where gathering a column costs a load per lane.
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// y[j * y_stride + i] = float(sums[i][j]) * xs[j] * sp[i] for a block's 16 outputs i and `cols` activation rows j
// (sums' rows 16 apart, the columns past `cols` unused), the operations of int8_dyn_rows in its order.
static void scale_sums(const int32_t* sums, int64_t cols, const float* xs, const float* sp, float* y,
                       int64_t y_stride) {
  __m512i rows[16];
  for (int i = 0; i < 16; ++i) rows[i] = _mm512_loadu_si512(sums + i * kTile);
  transpose16(rows);
  const __m512 scales = _mm512_loadu_ps(sp);
  for (int64_t j = 0; j < cols; ++j) {
    const __m512 column = _mm512_cvtepi32_ps(rows[j]);
    _mm512_storeu_ps(y + j * y_stride, _mm512_mul_ps(_mm512_mul_ps(column, _mm512_set1_ps(xs[j])), scales));
  }
}

// Activation rows [m, m + cols) of xq [M, K] laid out as the right tiles take them: for each 64 bytes of K, 16
// rows of `cols` columns, column j of row r holding bytes 4r .. 4r + 3 of that stretch of activation row m + j. A
// full chunk's stretch is a 16 x 16 transpose of four-byte groups.
static void tile_activations(const int8_t* xq, int64_t K, int64_t m, int64_t cols, int8_t* xt) {
  if (cols == kTile) {
    for (int64_t k = 0; k < K; k += kDepth) {
      __m512i rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(xq + (m + j) * K + k);
      transpose16(rows);
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(xt + k * kTile + r * kDepth, rows[r]);
    }
    return;
  }
  for (int64_t k = 0; k < K; k += 4)
    for (int64_t j = 0; j < cols; ++j) std::memcpy(xt + k * cols + 4 * j, xq + (m + j) * K + k, 4);
}

bool int8_tile_rows(const int8_t* xq, const float* xs, int64_t M, const int8_t* wp, const float* sp, int64_t N,
                    int64_t K, float* yp) {
  if (M < kTileRows || K % kDepth != 0 || N % kTile != 0 || !tiles_granted()) return false;
  const int64_t chunks = (M + kTile - 1) / kTile;
  std::vector<int8_t> laid(static_cast<size_t>(M * K));
  // a few chunks (a decode step's rows) laid out on this thread: waking the other costs more than their bytes
  at::parallel_for(0, chunks, std::max<int64_t>(1, (int64_t{1} << 16) / (kTile * K)), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      tile_activations(xq, K, c * kTile, std::min(kTile, M - c * kTile), laid.data() + c * kTile * K);
  });
  const int64_t pairs = N / kTile / 2, blocks = N / kTile;
  shared_rows((blocks + 1) / 2, 2 * kTile * K, [&](int64_t begin, int64_t end) {
    int32_t sums[2 * kTile * kTile] = {};
    int64_t configured = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m = c * kTile, cols = std::min(kTile, M - m);
      if (cols != configured) configure_tiles(configured = cols);
      const uint8_t* xt = reinterpret_cast<const uint8_t*>(laid.data() + m * K);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n = 2 * p * kTile, count = p < pairs ? 2 : 1;
        if (count == 2) tile_sums<2>(wp + n * K, K, xt, cols, sums);
        else tile_sums<1>(wp + n * K, K, xt, cols, sums);
        for (int64_t b = 0; b < count; ++b)
          scale_sums(sums + b * kTile * kTile, cols, xs + m, sp + n + b * kTile, yp + m * N + n + b * kTile, N);
      }
    }
    _tile_release();
  });
  return true;
}

bool has_amx_tiles() { return tiles_granted(); }
#else
bool int8_tile_rows(const int8_t*, const float*, int64_t, const int8_t*, const float*, int64_t, int64_t, float*) {
  return false;
}

bool has_amx_tiles() { return false; }
#endif

}  // namespace tokenpath
