// src/kernels/simd/decode_reader_int8-inl.h — the decode reader of an int8 cache (Highway):
// Int8Reader, the policy DecodeUnits<Reader> (decode_skeleton-inl.h) takes. K's channel scales
// after each K tile and V's row scales after each V tile (kQuantized: the skeleton applies both),
// the tiles in VNNI-4 quads or in plain rows; every unit on the FMA products (no AMX tile
// products for per-channel keys: D-kv-3).
//
// K per channel per closed tile (SPEC "Quantized KV cache"): the skeleton folds δ_τ into the
// rows (FoldKeyScales) and reads the open tile itself; V per row.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_READER_INT8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_READER_INT8_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_READER_INT8_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_READER_INT8_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/simd/decode_amx-inl.h"
#include "kernels/simd/decode_blocking-inl.h"
#include "kernels/simd/decode_products-inl.h"
#include "kernels/simd/microkernel-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// int8: the tiles hold VNNI-4 quads (kv_tile_layout.hpp, a.layout.int8_quads), read through
// int8_quad_t (q · 2^24: one byte shuffle and the conversion per Lanes elements, as the plain
// layout's widening) where no product can leave the normal range, and int8_quad_exact_t (q, one
// shift more) elsewhere:
//   K: the tile's max |scale·q ⊙ δ_τ| finite and below 2^64 (so |S · 2^24| < 2^(64 + 7 + 24) ·
//   d_h):
//      the scores' factor k_post = 2^−24 (S · 2^24 · 2^−24 = S, the same bits);
//   V: every row scale δ_u of the tile 0 or at least 2^−64: P_u · (δ_u · 2^−24), exact powers
//      of two again.
// K's d_h % 4 tail features (plain rows after the quads) go through int8_x24_t (q · 2^24) or
// int8_t. Each element's products are those of the plain layout, in the same order.
// An int8 cache in plain rows (KVCacheConfig::int8_quads false: CPUs without AMX-INT8) is read
// as above without the quads: the plain widening (LoadB of int8_t, unit 1), no AMX units.
template <class TB>  // std::int8_t (a template: instantiated only for the exported targets)
class Int8Reader {
  static_assert(std::is_same_v<TB, std::int8_t>);

 public:
  using Elem = std::int8_t;
  using RowElem = std::int8_t;
  static constexpr bool kQuantized = true;
  static constexpr float kUnit = kLoadBUnit<std::int8_t>;
  // Every unit on the FMA products: the AMX-INT8 tile products (AmxProducts, decode_amx-inl.h)
  // take the unit's query rows as planes once per unit, so they cannot fold a closed tile's
  // channel scales into the rows (SPEC "Quantized KV cache"); detail::decode_amx never selects
  // them for an int8 cache and refuses TOKENMIX_DECODE_AMX=on (docs/performance.md, D-kv-3).
  FmaProducts tiles;

  explicit Int8Reader(const DecodeArgs& a) : tiles(a), quads_(a.layout.int8_quads) {}
  HWY_INLINE void BeginUnit(const DecodeUnit& u, bool v_in_place) {
    tiles.BeginUnit(u, v_in_place);
  }
  // K's channel scales fold into the rows at unit 1 (the quads' 2^24 goes in KeyPost); the
  // folded rows' largest |element| is read by the quads' guard only.
  static constexpr float KeyFold() { return 1.0f; }
  bool KeyMax() const { return quads_; }
  // Per closed K tile: read through int8_quad_t (k_fast) if max |scale·q ⊙ δ_τ| is below 2^64
  // (a NaN may pass over: a NaN query's row is NaN either way). No prescale.
  HWY_INLINE float KeyTile(float qmax) {
    k_fast_ = quads_ && qmax < 0x1.0p64f;
    return 1.0f;
  }
  static constexpr bool RegularOnly() { return false; }
  static void SetBlocking(const DecodeUnit&) {}
  static constexpr bool LinearPrefetch() { return false; }

  // S (4.2): the tiles, or the quads' features then the d_h % 4 tail rows (accumulated: the same
  // k order), or (plain rows) the plain widening.
  HWY_INLINE void Scores(const DecodeUnit& u, const DecodeTile<std::int8_t>& t) {
    if (tiles.Scores(u, t)) return;
    if (!quads_) {
      ScoreProduct(u, t.kt, t.kt_next, t.nv, t.cur);
      return;
    }
    const std::int64_t dq = u.a->layout.quad_features(), dh = u.dh;
    const auto tail = [&](const auto* kk) {
      using TT = std::remove_cv_t<std::remove_pointer_t<decltype(kk)>>;
      constexpr const TT* kNoPrefetch = nullptr;
      const hn::ScalableTag<float> d;
      ColumnBlocks<kRD, kVD, 1>(d, u.nrows, u.qs + dq * u.nrows, u.nrows, kk, kDecodeKeyTile,
                                dh - dq, u.st, kDecodeKeyTile, true, t.nv, kNoPrefetch, nullptr);
    };
    if (k_fast_) {
      ScoreProduct(u, reinterpret_cast<const int8_quad_t*>(t.kt),
                   reinterpret_cast<const int8_quad_t*>(t.kt_next), t.nv, t.cur);
      if (dq < dh) tail(reinterpret_cast<const int8_x24_t*>(t.kt + dq * kDecodeKeyTile));
    } else {
      ScoreProduct(u, reinterpret_cast<const int8_quad_exact_t*>(t.kt),
                   reinterpret_cast<const int8_quad_exact_t*>(t.kt_next), t.nv, t.cur);
      if (dq < dh) tail(t.kt + dq * kDecodeKeyTile);
    }
  }
  float KeyPost() const { return k_fast_ ? 0x1.0p-24f : 1.0f / kUnit; }
  // V read through int8_quad_t if every scale δ_u of the tile is 0 or at least 2^−64 (v_fast; the
  // tile products and plain rows read q: unit 1). Returns what V's LoadB gives per q.
  HWY_INLINE float ValueUnit(const DecodeUnit&, const DecodeTile<std::int8_t>& t, const float* vs) {
    v_fast_ = false;
    if (quads_ && !tiles.on()) {
      const hn::ScalableTag<float> d;
      const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
      const auto lo = hn::Set(d, 0x1.0p-64f);
      auto bad = hn::Lt(lo, lo);  // none
      for (std::int64_t i = 0; i < t.nv; i += N) {
        const auto delta = hn::LoadU(d, vs + i);
        bad = hn::Or(bad, hn::And(hn::Lt(delta, lo), hn::Ne(delta, hn::Zero(d))));
      }
      v_fast_ = hn::AllFalse(d, bad);
    }
    return v_fast_ ? 0x1.0p24f : kUnit;
  }
  static void PrepareValues(const DecodeUnit&, const DecodeTile<std::int8_t>&, std::int64_t) {}
  // P·V (4.5) over the key quads (k0 a multiple of 4), or plain rows.
  HWY_INLINE std::int64_t Values(const DecodeUnit& u, const std::int8_t* vk,
                                 const std::int8_t* vk_next, std::int64_t k0, std::int64_t nk,
                                 std::int64_t vld, PrefetchCursor* cur) const {
    if (!quads_) return ValueProduct(u, vk, vk_next, k0, nk, vld, cur);
    if (v_fast_) {
      return ValueProduct(u, reinterpret_cast<const int8_quad_t*>(vk),
                          reinterpret_cast<const int8_quad_t*>(vk_next), k0, nk, vld, cur);
    }
    return ValueProduct(u, reinterpret_cast<const int8_quad_exact_t*>(vk),
                        reinterpret_cast<const int8_quad_exact_t*>(vk_next), k0, nk, vld, cur);
  }
  static std::int64_t ValueIndex(const DecodeArgs& a, std::int64_t u, std::int64_t x,
                                 std::int64_t) {
    return a.layout.value_in_tile(u, x);
  }
  static void EndUnit(const DecodeUnit&) {}

 private:
  bool quads_, k_fast_ = false, v_fast_ = false;
};

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
