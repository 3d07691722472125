// AMX tile set-up and the packings its bf16 products need.
//
// Every tile is configured as 16 rows x 64 bytes: an f32 accumulator of
// 16 x 16, or a bf16 operand of 16 x 32.  TDPBF16PS takes its B operand in
// "VNNI" order: row p holds, for each of 16 output columns, the pair of bf16
// values at reduction indices 2p and 2p + 1, packed into one 32-bit word.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "isa_namespace.hpp"

namespace graphattn {
namespace GRAPHATTN_ISA_NS {

constexpr int kTileRows = 16;
constexpr int kTileBf16Cols = 32;  // bf16 values in a 64-byte tile row

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// Loads the 8 x (16 x 64 B) configuration on this thread; pair with
// _tile_release() before the thread leaves the kernel.
inline void configure_tiles() {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = kTileRows;
    }
    _tile_loadconfig(&config);
}

// Tiles 0-3 hold a 2 x 2 block of 16 x 16 f32 accumulators C, tiles 4-5 the
// two 16-row bands of an A operand and tiles 6-7 the two 16-column halves of
// a B operand (the products themselves: tiles_2x2_split_product, amx_split.hpp).

// Stores (or loads) the 2 x 2 block of accumulator tiles 0-3 at c, rows c_row_bytes apart.
inline void store_tiles_2x2(float* c, int64_t c_row_bytes) {
    const int64_t band = 16 * (c_row_bytes / 4);
    _tile_stored(0, c, c_row_bytes);
    _tile_stored(1, c + 16, c_row_bytes);
    _tile_stored(2, c + band, c_row_bytes);
    _tile_stored(3, c + band + 16, c_row_bytes);
}

inline void load_tiles_2x2(const float* c, int64_t c_row_bytes) {
    const int64_t band = 16 * (c_row_bytes / 4);
    _tile_loadd(0, c, c_row_bytes);
    _tile_loadd(1, c + 16, c_row_bytes);
    _tile_loadd(2, c + band, c_row_bytes);
    _tile_loadd(3, c + band + 16, c_row_bytes);
}

}  // namespace GRAPHATTN_ISA_NS
}  // namespace graphattn
