// src/kernels/kv_tile_layout.hpp — where each K and V element of a KVCache lives: the one
// description of the cache's tile layout, used by its writer (KVCache::append / truncate,
// src/decode/kv_cache.cpp) and its readers (the decode kernels, via DecodeArgs).
//
// Per layer, the storage is [pool_blocks][H_kv][block_tokens / kKeyTile][K tile, V tile]:
//   K tile [d_h][kKeyTile]   the kKeyTile keys of a feature are contiguous (SIMD lanes)
//   V tile [kKeyTile][d_h]   rows
// so one (block, KV head) is a single forward stream of alternating K and V tiles. All offsets
// are in elements (multiply by the element size for bytes).
//
// Quantized caches (int8, fp8 E4M3: one-byte elements, so elements = bytes) follow each tile with
// the fp32 scales δ of its kKeyTile rows (SPEC "Reduced precision → Quantized KV cache"):
//   K tile [d_h][kKeyTile] bytes, K scales [kKeyTile] f32, V tile [kKeyTile][d_h] bytes,
//   V scales [kKeyTile] f32
// (scale_elems = 4 · kKeyTile bytes; 64 · d_h is a multiple of 4, so the scales are aligned),
// and a decode unit still reads one forward stream, scales next to the tile they scale.
//
// int8 tiles (int8_quads) hold the same bytes in VNNI-4 quads (four consecutive elements of the
// products' reduction dimension in one 32-bit word), the operand layout of AMX-INT8's B tiles:
//   K tile [d_h / 4][kKeyTile][4]: features 4i .. 4i + 3 of a key in one word (d_h % 4 tail
//          features after them as [d_h % 4][kKeyTile] rows, the plain layout's rows x),
//   V tile [kKeyTile / 4][d_h][4]: keys 4i .. 4i + 3 of a feature in one word,
// same sizes. The tile products load them as they are (no per-tile rewrite), and the FMA products
// read a 64-byte row of words as 16 columns × 4 k (one byte shuffle per 16 elements moves element
// j of each word to its top byte: q · 2^24, then the conversion: microkernel-inl.h int8_quad_t).
#pragma once

#include <cstdint>

namespace tokenmix::kernels {

struct KVTileLayout {
  /// Positions per tile: K is stored transposed in tiles of this many keys.
  static constexpr std::int64_t kKeyTile = 64;

  std::int64_t heads_kv = 0, head_dim = 0;
  std::int64_t block_tokens = 0;  // positions per block, a multiple of kKeyTile
  std::int64_t pool_blocks = 0;   // physical blocks per layer
  /// Quantized caches: elements (= bytes) of the kKeyTile fp32 scales after each tile; else 0.
  std::int64_t scale_elems = 0;
  /// int8 caches: K and V tiles in VNNI-4 quads (see above).
  bool int8_quads = false;

  /// Bytes of the fp32 row scales following each tile of a quantized cache.
  static constexpr std::int64_t kScaleBytes = 4 * kKeyTile;

  /// Elements of one K (or V) tile.
  std::int64_t tile_elems() const { return kKeyTile * head_dim; }
  /// Elements from one tile's start to the next's: the tile plus its scales.
  std::int64_t tile_span() const { return tile_elems() + scale_elems; }
  /// Elements of one (block, KV head): its K and V tiles (and scales), block_tokens positions.
  std::int64_t head_block_elems() const { return 2 * (block_tokens / kKeyTile) * tile_span(); }
  /// Elements of one layer.
  std::int64_t layer_elems() const { return pool_blocks * heads_kv * head_block_elems(); }

  /// Offset, from the layer's start, of the K tile holding position `pos` (of the block, any
  /// position of the tile) of physical block `block`, KV head `head`. Its V tile starts
  /// tile_span() later (v_tile); a quantized tile's scales start tile_elems() after the tile
  /// (scales_of).
  std::int64_t k_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return (block * heads_kv + head) * head_block_elems() + pos / kKeyTile * 2 * tile_span();
  }
  std::int64_t v_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return k_tile(block, head, pos) + tile_span();
  }
  /// Quantized caches: offset of the [kKeyTile] fp32 scales of the tile at offset `tile`
  /// (row pos % kKeyTile's scale is element pos % kKeyTile of them).
  std::int64_t scales_of(std::int64_t tile) const { return tile + tile_elems(); }
  /// Offsets of feature x of position `pos` inside its K tile (keys in lanes) and V tile (rows);
  /// int8_quads: in their quads (K's d_h % 4 tail features in plain rows).
  std::int64_t key_in_tile(std::int64_t pos, std::int64_t x) const {
    const std::int64_t u = pos % kKeyTile;
    if (int8_quads && x < quad_features()) return x / 4 * 4 * kKeyTile + u * 4 + x % 4;
    return x * kKeyTile + u;
  }
  std::int64_t value_in_tile(std::int64_t pos, std::int64_t x) const {
    const std::int64_t u = pos % kKeyTile;
    if (int8_quads) return u / 4 * 4 * head_dim + x * 4 + u % 4;
    return u * head_dim + x;
  }
  /// int8_quads: K's features held in quads (d_h rounded down to a multiple of 4).
  std::int64_t quad_features() const { return head_dim / 4 * 4; }
};

}  // namespace tokenmix::kernels
