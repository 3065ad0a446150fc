// src/kernels/kv_tile_layout.hpp — where each K and V element of a KVCache lives: the one
// description of the cache's tile layout, used by its writer (KVCache::append / truncate,
// src/model/kv_cache.cpp) and its readers (the decode kernels, via DecodeArgs).
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
  /// Offsets of feature x of position `pos` inside its K tile (keys in lanes) and V tile (rows).
  static std::int64_t key_in_tile(std::int64_t pos, std::int64_t x) {
    return x * kKeyTile + pos % kKeyTile;
  }
  std::int64_t value_in_tile(std::int64_t pos, std::int64_t x) const {
    return pos % kKeyTile * head_dim + x;
  }
};

}  // namespace tokenmix::kernels
