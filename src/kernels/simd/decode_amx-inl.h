// src/kernels/simd/decode_amx-inl.h — the product backend of a decode reader (a policy, Highway):
// FmaProducts (every unit on the FMA microkernels, decode_products-inl.h) or, built with
// TOKENMIX_HAVE_AMX on the AVX-512 targets, AmxProducts<TB> (a unit's S and Õ on AMX tiles,
// amx_decode.hpp) for the int8, fp8 and bf16 caches. DecodeTiles<TB> names the one a reader of
// cache element TB takes on this target; the skeleton (decode_skeleton-inl.h) asks it on(),
// KeepAwake(), Values() and EndUnit() / EndCall(), the reader BeginUnit() and Scores(). Only the
// bf16 reader takes DecodeTiles now: the int8 and fp8 readers hold FmaProducts, since their K is
// quantized per channel per tile and the tile products' query planes are written once per unit
// (docs/performance.md, D-kv-3); AmxProducts<int8_t / fp8_e4m3_t> are kept for a per-tile plane
// rewrite.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_AMX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_AMX_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_AMX_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_AMX_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/simd/decode_products-inl.h"
#if TOKENMIX_HAVE_AMX
#include "kernels/simd/amx_decode.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {

// Every unit on the FMA products: no unit is ever on tiles (the skeleton's tile branches fold
// away).
struct FmaProducts {
  explicit FmaProducts(const DecodeArgs&) {}
  static constexpr bool on() { return false; }
  static constexpr bool BeginUnit(const DecodeUnit&, bool) { return false; }
  template <class TB>
  static constexpr bool Scores(const DecodeUnit&, const DecodeTile<TB>&) {
    return false;
  }
  static void KeepAwake() {}
  template <class TB>
  static void Values(const DecodeUnit&, std::int64_t, std::int64_t, const TB*) {}
  static void EndUnit(float*) {}
  static void EndCall() {}
};

#if TOKENMIX_HAVE_AMX && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
// AMX tile products for an int8 cache (AMX-INT8), an fp8 or a bf16 cache (AMX-BF16)
// (DecodeArgs::amx, amx_decode.hpp) in units whose rows make them pay (Pays below),
// where d_h is a multiple of 64 up to 256, the unit's query rows can be written as planes and V
// is read from the cache's tiles: every tile's S (in key order; a bf16 K tile the tiles cannot
// take: the FMA products) and Õ (in amx_decode's column order until the unit's end; a bf16 V
// tile they cannot take: amx::values_visible). fp8 units read K and V through the tile path's
// own widening (k_direct and v_direct off: the scores' and weights' unit is kUnit).
// On an Intel Xeon (family 6 model 207), T_k = 32768, B = 1, g = 4, two threads, from DRAM,
// best of 7 calls (docs/performance.md, D-amx-4), int8: T_new = 4
// (16 rows) 7.80 → 6.10 ms, T_new = 16 27.97 → 18.88 ms; T_new = 1 and 2 level
// (2.78 / 2.75–2.87, 3.91–3.99 / 3.87–4.09), T_new = 3 slower (5.27 → 5.73: its 12 rows are one
// FMA tall block). fp8 (D-amx-5, in a slow phase of the host), median of 9 calls alternated:
// T_new = 4 / 16 / 64 19.3 → 16.0, 51.2 → 31.2, 257 → 203 ms; 4 rows and 8 rows slower on the
// tiles (hot, one thread: 1.77× and 1.25× the time), 12 level.
template <class TB>
class AmxProducts {
 public:
  static constexpr amx::Element kElement = std::is_same_v<TB, fp8_e4m3_t> ? amx::Element::fp8_e4m3
                                           : std::is_same_v<TB, std::int8_t> ? amx::Element::int8
                                                                             : amx::Element::bf16;
  // int8: units of ≥ 4 rows; fp8: ≥ 16. int8 at 8 and 12 rows (T_new = 2 and 3 at g = 4), Intel
  // Xeon (family 6 model 207), T_k = 32768, two threads, from DRAM, AMX off / on alternated per
  // call, median of 9: 0.91–0.94× and 0.85–0.90× the FMA time (hot, T_k = 2048, one thread:
  // 0.89×, 0.89×), with the per-tile rewrites of the plain layout; 4 rows (T_new = 1) took
  // 1.04× then, and with the cache in quads (no rewrites) 0.81× hot and 0.88× from DRAM
  // (`tokenmix bench decode`: read ratio 0.67–0.72 → 0.75–0.80 at T_k = 32768)
  // (docs/performance.md, D-amx-8). bf16 (whose FMA products read the cache
  // with two instructions per 2·Lanes elements, bf16_split_t) only where rows − 9·⌈rows / 16⌉ > 10:
  // a tile unit costs about 0.64 of a 16-row FMA block per tile (the rewrites) plus 0.56 per 16-row
  // block of its A tiles, fitted to T_k = 32768, two threads, alternated calls
  // (docs/performance.md, D-amx-6): 16 rows (T_new = 4) 1.00–1.24× the FMA
  // time, 20 and 24 rows 1.11–1.30×, 32 rows 0.74–0.97×, 36 rows 1.13×, 40 rows 0.93×, 48 rows
  // 0.89×, 64 rows 0.48–0.89×.
  static bool Pays(std::int64_t rows) {
    if constexpr (std::is_same_v<TB, hwy::bfloat16_t>) return rows - 9 * ((rows + 15) / 16) > 10;
    if constexpr (std::is_same_v<TB, std::int8_t>) return rows >= 4;
    return rows >= 16;
  }

  // Per call and worker: this thread may use the tiles (else the call is told: amx_refused).
  explicit AmxProducts(const DecodeArgs& a) {
    if (a.amx && amx::head_dim_supported(a.dh)) {
      worker_ = amx::thread_ready();
      if (!worker_ && a.amx_refused != nullptr) a.amx_refused->store(true);
    }
  }
  // This unit's products on the tiles (its query rows written as planes), where they pay and V is
  // read from the cache's tiles.
  bool BeginUnit(const DecodeUnit& u, bool v_in_place) {
    unit_ = false;
    if (worker_ && Pays(u.nrows) && !v_in_place &&
        amx::query_planes(kElement, u.qs, u.nrows, u.dh)) {
      amx::configure();
      unit_ = configured_ = true;
    }
    return unit_;
  }
  bool on() const { return unit_; }
  // S of the tile in key order (true), or false: the FMA products (not a tile unit, or a bf16 K
  // tile the tiles cannot take). The tile pair ahead, front to back, over this tile's work
  // (amx_decode.cpp: pf_take).
  bool Scores(const DecodeUnit& u, const DecodeTile<TB>& t) const {
    return unit_ && amx::scores(t.kt, t.nt, u.st, t.pair_next, t.pair_bytes);
  }
  void KeepAwake() const {
    if (unit_) amx::keep_awake();
  }
  // Õ += P V of the tile (amx_decode's column order). A bf16 V tile the tiles cannot take: each
  // row's visible keys by a scalar loop, in the tiles' column order (a key a row does not see takes
  // no part: 0 · NaN = NaN).
  void Values(const DecodeUnit& u, std::int64_t u0, std::int64_t nt, const TB* vt) const {
    if (!amx::values(u.st, nt, vt, u.acc)) {
      const DecodeArgs& a = *u.a;
      for (std::int64_t r = 0; r < u.nrows; ++r) {
        const std::int64_t t = u.t0 + r / u.g;
        amx::values_visible(u.st + r * kDecodeKeyTile,
                            std::clamp<std::int64_t>(a.visible_begin(u.b, t) - u0, 0, nt),
                            std::clamp<std::int64_t>(a.visible_end(u.b, t) - u0, 0, nt), vt,
                            u.acc + r * u.dh);
      }
    }
  }
  void EndUnit(float* acc) const {
    if (unit_) amx::unpermute(acc);
  }
  void EndCall() const {
    if (configured_) amx::release();
  }

 private:
  bool worker_ = false, configured_ = false, unit_ = false;
};
template <class TB>
using DecodeTiles = AmxProducts<TB>;
#else
template <class TB>
using DecodeTiles = FmaProducts;
#endif

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
