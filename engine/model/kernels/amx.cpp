// The int8-dyn product on Intel AMX's tile registers, where the CPU has them: int8_dyn_rows (int8.cpp) hands its
// quantized activations here for several rows at once. One tile multiply adds 16 x 16 dot products of 64 byte pairs,
// where a VNNI instruction adds 16 of 4, and its sums are the same exact integers, so every output is the same to
// the bit whichever path computed it.
//
// The left tile is 16 activation rows, 64 bytes of each, as they lie; the right tile is 16 rows of a block of packed
// weights, each the block's 16 outputs' four bytes (int8.cpp), which is how the tiles want it. A result tile's row
// is then 16 outputs of one activation row: stored, scaled and written as they are, or, for a fused gate/up product,
// taken with the up's 16 beside them into silu(gate) * up, so the gate/up outputs are never written at all.
#include "kernels.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX_INT8 1
#endif

namespace tokenpath {

#ifdef HAVE_AMX_INT8
constexpr int64_t kTile = kSumRows;  // rows of a tile: activation rows on the left, 4-byte groups of inputs on the right
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

// Tiles 0 and 1: two blocks' sums for `rows` activation rows (int32, 16 outputs a row); 2 and 3: those blocks'
// weights, 64 bytes of inputs; 4: the activations' 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = static_cast<uint8_t>(t == 2 || t == 3 ? kTile : rows);
    config.colsb[t] = kDepthBytes;
  }
  _tile_loadconfig(&config);
}

// The sums of activation rows x (Kp bytes apart, as many as configured) against packed weight block w (and block
// next, when Blocks is 2) into sums[b][row][output].
template <int Blocks>
static void tile_sums(const int8_t* x, int64_t Kp, const int8_t* w, const int8_t* next, int32_t* sums) {
  _tile_zero(0);
  if (Blocks == 2) _tile_zero(1);
  for (int64_t k = 0; k < Kp; k += kDepthBytes) {
    _tile_loadd(4, x + k, static_cast<int>(Kp));
    _tile_loadd(2, w + k * kOutBlock, static_cast<int>(kDepthBytes));
    _tile_dpbssd(0, 4, 2);
    if (Blocks == 2) {
      _tile_loadd(3, next + k * kOutBlock, static_cast<int>(kDepthBytes));
      _tile_dpbssd(1, 4, 3);
    }
  }
  _tile_stored(0, sums, kOutBlock * 4);
  if (Blocks == 2) _tile_stored(1, sums + kTile * kOutBlock, kOutBlock * 4);
}

bool int8_tile_rows(const int8_t* xq, const float* xs, int64_t M, int64_t Kp, const int8_t* wp, const float* sp,
                    int64_t N, float* yp, bool gated) {
  const int64_t blocks = (N + kOutBlock - 1) / kOutBlock, half = N / 2 / kOutBlock;
  if (M < kTileRows || (gated && N % (2 * kOutBlock) != 0) || !tiles_granted()) return false;
  // pair p: blocks 2p and 2p + 1, or (gated) the gate's block p and the up's block p
  const int64_t pairs = gated ? half : (blocks + 1) / 2, chunks = (M + kTile - 1) / kTile, full = M / kTile;
  // each pair of weight blocks (kept in the nearest cache) against every chunk of activation rows in turn; the full
  // chunks first, then the rest, so the tiles are configured twice a share at most
  shared_rows(pairs, 2 * kOutBlock * Kp * M, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[2 * kTile * kOutBlock];
    for (const auto& [first, last] : {std::pair{int64_t{0}, full}, std::pair{full, chunks}}) {
      if (first == last) continue;
      const int64_t rows = std::min(kTile, M - first * kTile);
      configure_tiles(rows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = gated ? p : 2 * p, next = gated ? p + half : b + 1;
        for (int64_t c = first; c < last; ++c) {
          const int8_t* x = xq + c * kTile * Kp;
          if (next < blocks) tile_sums<2>(x, Kp, wp + b * kOutBlock * Kp, wp + next * kOutBlock * Kp, sums);
          else tile_sums<1>(x, Kp, wp + b * kOutBlock * Kp, nullptr, sums);
          write_rows(sums, c * kTile, rows, b, next, gated, xs, sp, N, yp);
        }
      }
    }
    _tile_release();
  });
  return true;
}

bool has_amx_tiles() { return tiles_granted(); }
#else
bool int8_tile_rows(const int8_t*, const float*, int64_t, int64_t, const int8_t*, const float*, int64_t, float*,
                    bool) {
  return false;
}

bool has_amx_tiles() { return false; }
#endif

}  // namespace tokenpath
