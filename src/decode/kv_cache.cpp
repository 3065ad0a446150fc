// src/decode/kv_cache.cpp — KVCache: contiguous and paged K/V storage for decoding (SPEC 4.8).
// Layout and guarantees: tokenmix/kv_cache.hpp. Every method validates first and mutates after,
// so a throwing call leaves the cache byte-for-byte unchanged.
#include "tokenmix/kv_cache.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

#include "decode/kv_cache_access.hpp"
#include "kernels/kv_element.hpp"
#include "tokenmix/error.hpp"
#include "util/huge_pages.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::checked_mul;
using detail::fail;

std::string str(std::int64_t x) {
  return std::to_string(x);
}

}  // namespace

std::uint64_t kv_cache_bytes(std::int64_t n_layers, std::int64_t batch, std::int64_t tokens,
                             std::int64_t heads_kv, std::int64_t head_dim,
                             std::size_t element_bytes) {
  constexpr const char* fn = "kv_cache_bytes";
  const std::pair<const char*, std::int64_t> args[] = {{"n_layers", n_layers},
                                                       {"batch", batch},
                                                       {"tokens", tokens},
                                                       {"heads_kv", heads_kv},
                                                       {"head_dim", head_dim}};
  for (auto [name, x] : args) {
    if (x < 0)
      fail(ErrorCode::invalid_argument, fn,
           std::string(name) + " must be >= 0; got " + std::to_string(x));
  }
  if (element_bytes > static_cast<std::size_t>(INT64_MAX)) {
    fail(ErrorCode::overflow, fn, "element_bytes is too large");
  }
  // bytes = 2 · n · B · T · H_kv · d_h · sizeof(element)   (SPEC 4.8)
  std::int64_t bytes = 2;
  for (auto [name, x] : args) bytes = checked_mul(bytes, x, fn, "the KV-cache size");
  bytes = checked_mul(bytes, static_cast<std::int64_t>(element_bytes), fn, "the KV-cache size");
  return static_cast<std::uint64_t>(bytes);
}

DType parse_cache_dtype(const std::string& text, const char* what) {
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::int8, DType::fp8_e4m3}) {
    if (text == to_string(d)) return d;
  }
  fail(ErrorCode::invalid_argument, "parse_cache_dtype",
       std::string(what) + " must be f32, bf16, f16, int8 or fp8_e4m3; got '" + text + "'");
}

KVCache::KVCache(const KVCacheConfig& c) : config_(c) {
  constexpr const char* fn = "KVCache";
  const std::pair<const char*, std::int64_t> sizes[] = {{"config.layers", c.layers},
                                                        {"config.batch", c.batch},
                                                        {"config.heads_kv", c.heads_kv},
                                                        {"config.head_dim", c.head_dim},
                                                        {"config.capacity", c.capacity}};
  for (auto [name, x] : sizes) {
    if (x < 1)
      fail(ErrorCode::invalid_argument, fn, std::string(name) + " must be >= 1; got " + str(x));
  }
  if (c.dtype != DType::f32 && c.dtype != DType::bf16 && c.dtype != DType::f16 &&
      !kernels::is_quantized(c.dtype)) {
    fail(ErrorCode::invalid_argument, fn,
         "config.dtype must be f32, bf16, f16, int8 or fp8_e4m3; got the value " +
             str(static_cast<int>(c.dtype)));
  }
  if (c.int8_quads.has_value() && c.dtype != DType::int8) {
    fail(ErrorCode::invalid_argument, fn,
         std::string("config.int8_quads applies to an int8 cache only; got it set (") +
             (*c.int8_quads ? "true" : "false") + ") with config.dtype " + to_string(c.dtype));
  }
  // int8: quads where AMX-INT8 can take the tiles as they are, rows elsewhere (KVCacheConfig).
  // The layout follows the config, never the CPU: a cache is laid out the same on every machine
  // (rows unless quads are asked for; docs/design.md, "The KV cache and decode").
  int8_quads_ = c.dtype == DType::int8 && c.int8_quads.value_or(false);
  if (c.block_tokens < 0 || c.block_tokens % kKeyTile != 0) {
    fail(ErrorCode::invalid_argument, fn,
         "config.block_tokens must be 0 (contiguous) or a positive multiple of " + str(kKeyTile) +
             "; got " + str(c.block_tokens));
  }
  if (c.pool_blocks < 0) {
    fail(ErrorCode::invalid_argument, fn,
         "config.pool_blocks must be >= 0; got " + str(c.pool_blocks));
  }
  if (c.block_tokens == 0 && c.pool_blocks != 0) {
    fail(ErrorCode::invalid_argument, fn,
         "config.pool_blocks applies to a paged cache only (config.block_tokens > 0); got "
         "pool_blocks = " +
             str(c.pool_blocks));
  }
  if (c.window < 0) {
    fail(ErrorCode::invalid_argument, fn,
         "config.window must be >= 0 (0 = keep every position, W >= 1 = rolling buffer); got " +
             str(c.window));
  }
  // A rolling cache's memory does not depend on the capacity (any value up to 2^63 − 1); the
  // ring size R = round_up(W + 64, block) must fit.
  const std::int64_t ring_block = c.block_tokens != 0 ? c.block_tokens : kKeyTile;
  if (c.window > 0 && c.window > INT64_MAX / 2 - 2 * ring_block)
    fail(ErrorCode::overflow, fn, "config.window is too large; got " + str(c.window));
  if (c.window == 0 && c.capacity > INT64_MAX - kKeyTile)
    fail(ErrorCode::overflow, fn, "config.capacity is too large");
  elem_ = size_of(c.dtype);
  if (c.window > 0) {
    // R: W plus at least one 64-position tile of slack, a whole number of blocks.
    ring_ = (c.window + kKeyTile + ring_block - 1) / ring_block * ring_block;
  }
  if (c.block_tokens ==
      0) {  // contiguous: one block of T_max (rounded up to a key tile) per sequence, or the ring
    block_tokens_ = ring_ != 0 ? ring_ : (c.capacity + kKeyTile - 1) / kKeyTile * kKeyTile;
    pool_blocks_ = c.batch;
  } else {
    block_tokens_ = c.block_tokens;
    const std::int64_t per_seq = blocks_needed(ring_ != 0 ? ring_ : c.capacity);
    pool_blocks_ =
        c.pool_blocks != 0 ? c.pool_blocks : checked_mul(c.batch, per_seq, fn, "pool size");
  }
  if (pool_blocks_ > INT32_MAX) fail(ErrorCode::overflow, fn, "the pool exceeds 2^31 - 1 blocks");
  table_width_ = blocks_needed(ring_ != 0 ? ring_ : c.capacity);
  // Every allocation's size in bytes fits 64-bit arithmetic before the first one is made: the
  // block table (int32 per entry), the lengths and first positions (int64 per (layer, sequence)).
  const std::int64_t table_entries = checked_mul(c.batch, table_width_, fn, "block table size");
  checked_mul(table_entries, std::int64_t{sizeof(std::int32_t)}, fn, "block table bytes");
  const std::int64_t length_entries = checked_mul(c.layers, c.batch, fn, "lengths");
  checked_mul(length_entries, std::int64_t{sizeof(std::int64_t)}, fn, "lengths bytes");
  // Storage = SPEC 4.8's figure with B · T = pool_blocks · block_tokens (kv_cache_bytes checks
  // overflow). A quantized cache (SPEC "Quantized KV cache"; KVTileLayout) holds per 64-position
  // tile pair of a KV head: the K tile (64 · d_h bytes) and its d_h fp32 channel scales (padded
  // to 64 bytes), the V tile (64 · d_h bytes) and its 64 fp32 row scales; after the layers, the
  // staging region: one open fp32 K tile [d_h][64] per (layer, sequence, KV head)
  // (docs/performance.md, D-kv-1).
  const bool quantized = kernels::is_quantized(c.dtype);
  if (quantized && c.head_dim > (INT64_MAX - 64) / 4 / 64)
    fail(ErrorCode::overflow, fn, "config.head_dim is too large; got " + str(c.head_dim));
  std::uint64_t bytes = 0;
  if (quantized) {
    const std::int64_t pair = 2 * kKeyTile * c.head_dim +
                              kernels::KVTileLayout::key_scale_bytes(c.head_dim) +
                              kernels::KVTileLayout::kValueScaleBytes;
    std::int64_t tiles = checked_mul(c.layers, pool_blocks_, fn, "the KV-cache size");
    tiles = checked_mul(tiles, c.heads_kv, fn, "the KV-cache size");
    tiles = checked_mul(tiles, block_tokens_ / kKeyTile, fn, "the KV-cache size");
    const std::int64_t tile_bytes = checked_mul(tiles, pair, fn, "the KV-cache size");
    std::int64_t open = checked_mul(c.layers, c.batch, fn, "the KV-cache size");
    open = checked_mul(open, c.heads_kv, fn, "the KV-cache size");
    open = checked_mul(open, 4 * kKeyTile * c.head_dim, fn, "the KV-cache size");
    if (tile_bytes > INT64_MAX - open) fail(ErrorCode::overflow, fn, "the KV-cache size overflows");
    staging_begin_ = tile_bytes;
    bytes = static_cast<std::uint64_t>(tile_bytes + open);
  } else {
    bytes = kv_cache_bytes(c.layers, pool_blocks_, block_tokens_, c.heads_kv, c.head_dim, elem_);
  }
  const double total = static_cast<double>(bytes) + 4.0 * static_cast<double>(table_entries) +
                       16.0 * static_cast<double>(length_entries);
  const double physical = detail::physical_memory_bytes();
  if (physical > 0 && total > physical) {
    throw ResourceError(ErrorCode::out_of_memory,
                        std::string(fn) + ": cannot allocate the cache: " + str(bytes) +
                            " bytes of K/V storage (" + str(table_entries) +
                            " block table entries) are more than the machine's physical memory, " +
                            str(static_cast<std::int64_t>(physical)) + " bytes");
  }
  try {
    storage_.assign(static_cast<std::size_t>(bytes), std::byte{0});
    table_.assign(static_cast<std::size_t>(table_entries), -1);
    lengths_.assign(static_cast<std::size_t>(length_entries), 0);
    firsts_.assign(lengths_.size(), 0);
    active_.assign(static_cast<std::size_t>(c.batch), 1);
  } catch (const std::bad_alloc&) {  // also std::length_error's sizes past max_size()
    throw ResourceError(ErrorCode::out_of_memory,
                        std::string(fn) + ": cannot allocate the cache (" + str(bytes) +
                            " bytes of K/V storage, " + str(table_entries) +
                            " block table entries, " + str(length_entries) + " lengths)");
  } catch (const std::length_error&) {
    throw ResourceError(ErrorCode::out_of_memory,
                        std::string(fn) + ": the cache's sizes exceed what can be allocated (" +
                            str(bytes) + " bytes of K/V storage, " + str(table_entries) +
                            " block table entries)");
  }
  detail::back_with_huge_pages(storage_.data(), storage_.size());  // swept by every decode step
  if (!paged()) {
    for (std::int64_t b = 0; b < c.batch; ++b)
      table_[static_cast<std::size_t>(b * table_width_)] = static_cast<std::int32_t>(b);
  } else {
    free_list_.reserve(static_cast<std::size_t>(pool_blocks_));
    // Popped from the back: block 0 is handed out first.
    for (std::int64_t p = pool_blocks_ - 1; p >= 0; --p)
      free_list_.push_back(static_cast<std::int32_t>(p));
  }
}

std::uint64_t KVCache::memory_bytes() const noexcept {
  return storage_.size() + table_.capacity() * sizeof(std::int32_t) +
         (lengths_.capacity() + firsts_.capacity()) * sizeof(std::int64_t) + active_.capacity() +
         free_list_.capacity() * sizeof(std::int32_t) + sizeof(KVCache);
}

void KVCache::check_seq(const char* fn, std::int64_t seq) const {
  if (seq < 0 || seq >= config_.batch) {
    fail(ErrorCode::invalid_argument, fn,
         "seq must be in [0, batch = " + str(config_.batch) + "); got " + str(seq));
  }
}

void KVCache::check_layer(const char* fn, std::int64_t layer) const {
  if (layer < 0 || layer >= config_.layers) {
    fail(ErrorCode::invalid_argument, fn,
         "layer must be in [0, layers = " + str(config_.layers) + "); got " + str(layer));
  }
}

std::int64_t KVCache::length(std::int64_t seq, std::int64_t layer) const {
  check_seq("KVCache::length", seq);
  check_layer("KVCache::length", layer);
  return lengths_[static_cast<std::size_t>(layer * config_.batch + seq)];
}

std::int64_t KVCache::first_position(std::int64_t seq, std::int64_t layer) const {
  check_seq("KVCache::first_position", seq);
  check_layer("KVCache::first_position", layer);
  return firsts_[static_cast<std::size_t>(layer * config_.batch + seq)];
}

bool KVCache::active(std::int64_t seq) const {
  check_seq("KVCache::active", seq);
  return active_[static_cast<std::size_t>(seq)] != 0;
}

std::int64_t KVCache::blocks_needed(std::int64_t tokens) const noexcept {
  // ⌈tokens / block_tokens⌉ without forming tokens + block_tokens − 1 (both may be near 2^63).
  return tokens / block_tokens_ + (tokens % block_tokens_ != 0 ? 1 : 0);
}

std::int64_t KVCache::max_length(std::int64_t seq) const noexcept {
  std::int64_t m = 0;
  for (std::int64_t l = 0; l < config_.layers; ++l)
    m = std::max(m, lengths_[static_cast<std::size_t>(l * config_.batch + seq)]);
  return m;
}

void KVCache::missing_ring_blocks(std::int64_t seq, std::int64_t from, std::int64_t to,
                                  std::vector<std::int64_t>& out) const {
  // Only the last R positions of [from, to) are written; they touch each ring block at most once
  // per lap, and a block is listed once.
  from = std::max(from, to - ring_);
  const std::size_t first_new = out.size();
  for (std::int64_t pos = from; pos < to;) {
    const std::int64_t i = slot(pos) / block_tokens_;
    if (table_[static_cast<std::size_t>(seq * table_width_ + i)] < 0 &&
        std::find(out.begin() + static_cast<std::ptrdiff_t>(first_new), out.end(), i) == out.end())
      out.push_back(i);
    const std::int64_t block_start = pos - pos % block_tokens_;  // next block, without overflow
    if (block_start >= to - block_tokens_) break;
    pos = block_start + block_tokens_;
  }
}

// Positions, capacity and (paged) free blocks for appending T_new positions to each sequence of
// [first_seq, first_seq + seqs) of `layer`, before anything is written.
void KVCache::check_growth(const char* fn, std::int64_t layer, std::int64_t first_seq,
                           std::int64_t seqs, std::int64_t tnew) const {
  std::int64_t new_blocks = 0;
  std::vector<std::int64_t> ring_blocks;
  for (std::int64_t b = first_seq; b < first_seq + seqs; ++b) {
    if (!active_[static_cast<std::size_t>(b)]) {
      fail(ErrorCode::invalid_argument, fn,
           "sequence " + str(b) + " was released; reset(" + str(b) + ") it before appending");
    }
    const std::int64_t len = lengths_[static_cast<std::size_t>(layer * config_.batch + b)];
    std::int64_t end = 0;
    if (__builtin_add_overflow(len, tnew, &end)) {
      fail(ErrorCode::overflow, fn,
           "position length + T_new of sequence " + str(b) + " overflows 64-bit arithmetic (" +
               str(len) + " + " + str(tnew) + ")");
    }
    if (end > config_.capacity) {
      fail(ErrorCode::invalid_argument, fn,
           "appending T_new = " + str(tnew) + " positions to sequence " + str(b) + " (length " +
               str(len) + ") exceeds the capacity T_max = " + str(config_.capacity));
    }
    if (paged() && ring_ != 0) {
      ring_blocks.clear();
      missing_ring_blocks(b, len, end, ring_blocks);
      new_blocks += static_cast<std::int64_t>(ring_blocks.size());
    } else if (paged()) {
      new_blocks += std::max<std::int64_t>(0, blocks_needed(end) - blocks_needed(max_length(b)));
    }
  }
  if (new_blocks > free_blocks()) {
    fail(ErrorCode::invalid_argument, fn,
         "the block pool has " + str(free_blocks()) + " free blocks of " + str(block_tokens_) +
             " positions; this append needs " + str(new_blocks));
  }
}

// Quantized caches: every row of k and v must be finite (no finite scale δ represents NaN or
// ±∞, SPEC "Quantized KV cache"); checked before anything is written.
void KVCache::check_finite_rows(const char* fn, const ConstTensorView& k,
                                const ConstTensorView& v) const {
  const std::pair<const char*, const ConstTensorView*> views[] = {{"k", &k}, {"v", &v}};
  for (auto [name, view] : views) {
    const auto* p = static_cast<const float*>(view->data);
    for (std::int64_t b = 0; b < view->dim(0); ++b)
      for (std::int64_t t = 0; t < view->dim(1); ++t)
        for (std::int64_t h = 0; h < view->dim(2); ++h)
          for (std::int64_t x = 0; x < view->dim(3); ++x) {
            const float e = p[b * view->strides[0] + t * view->strides[1] + h * view->strides[2] +
                              x * view->strides[3]];
            if (!std::isfinite(e)) {
              fail(ErrorCode::invalid_argument, fn,
                   std::string(name) + "[" + str(b) + ", " + str(t) + ", " + str(h) + ", " +
                       str(x) + "] is " + std::to_string(e) + "; a " + to_string(config_.dtype) +
                       " cache stores finite rows only (no finite scale represents NaN or "
                       "inf); nothing was appended");
            }
          }
  }
}

void KVCache::append(std::int64_t layer, std::int64_t first_seq, ConstTensorView k,
                     ConstTensorView v) {
  constexpr const char* fn = "KVCache::append";
  check_layer(fn, layer);
  detail::check_view(k, 4, fn, "k");
  detail::check_view(v, 4, fn, "v");
  const std::int64_t seqs = k.dim(0), tnew = k.dim(1);
  if (first_seq < 0 || first_seq > config_.batch || seqs > config_.batch - first_seq) {
    fail(ErrorCode::invalid_argument, fn,
         "sequences [first_seq, first_seq + k.shape[0]) must lie in [0, batch = " +
             str(config_.batch) + "); got first_seq = " + str(first_seq) +
             ", k.shape[0] = " + str(seqs));
  }
  detail::check_dim(k, 2, config_.heads_kv, fn, "k", "H_kv", "the cache's heads_kv");
  detail::check_dim(k, 3, config_.head_dim, fn, "k", "d_h", "the cache's head_dim");
  for (int axis = 0; axis < 4; ++axis) {
    const char* names[] = {"B", "T_new", "H_kv", "d_h"};
    detail::check_dim(v, axis, k.dim(axis), fn, "v", names[axis],
                      ("k.shape[" + str(axis) + "]").c_str());
  }
  check_growth(fn, layer, first_seq, seqs, tnew);
  const bool quantized = kernels::is_quantized(config_.dtype);
  if (quantized) check_finite_rows(fn, k, v);
  std::vector<std::int64_t> ring_blocks;  // rolling and paged: blocks one sequence still needs
  ring_blocks.reserve(static_cast<std::size_t>(table_width_));  // before anything is written
  if (tnew == 0 || seqs == 0) return;

  const auto* kp = static_cast<const float*>(k.data);
  const auto* vp = static_cast<const float*>(v.data);
  const std::int64_t H = config_.heads_kv, D = config_.head_dim;
  const kernels::KVTileLayout tiles = detail::KVCacheAccess::layout(*this);  // = what decode reads
  std::byte* layer_data =
      storage_.data() + static_cast<std::size_t>(layer * tiles.layer_elems()) * elem_;
  for (std::int64_t bi = 0; bi < seqs; ++bi) {
    const std::int64_t b = first_seq + bi;
    std::int64_t& len = lengths_[static_cast<std::size_t>(layer * config_.batch + b)];
    if (paged() && ring_ != 0) {  // take the ring blocks the new positions land in
      ring_blocks.clear();
      missing_ring_blocks(b, len, len + tnew, ring_blocks);
      for (std::int64_t i : ring_blocks) {
        table_[static_cast<std::size_t>(b * table_width_ + i)] = free_list_.back();
        free_list_.pop_back();
      }
    } else if (paged()) {  // take blocks for positions beyond what any layer already holds
      for (std::int64_t i = blocks_needed(max_length(b)); i < blocks_needed(len + tnew); ++i) {
        table_[static_cast<std::size_t>(b * table_width_ + i)] = free_list_.back();
        free_list_.pop_back();
      }
    }
    // Rolling: positions older than the last R of the sequence are not written (they would be
    // overwritten within this call); those that fall out of the ring are overwritten by the
    // newer positions sharing their slots. Quantized: from the start of the tile of the first
    // one written (R is a multiple of 64: a tile's keys close together), and an open tile left
    // behind is dropped from the staging region.
    std::int64_t t_first = ring_ != 0 ? std::max<std::int64_t>(0, tnew - ring_) : 0;
    if (quantized && t_first > 0) {
      t_first = std::max<std::int64_t>(0, (len + t_first) / kKeyTile * kKeyTile - len);
      if (t_first > 0 && len % kKeyTile != 0) {
        for (std::int64_t h = 0; h < H; ++h)
          std::fill_n(storage_.data() + staging_offset(layer, b, h), 4 * kKeyTile * D,
                      std::byte{0});
      }
    }
    for (std::int64_t t = t_first; t < tnew; ++t) {
      const std::int64_t pos = slot(len + t);
      const std::int64_t blk =
          table_[static_cast<std::size_t>(b * table_width_ + pos / block_tokens_)];
      const std::int64_t off = pos % block_tokens_;
      for (std::int64_t h = 0; h < H; ++h) {
        // K: lane off % 64 of its tile's [d_h][64];  V: row off % 64 of its tile's [64][d_h].
        const std::int64_t kt = tiles.k_tile(blk, h, off), vt = tiles.v_tile(blk, h, off);
        const float* krow = kp + bi * k.strides[0] + t * k.strides[1] + h * k.strides[2];
        const float* vrow = vp + bi * v.strides[0] + t * v.strides[1] + h * v.strides[2];
        if (quantized) {
          // SPEC "Quantized KV cache": K into the open tile (fp32, lane off % 64), quantized per
          // channel when the tile closes (its 64th key); V per row now, its δ in the scales.
          const std::int64_t lane = off % kKeyTile;
          auto* open = reinterpret_cast<float*>(storage_.data() + staging_offset(layer, b, h));
          for (std::int64_t x = 0; x < D; ++x) open[x * kKeyTile + lane] = krow[x * k.strides[3]];
          const std::int64_t v_step = tiles.value_in_tile(off, D > 1 ? 1 : 0) -
                                      tiles.value_in_tile(off, 0);  // 1 (rows) or 4 (quads)
          const float dv = kernels::quantize_row(config_.dtype, vrow, v.strides[3], D,
                                                 layer_data + vt + tiles.value_in_tile(off, 0),
                                                 D > 1 ? v_step : 1);
          std::memcpy(layer_data + tiles.scales_of(vt) + lane * 4, &dv, sizeof dv);
          if (lane == kKeyTile - 1) close_tile(layer, b, h, blk, off);
          continue;
        }
        for (std::int64_t x = 0; x < D; ++x) {
          kernels::store_element(config_.dtype, layer_data, kt + tiles.key_in_tile(off, x),
                                 krow[x * k.strides[3]]);
          kernels::store_element(config_.dtype, layer_data, vt + tiles.value_in_tile(off, x),
                                 vrow[x * v.strides[3]]);
        }
      }
    }
    len += tnew;
    if (ring_ != 0) {
      std::int64_t& first = firsts_[static_cast<std::size_t>(layer * config_.batch + b)];
      first = std::max(first, len - ring_);
    }
  }
}

void KVCache::close_tile(std::int64_t layer, std::int64_t seq, std::int64_t head, std::int64_t blk,
                         std::int64_t pos) {
  // δ_{τ,e} = max_{u∈τ} |K_{u,e}| / 127 (int8) or / 448 (E4M3), k̂_{u,e} = c_{u,e} · δ_{τ,e}
  // (SPEC "Quantized KV cache"): channel e's 64 keys are one row of the open tile, and one row
  // of the K tile (plain rows: contiguous; int8 quads: 4 bytes apart, the d_h % 4 tail rows
  // contiguous).
  const kernels::KVTileLayout tiles = detail::KVCacheAccess::layout(*this);
  std::byte* layer_data = storage_.data() + static_cast<std::size_t>(layer * tiles.layer_elems());
  const std::int64_t kt = tiles.k_tile(blk, head, pos), D = config_.head_dim;
  std::byte* open_bytes = storage_.data() + staging_offset(layer, seq, head);
  const auto* open = reinterpret_cast<const float*>(open_bytes);
  for (std::int64_t x = 0; x < D; ++x) {
    const std::int64_t at = tiles.key_in_tile(0, x);
    const float delta = kernels::quantize_row(config_.dtype, open + x * kKeyTile, 1, kKeyTile,
                                              layer_data + kt + at, tiles.key_in_tile(1, x) - at);
    std::memcpy(layer_data + tiles.scales_of(kt) + x * 4, &delta, sizeof delta);
  }
  std::fill_n(open_bytes, 4 * kKeyTile * D, std::byte{0});
}

// Quantized K (SPEC "Quantized KV cache") of `seq` in `layer` when positions [lo, len) go
// (lo = max(new_length, first position)): every closed tile holding one of them is zeroed
// (elements and channel scales); the open tile keeps its keys below new_length; a closed tile
// that new_length falls inside reopens: its kept keys' values k̂ = c · δ (the fp32 product, within
// 2^−24 of the float64 one) become the open tile, to be quantized again with the tile's new
// channel scales when it closes (docs/design.md, "Quantized caches"; docs/performance.md, D-kv-1).
// A rolling cache's closed tile never shares its slots with a held tile here: a tile with a
// position in [lo, len) lies within the last R positions, and the one R earlier is not held.
void KVCache::shrink_open_tiles(std::int64_t l, std::int64_t seq, std::int64_t new_length,
                                std::int64_t lo, std::int64_t len) {
  const kernels::KVTileLayout tiles = detail::KVCacheAccess::layout(*this);
  std::byte* layer_data = storage_.data() + static_cast<std::size_t>(l * tiles.layer_elems());
  const std::int64_t H = config_.heads_kv, D = config_.head_dim;
  const std::int64_t open_start = len % kKeyTile != 0 ? len / kKeyTile * kKeyTile : -1;
  const std::int64_t new_open = new_length % kKeyTile != 0 ? new_length / kKeyTile * kKeyTile : -1;
  for (std::int64_t h = 0; h < H; ++h) {
    auto* open = reinterpret_cast<float*>(storage_.data() + staging_offset(l, seq, h));
    if (open_start >= 0) {  // the open tile: its keys from new_length on go
      const std::int64_t keep = new_open == open_start ? new_length - open_start : 0;
      for (std::int64_t x = 0; x < D; ++x)
        std::fill(open + x * kKeyTile + keep, open + (x + 1) * kKeyTile, 0.0f);
    }
    for (std::int64_t t0 = lo / kKeyTile * kKeyTile; t0 + kKeyTile <= len; t0 += kKeyTile) {
      const std::int64_t pos = slot(t0);  // a closed tile with a position in [lo, len)
      const std::int64_t blk =
          table_[static_cast<std::size_t>(seq * table_width_ + pos / block_tokens_)];
      const std::int64_t kt = tiles.k_tile(blk, h, pos % block_tokens_);
      if (t0 == new_open) {  // reopens: its keys [lo', new_length) held, dequantized
        const std::int64_t from =
            std::max(t0, firsts_[static_cast<std::size_t>(l * config_.batch + seq)]);
        for (std::int64_t x = 0; x < D; ++x) {
          float delta = 0.0f;
          std::memcpy(&delta, layer_data + tiles.scales_of(kt) + x * 4, sizeof delta);
          for (std::int64_t p = from; p < new_length; ++p) {
            const float c = kernels::load_element(config_.dtype, layer_data,
                                                  kt + tiles.key_in_tile(p % kKeyTile, x));
            open[x * kKeyTile + p % kKeyTile] = c * delta;
          }
        }
      }
      std::fill_n(layer_data + kt, tiles.k_span(), std::byte{0});
    }
  }
}

// Zeroes positions ≥ new_length of `seq` in every layer, sets lengths, returns unneeded blocks.
void KVCache::shrink(std::int64_t seq, std::int64_t new_length) {
  const std::int64_t H = config_.heads_kv, D = config_.head_dim;
  const kernels::KVTileLayout tiles = detail::KVCacheAccess::layout(*this);
  for (std::int64_t l = 0; l < config_.layers; ++l) {
    std::byte* layer_data =
        storage_.data() + static_cast<std::size_t>(l * tiles.layer_elems()) * elem_;
    std::int64_t& len = lengths_[static_cast<std::size_t>(l * config_.batch + seq)];
    std::int64_t& first = firsts_[static_cast<std::size_t>(l * config_.batch + seq)];
    // Only held positions are zeroed (rolling: [first, len); the slots of older ones hold newer
    // positions).
    const std::int64_t lo = std::max(new_length, first);
    if (tiles.k_scale_elems != 0 && lo < len) shrink_open_tiles(l, seq, new_length, lo, len);
    for (std::int64_t p = lo; p < len; ++p) {
      const std::int64_t pos = slot(p);
      const std::int64_t blk =
          table_[static_cast<std::size_t>(seq * table_width_ + pos / block_tokens_)];
      const std::int64_t off = pos % block_tokens_;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t kt = tiles.k_tile(blk, h, off), vt = tiles.v_tile(blk, h, off);
        if (tiles.k_scale_elems == 0) {  // (quantized K: shrink_open_tiles)
          for (std::int64_t x = 0; x < D; ++x) {
            std::fill_n(
                layer_data + static_cast<std::size_t>(kt + tiles.key_in_tile(off, x)) * elem_,
                elem_, std::byte{0});
          }
        }
        for (std::int64_t x = 0; x < D; ++x) {
          std::fill_n(
              layer_data + static_cast<std::size_t>(vt + tiles.value_in_tile(off, x)) * elem_,
              elem_, std::byte{0});
        }
        if (tiles.v_scale_elems != 0) {  // quantized: the V row's scale (one-byte elements)
          std::fill_n(layer_data + tiles.scales_of(vt) + off % kKeyTile * 4, 4, std::byte{0});
        }
      }
    }
    len = std::min(len, new_length);
    if (len == 0) first = 0;
  }
  bool wrapped = false;  // rolling: some layer still holds a position past its ring's first lap
  for (std::int64_t l = 0; l < config_.layers; ++l)
    wrapped = wrapped || firsts_[static_cast<std::size_t>(l * config_.batch + seq)] > 0;
  if (paged() && !wrapped) {
    // Without a wrap, position p of every layer lives in slot p: blocks past the new length hold
    // no position of any layer.
    for (std::int64_t i = blocks_needed(max_length(seq)); i < table_width_; ++i) {
      std::int32_t& entry = table_[static_cast<std::size_t>(seq * table_width_ + i)];
      if (entry >= 0) {
        free_list_.push_back(entry);
        entry = -1;
      }
    }
  }
}

void KVCache::truncate(std::int64_t seq, std::int64_t new_length) {
  constexpr const char* fn = "KVCache::truncate";
  check_seq(fn, seq);
  if (!active_[static_cast<std::size_t>(seq)]) {
    fail(ErrorCode::invalid_argument, fn,
         "sequence " + str(seq) + " was released; reset(" + str(seq) + ") it first");
  }
  const std::int64_t longest = max_length(seq);
  if (new_length < 0 || new_length > longest) {
    fail(ErrorCode::invalid_argument, fn,
         "new_length must be in [0, " + str(longest) + "] (the length of sequence " + str(seq) +
             "; truncate cannot extend); got " + str(new_length));
  }
  for (std::int64_t l = 0; l < config_.layers && new_length > 0; ++l) {
    const std::size_t i = static_cast<std::size_t>(l * config_.batch + seq);
    if (lengths_[i] > new_length && new_length < firsts_[i]) {
      fail(ErrorCode::invalid_argument, fn,
           "new_length must be 0 or >= " + str(firsts_[i]) + ", the first position layer " +
               str(l) + " of sequence " + str(seq) +
               " still holds (a rolling cache keeps the last " + str(ring_) +
               " positions; truncate can only go back within them); got " + str(new_length));
    }
  }
  shrink(seq, new_length);
}

void KVCache::copy_sequences(const KVCache& source, std::span<const std::int64_t> sources) {
  constexpr const char* fn = "KVCache::copy_sequences";
  if (&source == this) {  // reorder in place: read from a snapshot (validated there)
    std::optional<KVCache> snapshot;
    try {
      snapshot.emplace(*this);
    } catch (const std::bad_alloc&) {
      throw ResourceError(ErrorCode::out_of_memory,
                          std::string(fn) + ": cannot allocate the snapshot of the cache (" +
                              str(static_cast<std::int64_t>(storage_.size())) + " bytes)");
    }
    copy_sequences(*snapshot, sources);
    return;
  }
  const KVCacheConfig& s = source.config_;
  if (static_cast<std::int64_t>(sources.size()) != config_.batch) {
    fail(ErrorCode::invalid_argument, fn,
         "sources must name one source sequence for each of the batch = " + str(config_.batch) +
             " sequences of this cache; got " + str(static_cast<std::int64_t>(sources.size())));
  }
  const std::pair<const char*, std::pair<std::int64_t, std::int64_t>> same[] = {
      {"layers", {s.layers, config_.layers}},
      {"heads_kv", {s.heads_kv, config_.heads_kv}},
      {"head_dim", {s.head_dim, config_.head_dim}},
      {"window", {s.window, config_.window}},
      {"block_tokens()", {source.block_tokens_, block_tokens_}},
      {"int8_quads()", {source.int8_quads_ ? 1 : 0, int8_quads_ ? 1 : 0}}};
  for (const auto& [name, values] : same) {
    if (values.first != values.second) {
      fail(ErrorCode::invalid_argument, fn,
           std::string("source.") + name + " must equal this cache's " + name + " = " +
               str(values.second) + "; got " + str(values.first));
    }
  }
  if (s.dtype != config_.dtype) {
    fail(ErrorCode::invalid_argument, fn,
         std::string("source.dtype must equal this cache's dtype ") + to_string(config_.dtype) +
             "; got " + to_string(s.dtype));
  }
  std::int64_t needed_blocks = 0;
  for (std::size_t b = 0; b < sources.size(); ++b) {
    const std::int64_t src = sources[b];
    const std::string name = "sources[" + std::to_string(b) + "]";
    if (src < 0 || src >= s.batch) {
      fail(ErrorCode::invalid_argument, fn,
           name + " must be in [0, source batch = " + str(s.batch) + "); got " + str(src));
    }
    if (!source.active_[static_cast<std::size_t>(src)]) {
      fail(ErrorCode::invalid_argument, fn,
           name + " = " + str(src) + " names a released sequence of source");
    }
    for (std::int64_t l = 0; l < s.layers; ++l) {
      const std::int64_t len = source.lengths_[static_cast<std::size_t>(l * s.batch + src)];
      if (len > config_.capacity) {
        fail(ErrorCode::invalid_argument, fn,
             name + " = " + str(src) + " holds " + str(len) + " positions in layer " + str(l) +
                 "; this cache's capacity is T_max = " + str(config_.capacity));
      }
    }
    for (std::int64_t i = 0; i < source.table_width_; ++i) {
      if (source.table_[static_cast<std::size_t>(src * source.table_width_ + i)] < 0) continue;
      if (i >= table_width_) {
        fail(
            ErrorCode::invalid_argument, fn,
            name + " = " + str(src) + " holds block " + str(i) +
                " of its block table, past this cache's capacity T_max = " + str(config_.capacity));
      }
      ++needed_blocks;
    }
  }
  if (paged() && needed_blocks > pool_blocks_) {
    fail(ErrorCode::invalid_argument, fn,
         "the copied sequences hold " + str(needed_blocks) + " blocks of " + str(block_tokens_) +
             " positions; this cache's pool has " + str(pool_blocks_));
  }
  // Everything checked; allocate what the copy needs, then mutate (nothing below throws).
  std::vector<std::int32_t> new_table, new_free;
  std::vector<std::uint8_t> held, was_free;
  try {
    new_table.assign(table_.size(), -1);
    held.assign(static_cast<std::size_t>(pool_blocks_), 0);
    was_free.assign(static_cast<std::size_t>(pool_blocks_), 0);
    new_free.reserve(static_cast<std::size_t>(pool_blocks_));
  } catch (const std::bad_alloc&) {
    throw ResourceError(ErrorCode::out_of_memory,
                        std::string(fn) + ": cannot allocate the new block table");
  }
  for (std::int32_t p : free_list_) was_free[static_cast<std::size_t>(p)] = 1;
  const kernels::KVTileLayout dst_tiles = detail::KVCacheAccess::layout(*this);
  const kernels::KVTileLayout src_tiles = detail::KVCacheAccess::layout(source);
  // A physical block is [H_kv][block_tokens / 64][K tile, V tile] in each layer: one span of
  // bytes, laid out alike in both caches (same heads, width, block size, dtype and int8 layout).
  const std::size_t block_bytes =
      static_cast<std::size_t>(config_.heads_kv * dst_tiles.head_block_elems()) * elem_;
  const std::size_t dst_layer = static_cast<std::size_t>(dst_tiles.layer_elems()) * elem_;
  const std::size_t src_layer = static_cast<std::size_t>(src_tiles.layer_elems()) * elem_;
  std::int64_t next_free = 0;  // paged: blocks handed out in order 0, 1, … (as a fresh pool)
  for (std::int64_t b = 0; b < config_.batch; ++b) {
    const std::int64_t src = sources[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < table_width_; ++i) {
      const std::int32_t from =
          i < source.table_width_
              ? source.table_[static_cast<std::size_t>(src * source.table_width_ + i)]
              : -1;
      std::int32_t to = -1;
      if (!paged()) {
        if (i == 0) to = static_cast<std::int32_t>(b);  // contiguous: sequence b owns block b
      } else if (from >= 0) {
        to = static_cast<std::int32_t>(next_free++);
      }
      if (to < 0) continue;
      new_table[static_cast<std::size_t>(b * table_width_ + i)] = to;
      held[static_cast<std::size_t>(to)] = 1;
      for (std::int64_t l = 0; l < config_.layers; ++l) {
        std::byte* dst =
            storage_.data() + l * dst_layer + static_cast<std::size_t>(to) * block_bytes;
        if (from >= 0) {
          const std::byte* from_data =
              source.storage_.data() + l * src_layer + static_cast<std::size_t>(from) * block_bytes;
          std::memcpy(dst, from_data, block_bytes);
        } else {
          std::fill_n(dst, block_bytes, std::byte{0});
        }
      }
    }
  }
  // Paged: blocks held before and not now are zeroed (a free block holds zeros, as after
  // truncate) and the free list is rebuilt, popped from the back in increasing order.
  for (std::int64_t p = pool_blocks_ - 1; paged() && p >= 0; --p) {
    if (held[static_cast<std::size_t>(p)]) continue;
    new_free.push_back(static_cast<std::int32_t>(p));
    const bool was_held = was_free[static_cast<std::size_t>(p)] == 0;
    for (std::int64_t l = 0; was_held && l < config_.layers; ++l)
      std::fill_n(storage_.data() + l * dst_layer + static_cast<std::size_t>(p) * block_bytes,
                  block_bytes, std::byte{0});
  }
  table_.swap(new_table);
  if (paged()) free_list_.swap(new_free);
  for (std::int64_t l = 0; l < config_.layers; ++l) {
    for (std::int64_t b = 0; b < config_.batch; ++b) {
      const std::size_t d = static_cast<std::size_t>(l * config_.batch + b);
      const std::size_t f =
          static_cast<std::size_t>(l * s.batch + sources[static_cast<std::size_t>(b)]);
      lengths_[d] = source.lengths_[f];
      firsts_[d] = source.firsts_[f];
      // Quantized: the open K tiles (SPEC "Quantized KV cache"), outside the blocks.
      for (std::int64_t h = 0; kernels::is_quantized(config_.dtype) && h < config_.heads_kv; ++h) {
        std::memcpy(storage_.data() + staging_offset(l, b, h),
                    source.storage_.data() +
                        source.staging_offset(l, sources[static_cast<std::size_t>(b)], h),
                    static_cast<std::size_t>(4 * kKeyTile * config_.head_dim));
      }
    }
  }
  std::fill(active_.begin(), active_.end(), std::uint8_t{1});
}

void KVCache::release(std::int64_t seq) {
  check_seq("KVCache::release", seq);
  shrink(seq, 0);
  active_[static_cast<std::size_t>(seq)] = 0;
}

void KVCache::reset(std::int64_t seq) {
  check_seq("KVCache::reset", seq);
  shrink(seq, 0);
  active_[static_cast<std::size_t>(seq)] = 1;
}

void KVCache::reset() {
  for (std::int64_t b = 0; b < config_.batch; ++b) reset(b);
}

}  // namespace tokenmix
