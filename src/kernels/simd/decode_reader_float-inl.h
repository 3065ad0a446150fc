// src/kernels/simd/decode_reader_float-inl.h — the decode reader of the activation-dtype caches
// (Highway): FloatReader<TB> for fp32, bf16 and f16 elements, the policy DecodeUnits<Reader>
// (decode_skeleton-inl.h) takes. The products read the tiles through LoadB of TB (widened to
// fp32 in registers, microkernel-inl.h), a bf16 cache through the split reading where the target
// has it; bf16 units may run on AMX tiles (decode_amx-inl.h). No scales: V rows may be read in
// place (DecodeArgs::v_rows) and non-finite V rows are scanned for by the skeleton.
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_READER_FLOAT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_READER_FLOAT_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_READER_FLOAT_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_READER_FLOAT_INL_H_
#endif

#include <cstdint>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/simd/decode_amx-inl.h"
#include "kernels/simd/decode_products-inl.h"
#include "kernels/simd/microkernel-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {

template <class TB>  // float, hwy::bfloat16_t, hwy::float16_t
class FloatReader {
 public:
  using Elem = TB;
  static constexpr bool kQuantized = false;
  // A bf16 cache is read by the products through bf16_split_t (microkernel-inl.h) where the
  // target has it: each pair of B vectors as even / odd columns, two instructions per 2·Lanes
  // elements; the products' columns are put back in order once they are complete (S after the
  // tile's Q Kᵀ, Õ at the end of the unit: UnsplitPairs), so every element is the same bits.
  static constexpr bool kSplit = kSplitBuilt && std::is_same_v<TB, hwy::bfloat16_t>;
  using RowElem = std::conditional_t<kSplit, bf16_split_t, TB>;  // what the products read
  using Tiles =
      std::conditional_t<std::is_same_v<TB, hwy::bfloat16_t>, DecodeTiles<TB>, FmaProducts>;
  Tiles tiles;

  explicit FloatReader(const DecodeArgs& a) : tiles(a) {}
  HWY_INLINE void BeginUnit(const DecodeUnit& u, bool v_in_place) {
    tiles.BeginUnit(u, v_in_place);
  }
  static constexpr bool RegularOnly() { return false; }
  static void SetBlocking(const DecodeUnit&) {}
  static constexpr bool LinearPrefetch() { return false; }

  // S (4.2): from the tiles (in key order), else the FMA products (a bf16 K tile the tiles cannot
  // take too), the split reading's columns put back in order.
  HWY_INLINE void Scores(const DecodeUnit& u, const DecodeTile<TB>& t) {
    if (tiles.Scores(u, t)) return;
    ScoreProduct(u, reinterpret_cast<const RowElem*>(t.kt),
                 reinterpret_cast<const RowElem*>(t.kt_next), t.nv, t.cur);
    if constexpr (kSplit) UnsplitPairs(u.st, kDecodeKeyTile, u.nrows, t.nv / u.w_blk * u.w_blk);
  }
  static constexpr float KeyPost() { return 1.0f / kLoadBUnit<TB>; }
  static constexpr float ValueUnit(const DecodeUnit&, const DecodeTile<TB>&, const float*) {
    return kLoadBUnit<TB>;
  }
  static void PrepareValues(const DecodeUnit&, const DecodeTile<TB>&, std::int64_t) {}
  HWY_INLINE std::int64_t Values(const DecodeUnit& u, const TB* vk, const TB* vk_next,
                                 std::int64_t k0, std::int64_t nk, std::int64_t vld,
                                 PrefetchCursor* cur) const {
    return ValueProduct(u, reinterpret_cast<const RowElem*>(vk),
                        reinterpret_cast<const RowElem*>(vk_next), k0, nk, vld, cur);
  }
  static std::int64_t ValueIndex(const DecodeArgs&, std::int64_t u, std::int64_t x,
                                 std::int64_t vld) {
    return u * vld + x;
  }
  HWY_INLINE void EndUnit(const DecodeUnit& u) const {
    if (kSplit && !tiles.on()) UnsplitPairs(u.acc, u.dh, u.nrows, u.dh_vec / u.w_blk * u.w_blk);
  }
};

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
