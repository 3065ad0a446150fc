// src/kernels/kv_tile_layout.hpp — where each K and V element of a KVCache lives: the one
// description of the cache's tile layout, used by its writer (KVCache::append / truncate,
// src/model/kv_cache.cpp) and its readers (the decode kernels, via DecodeArgs).
//
// Per layer, the storage is [pool_blocks][H_kv][block_tokens / kKeyTile][K tile, V tile]:
//   K tile [d_h][kKeyTile]   the kKeyTile keys of a feature are contiguous (SIMD lanes)
//   V tile [kKeyTile][d_h]   rows
// so one (block, KV head) is a single forward stream of alternating K and V tiles. All offsets
// are in elements (multiply by the element size for bytes).
#pragma once

#include <cstdint>

namespace tokenmix::kernels {

struct KVTileLayout {
  /// Positions per tile: K is stored transposed in tiles of this many keys.
  static constexpr std::int64_t kKeyTile = 64;

  std::int64_t heads_kv = 0, head_dim = 0;
  std::int64_t block_tokens = 0;  // positions per block, a multiple of kKeyTile
  std::int64_t pool_blocks = 0;   // physical blocks per layer

  /// Elements of one K (or V) tile.
  std::int64_t tile_elems() const { return kKeyTile * head_dim; }
  /// Elements of one (block, KV head): its K and V tiles, block_tokens positions each.
  std::int64_t head_block_elems() const { return 2 * block_tokens * head_dim; }
  /// Elements of one layer.
  std::int64_t layer_elems() const { return pool_blocks * heads_kv * head_block_elems(); }

  /// Offset, from the layer's start, of the K tile holding position `pos` (of the block, any
  /// position of the tile) of physical block `block`, KV head `head`. Its V tile starts
  /// tile_elems() later (v_tile).
  std::int64_t k_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return (block * heads_kv + head) * head_block_elems() + pos / kKeyTile * 2 * tile_elems();
  }
  std::int64_t v_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return k_tile(block, head, pos) + tile_elems();
  }
  /// Offsets of feature x of position `pos` inside its K tile (keys in lanes) and V tile (rows).
  static std::int64_t key_in_tile(std::int64_t pos, std::int64_t x) {
    return x * kKeyTile + pos % kKeyTile;
  }
  std::int64_t value_in_tile(std::int64_t pos, std::int64_t x) const {
    return pos % kKeyTile * head_dim + x;
  }
};

}  // namespace tokenmix::kernels
