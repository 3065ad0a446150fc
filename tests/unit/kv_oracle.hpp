// tests/unit/kv_oracle.hpp — the decode tests' float64 oracle over the values a KVCache holds:
// each K/V row read back through the cache's tile layout (the one the writer and the kernels
// use), widened exactly (f32, bf16, f16) or dequantized (int8, fp8 E4M3; SPEC "Quantized KV
// cache": K per channel per closed tile, the open tile as staged, V per row), and
// attention_decode's out / lse checked against it.
//
// Because the oracle runs on exactly the stored values, every cache dtype is held to the
// fp32-accumulation bound of test_decode.cpp, rel_err ≤ 2e-5 (dot products of length d_h and
// L-term weighted sums in fp32, u = 6e-8, exp 1 ULP, one merge per 1024-key chunk; a quantized
// cache's q·δ or δ folded into the score or the probability adds one rounding per term).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "decode/kv_cache_access.hpp"
#include "kernels/kv_element.hpp"
#include "test_util.hpp"

namespace tokenmix::testing {

inline constexpr double kDecodeBound = 2e-5;

inline reference::KVQuant format_of(DType dt) {
  return dt == DType::int8 ? reference::KVQuant::int8 : reference::KVQuant::fp8_e4m3;
}

/// One stored row of a quantized cache (SPEC "Quantized KV cache"). V: its elements q and its
/// fp32 scale δ. K of a closed tile: its elements q and the tile's d_h channel scales δ_{τ,e}
/// (deltas); K of the open tile (the sequence's last, still being filled): open, its fp32
/// staged values (staged).
struct StoredRow {
  std::vector<std::uint8_t> q;
  float delta = 0.0f;
  std::vector<float> deltas;
  bool open = false;
  std::vector<float> staged;
};

/// Where the K (value = false) or V row of (layer, seq, pos, head) lives: element x is at
/// base + at(x) (in elements of the cache's dtype; bytes for int8 / fp8).
struct RowLocation {
  kernels::KVTileLayout layout;
  const std::byte* base;
  std::int64_t tile, off;
  bool value;
  std::int64_t at(std::int64_t x) const {
    return tile + (value ? layout.value_in_tile(off, x) : layout.key_in_tile(off, x));
  }
};
inline RowLocation locate_row(const KVCache& c, std::int64_t layer, std::int64_t seq,
                              std::int64_t pos, std::int64_t head, bool value) {
  using Access = detail::KVCacheAccess;
  const kernels::KVTileLayout L = Access::layout(c);
  const std::int64_t ring = Access::ring(c), s = ring != 0 ? pos % ring : pos;
  const std::int64_t blk = Access::table(c, seq)[s / L.block_tokens], off = s % L.block_tokens;
  const std::int64_t tile = value ? L.v_tile(blk, head, off) : L.k_tile(blk, head, off);
  return {L, Access::layer(c, layer), tile, off, value};
}

/// Quantized cache: position pos of (layer, seq) is in the open tile (its K unquantized).
inline bool in_open_tile(const KVCache& c, std::int64_t layer, std::int64_t seq, std::int64_t pos) {
  const std::int64_t len = c.length(seq, layer);
  return len % KVCache::kKeyTile != 0 && pos >= len / KVCache::kKeyTile * KVCache::kKeyTile;
}

inline StoredRow stored_row(const KVCache& c, std::int64_t layer, std::int64_t seq,
                            std::int64_t pos, std::int64_t head, bool value) {
  const RowLocation r = locate_row(c, layer, seq, pos, head, value);
  const std::int64_t D = r.layout.head_dim;
  StoredRow row;
  if (!value && in_open_tile(c, layer, seq, pos)) {
    row.open = true;
    const float* open = detail::KVCacheAccess::open_tiles(c, layer) +
                        (seq * c.config().heads_kv + head) * D * KVCache::kKeyTile;
    for (std::int64_t x = 0; x < D; ++x)
      row.staged.push_back(open[x * KVCache::kKeyTile + pos % KVCache::kKeyTile]);
    return row;
  }
  for (std::int64_t x = 0; x < D; ++x) row.q.push_back(static_cast<std::uint8_t>(r.base[r.at(x)]));
  if (value) {
    std::memcpy(&row.delta, r.base + r.layout.scales_of(r.tile) + r.off % r.layout.kKeyTile * 4, 4);
  } else {
    row.deltas.resize(static_cast<std::size_t>(D));
    std::memcpy(row.deltas.data(), r.base + r.layout.scales_of(r.tile),
                static_cast<std::size_t>(4 * D));
  }
  return row;
}

/// The values the cache holds for that row, in float64: the stored f32 / bf16 / f16 elements
/// widened, or the dequantized values of an int8 / fp8 E4M3 cache (V: c · δ; K: c_e · δ_{τ,e},
/// the open tile's staged fp32 values).
inline std::vector<double> cached_row(const KVCache& c, std::int64_t layer, std::int64_t seq,
                                      std::int64_t pos, std::int64_t head, bool value) {
  const DType dt = c.config().dtype;
  std::vector<double> x;
  if (kernels::is_quantized(dt)) {
    const StoredRow r = stored_row(c, layer, seq, pos, head, value);
    if (r.open) return {r.staged.begin(), r.staged.end()};
    for (std::size_t e = 0; e < r.q.size(); ++e)
      x.push_back(reference::dequantize(format_of(dt), r.q[e], value ? r.delta : r.deltas[e]));
    return x;
  }
  const RowLocation r = locate_row(c, layer, seq, pos, head, value);
  for (std::int64_t e = 0; e < r.layout.head_dim; ++e)
    x.push_back(kernels::load_element(dt, r.base, r.at(e)));
  return x;
}

/// The oracle for sequence b of q (its rows [1, T_new, H_q, d_h], any layout) against the values
/// the cache holds for that sequence at `layer` (positions before first_position are not held:
/// zeros, and must be outside the window). Causal, bottom-right (SPEC 4.3): the queries are the
/// last T_new positions.
inline reference::ForwardResult cache_oracle(const StridedTensor& q, std::int64_t b,
                                             const KVCache& c, std::int64_t layer,
                                             const reference::Options& o = {}) {
  const std::int64_t L = c.length(b, layer), tnew = q.view.shape[1], hq = q.view.shape[2];
  const std::int64_t H = c.config().heads_kv, D = c.config().head_dim;
  Tensor64 q64({1, tnew, hq, D}), k64({1, L, H, D}), v64({1, L, H, D});
  for (std::int64_t t = 0; t < tnew; ++t)
    for (std::int64_t h = 0; h < hq; ++h)
      for (std::int64_t x = 0; x < D; ++x) q64.at(0, t, h, x) = q.at(b, t, h, x);
  for (std::int64_t p = c.first_position(b, layer); p < L; ++p)
    for (std::int64_t h = 0; h < H; ++h) {
      const auto kr = cached_row(c, layer, b, p, h, false);
      const auto vr = cached_row(c, layer, b, p, h, true);
      for (std::int64_t x = 0; x < D; ++x) {
        k64.at(0, p, h, x) = kr[static_cast<std::size_t>(x)];
        v64.at(0, p, h, x) = vr[static_cast<std::size_t>(x)];
      }
    }
  return reference::attention_forward(q64, k64, v64, o);
}

/// max-norm relative error of O and of L (|ΔL| / max(1, |L|)) of sequence b of a decode call
/// (out [B, T_new, H_q, d_h], lse [B, H_q, T_new] contiguous) against its oracle; the L error is
/// infinite when a row the oracle gives L = −∞ (no key seen) has another L.
inline std::pair<double, double> decode_errors(const StridedTensor& out,
                                               const std::vector<float>& lse, std::int64_t b,
                                               const reference::ForwardResult& ref) {
  const std::int64_t tnew = out.view.shape[1], hq = out.view.shape[2], dh = out.view.shape[3];
  double diff = 0.0, mx = 0.0, lse_diff = 0.0;
  for (std::int64_t t = 0; t < tnew; ++t)
    for (std::int64_t h = 0; h < hq; ++h) {
      for (std::int64_t x = 0; x < dh; ++x) {
        const double got = out.at(b, t, h, x), r = ref.out.at(0, t, h, x);
        diff = std::max(diff, std::isnan(got) ? INFINITY : std::fabs(got - r));
        mx = std::max(mx, std::fabs(r));
      }
      const double rl = ref.lse.at(0, h, t, 0);
      const float gl = lse[static_cast<std::size_t>((b * hq + h) * tnew + t)];
      if (std::isinf(rl)) {
        if (!(std::isinf(gl) && gl < 0)) lse_diff = INFINITY;
      } else {
        lse_diff =
            std::max(lse_diff,
                     std::isnan(gl) ? INFINITY : std::fabs(gl - rl) / std::max(1.0, std::fabs(rl)));
      }
    }
  return {diff / std::max(mx, 1e-30), lse_diff};
}

/// Every sequence of a decode call against its oracle (decode_errors) within bound.
inline void expect_decode_matches(const StridedTensor& out, const std::vector<float>& lse,
                                  const std::vector<reference::ForwardResult>& refs,
                                  double bound = kDecodeBound) {
  for (std::size_t b = 0; b < refs.size(); ++b) {
    const auto [err, lse_err] = decode_errors(out, lse, static_cast<std::int64_t>(b), refs[b]);
    EXPECT_LE(err, bound) << "sequence " << b;
    EXPECT_LE(lse_err, bound) << "sequence " << b;
  }
}

}  // namespace tokenmix::testing
