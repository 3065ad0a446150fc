// src/kernels/simd/decode_reader_fp8-inl.h — the decode reader of an fp8 E4M3 cache (Highway):
// Fp8Reader, the policy DecodeUnits<Reader> (decode_skeleton-inl.h) takes. K's channel scales
// after each K tile (folded into the rows per tile) and V's row scales after each V tile
// (kQuantized: the skeleton applies both); the codes read through the f16 bits (LoadB,
// q · 2^−8), directly as fp32 bits (fp8_e4m3_direct_t), four columns to a word (the quads) or,
// AVX2 tall units, converted once per tile into bf16 words. Every unit on the FMA products (no
// AMX tile products for per-channel keys: D-kv-3).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_READER_FP8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_READER_FP8_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_READER_FP8_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_READER_FP8_INL_H_
#endif

#include <algorithm>
#include <bit>
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

// n fp8 E4M3 codes (n a multiple of 64) as bf16 words, for the products of a tall unit that reads
// fp8 directly (see kFp8TilesAsBf16): direct, the code's bits placed as bf16 bits s 0000eeee
// mmm0000 (the upper half of the direct fp32 bits, fp8_e4m3_direct_t: the E4M3 value × 2^−120,
// subnormal for subnormal codes); otherwise the f16 reading's value q · 2^−8 (at most 4 significant
// bits and normal: exact in bf16).
template <class D>
HWY_INLINE void Fp8TileToBf16(D d, const fp8_e4m3_t* HWY_RESTRICT src, std::int64_t n, bool direct,
                              hwy::bfloat16_t* HWY_RESTRICT dst) {
  const hn::Repartition<std::int16_t, D> d16;  // 2·Lanes words
  const hn::Rebind<std::int8_t, decltype(d16)> d8;
  const hn::Rebind<hwy::bfloat16_t, D> dbf;
  const std::int64_t N16 = static_cast<std::int64_t>(hn::Lanes(d16));
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto* bytes = reinterpret_cast<const std::int8_t*>(src);
  auto* out = reinterpret_cast<std::int16_t*>(dst);
  const auto mask = hn::Set(d16, static_cast<std::int16_t>(0x87f0));
  if (direct) {
    for (std::int64_t x = 0; x < n; x += N16) {
      const auto b = hn::PromoteTo(d16, hn::LoadU(d8, bytes + x));  // sign in bits 7–15
      hn::StoreU(hn::And(hn::ShiftLeft<4>(b), mask), d16, out + x);
    }
  } else {
    for (std::int64_t x = 0; x < n; x += N) {
      hn::StoreU(hn::DemoteTo(dbf, LoadB(d, src + x)), dbf, dst + x);  // (exact, see above)
    }
  }
}

// fp8 E4M3 on AVX-512 and AVX2 has a second widening, straight into fp32 bits (fp8_e4m3_direct_t,
// microkernel-inl.h: no conversion instruction, LoadB returns q · 2^−120, subnormal fp32 for
// subnormal codes), used when the call asks for it (DecodeArgs::fp8_direct) and this worker's
// MXCSR has DAZ and FTZ clear (a subnormal operand read as 0 would be a wrong answer). Its
// unit 2^−120 is folded where 2^−8 is otherwise, with two guards that keep every product
// normal and every factor finite:
//   K: per closed tile, the rows scale·Q ⊙ δ_τ are multiplied by 2^sh (exact) so that their
//      largest |element| lies in [2^64, 2^65): the score products q'·(k·2^−120) stay far above
//      2^−126; the score is then S'·2^(120−sh). Only where that max is finite, non-zero and in
//      [2^−60, 2^61); otherwise the tile's K is read through the f16 bits (sh = 0).
//   V: P_u·(δ_u·2^120) needs δ_u < 2^8: a tile whose V scales are not all below 2^7 is read
//      through the f16 bits.
// Both readings multiply the same products by exact powers of two, so they give the same
// bits while no product is subnormal (tests/unit/test_kv_quant.cpp compares them bitwise).
template <class TB>  // fp8_e4m3_t (a template: instantiated only for the exported targets)
class Fp8Reader {
  static_assert(std::is_same_v<TB, fp8_e4m3_t>);

 public:
  using Elem = fp8_e4m3_t;
  using RowElem = fp8_e4m3_t;
  static constexpr bool kQuantized = true;
  static constexpr float kUnit = kLoadBUnit<fp8_e4m3_t>;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
  // (AVX2: LoadB per vector, 3 integer instructions, no conversion; on AMD Zen 4 with the path
  // forced, steps 10–17 % faster than through f16 bits; docs/performance.md, D-fp8-3.)
  static constexpr bool kDirectBuilt = true;
#else
  static constexpr bool kDirectBuilt = false;
#endif
  using TD = std::conditional_t<kDirectBuilt, fp8_e4m3_direct_t, Elem>;  // the direct element
  static constexpr float kDirectUnit = kLoadBUnit<TD>;
  // The regular blocks (kVD vectors, a multiple of 4) read the direct bits four columns to a
  // word (fp8_e4m3_quad_t, microkernel-inl.h): their products' columns come out in groups of
  // 4·Lanes as columns 4i, 4i + 1, 4i + 2, 4i + 3 and are put back in order once complete (S
  // after the tile's Q Kᵀ, Õ at the end of the unit: UnsplitQuads), as the bf16 split reading.
  // A V tile the direct unit cannot take (v_direct false) is then read through
  // fp8_e4m3_quad_f16unit_t, the f16 reading's values in the same column order.
  static constexpr bool kQuadBuilt = kDirectBuilt && kSplitBuilt && kVD % 4 == 0;
  // AVX-512: a unit that reads fp8 directly keeps the regular 6 × 4 blocking with the quad
  // reading however many rows it has (ColumnBlocks splits them into blocks of at most 6), not the
  // tall 12 × 2 blocking with the plain direct reading: each B vector serves fewer rows, but
  // the quads' widening is cheaper. AMD Zen 4, B = 1, g = 4, one process alternating the two
  // call by call (the same bits): hot (T_k = 2048, one thread) T_new = 2 / 3 / 4 / 8 / 16
  // 0.90 / 0.92 / 0.89 / 0.91 / 0.91× the time; T_k = 32768, two threads, T_new = 2 / 4 / 8
  // 0.91 / 0.89 / 0.90×. AVX2 (2 × 4 regular blocks) was 1.03–1.05× slower: tall there.
  // docs/performance.md, D-fp8-8.
  static constexpr bool kDirectRegularOnly =
      kQuadBuilt && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL);
  // AVX2: a tall unit that reads fp8 directly, in row blocks of more than 4 rows (the 6 × 2
  // blocking; not the 4 × 3 blocks of kThreeVectorSmallBlocks, e.g. T_new = 2 at g = 4), converts
  // each K and V tile once into bf16 words (Fp8TileToBf16: 5 instructions per 16 codes; the direct
  // bits' upper half, or q · 2^−8 where the unit reads a tile through f16 bits), and every row
  // block reads those through the bf16 split reading (1.5 instructions per vector) instead of
  // widening the codes itself (4 per vector): the same values, each element's k loop unchanged
  // (the same bits). The tile pair ahead is prefetched through the cursor (linear), spread over the
  // products (a burst of prefetches with the conversion made T_new = 5 from memory 1.04× slower).
  // AMD Zen 4, the AVX2 path forced, one process alternating the two call by call (the same
  // output bits), two threads, T_k = 32768 from memory: T_new = 3 / 4 / 5 / 8 / 16 / 64 0.98 /
  // 0.96 / 0.94 / 0.92 / 0.905 / 0.89× the time (T_k = 4096, hot: T_new = 3 / 4 0.97 / 0.95×);
  // the 4 × 3 blocks so converted (T_new = 2) 1.02–1.03×. AVX-512 (whose direct units keep the
  // regular blocks and the quad reading: kDirectRegularOnly) took 1.05–1.22× the time in tall units
  // so converted. docs/performance.md, D-fp8-9.
  static constexpr bool kFp8TilesAsBf16 = kDirectBuilt && kSplitBuilt && HWY_TARGET == HWY_AVX2;
  using TQ = std::conditional_t<kQuadBuilt, fp8_e4m3_quad_t, Elem>;
  using TQ16 = std::conditional_t<kQuadBuilt, fp8_e4m3_quad_f16unit_t, Elem>;
  // Every unit on the FMA products: the AMX-BF16 tile products (AmxProducts, decode_amx-inl.h)
  // take the unit's query rows as planes once per unit, so they cannot fold a closed tile's
  // channel scales into the rows (SPEC "Quantized KV cache"); detail::decode_amx never selects
  // them for an fp8 cache and refuses TOKENMIX_DECODE_AMX=on (docs/performance.md, D-kv-3).
  FmaProducts tiles;

  explicit Fp8Reader(const DecodeArgs& a) : tiles(a) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX2
    direct_ok_ = a.fp8_direct && (_mm_getcsr() & 0x8040u) == 0;
#endif
  }
  // The direct reading in this unit (DecodeArgs::fp8_direct and this worker's MXCSR).
  HWY_INLINE void BeginUnit(const DecodeUnit& u, bool v_in_place) {
    tiles.BeginUnit(u, v_in_place);
    direct_unit_ = direct_ok_;
  }
  // K's channel scales fold into the rows (FoldKeyScales) at the f16 reading's unit 2^8, or at 1
  // where K may be read directly (the fold then multiplies the rows by KeyTile()'s 2^sh).
  float KeyFold() const {
    return direct_unit_ ? 1.0f : 1.0f / kUnit;
  }
  // The folded rows' largest |element| sets the direct reading's prescale 2^sh.
  bool KeyMax() const {
    return direct_unit_;
  }
  // Per closed K tile, qmax = max |scale·Q ⊙ δ_τ|: K read directly (k_direct), the fold's rows
  // multiplied by 2^sh (returned) and the scores' factor 2^(120−sh), where qmax is finite,
  // non-zero and in [2^−60, 2^61); else through the f16 bits (the factor 2^8 unless folded:
  // KeyFold()), and 1 returned.
  HWY_INLINE float KeyTile(float qmax) {
    k_direct_ = false;
    k_post_ = direct_unit_ ? 1.0f / kUnit : 1.0f;
    // qmax ∈ [2^e1, 2^(e1 + 1)) for a normal qmax, from its bits (per tile: no libm call; zero,
    // subnormals, ∞ and NaN fall outside the range).
    const int e1 = static_cast<int>((std::bit_cast<std::uint32_t>(qmax) >> 23) & 0xffu) - 127;
    if (direct_unit_ && std::isfinite(qmax) && qmax > 0.0f && e1 >= -60 && e1 <= 60) {
      const int sh = 64 - e1;  // 2^sh and 2^(120 − sh): normal floats (sh ∈ [4, 124])
      k_direct_ = true;
      k_post_ = std::bit_cast<float>(static_cast<std::uint32_t>(120 - sh + 127) << 23);
      return std::bit_cast<float>(static_cast<std::uint32_t>(sh + 127) << 23);
    }
    return 1.0f;
  }
  // fp8 read directly on AVX-512 keeps the regular blocking at every row count
  // (kDirectRegularOnly).
  bool RegularOnly() const {
    return kDirectRegularOnly && direct_unit_;
  }
  // quad: the quad reading (fp8 read directly, the regular blocking). tiles_bf16: a tall unit of
  // row blocks of more than 4 rows (kFp8TilesAsBf16; ColumnBlocks sizes the blocks so), each K
  // and V tile converted once into bf16 words in the worker's scratch (the portable kernel's K
  // and V tile slots), read as a bf16 cache.
  HWY_INLINE void SetBlocking(const DecodeUnit& u) {
    quad_ = kQuadBuilt && direct_unit_ && !u.tall;
    tiles_bf16_ = kFp8TilesAsBf16 && direct_unit_ && u.tall && LargestRowBlock(u.nrows, kRT) > 4;
    k_bf16_ = reinterpret_cast<hwy::bfloat16_t*>(u.a->scratch.at(u.a->slots.k_f32, u.worker));
    v_bf16_ = reinterpret_cast<hwy::bfloat16_t*>(u.a->scratch.at(u.a->slots.v_f32, u.worker));
  }
  bool LinearPrefetch() const {
    return tiles_bf16_;
  }

  // S (4.2): the tiles; tiles_bf16: the whole K tile [d_h][64] converted (a last tile's keys
  // past nt are masked later) at K's unit, the direct bits (k_direct) or q · 2^−8; the quads; the
  // direct bits; the f16 bits.
  HWY_INLINE void Scores(const DecodeUnit& u, const DecodeTile<fp8_e4m3_t>& t) {
    if (tiles.Scores(u, t)) return;
    const std::int64_t blocked = t.nv / u.w_blk * u.w_blk;
    if (tiles_bf16_) {
      if constexpr (kFp8TilesAsBf16) {
        const hn::ScalableTag<float> d;
        Fp8TileToBf16(d, t.kt, u.a->layout.tile_elems(), k_direct_, k_bf16_);
        constexpr const bf16_split_t* kNoPrefetch = nullptr;
        ScoreProduct(u, reinterpret_cast<const bf16_split_t*>(k_bf16_), kNoPrefetch, t.nv, t.cur);
        UnsplitPairs(u.st, kDecodeKeyTile, u.nrows, blocked);
      }
    } else if (kQuadBuilt && k_direct_ && quad_) {
      ScoreProduct(u, reinterpret_cast<const TQ*>(t.kt), reinterpret_cast<const TQ*>(t.kt_next),
                   t.nv, t.cur);
      UnsplitQuads(u.st, kDecodeKeyTile, u.nrows, blocked);
    } else if (kDirectBuilt && k_direct_) {
      ScoreProduct(u, reinterpret_cast<const TD*>(t.kt), reinterpret_cast<const TD*>(t.kt_next),
                   t.nv, t.cur);
    } else {
      ScoreProduct(u, t.kt, t.kt_next, t.nv, t.cur);
    }
  }
  float KeyPost() const {
    return k_post_;
  }
  // V read directly (v_direct) if every scale of the tile is below 2^7. Returns what V's LoadB
  // gives per q.
  HWY_INLINE float ValueUnit(const DecodeUnit&, const DecodeTile<fp8_e4m3_t>& t, const float* vs) {
    v_direct_ = false;
    if (kDirectBuilt && direct_unit_) {
      const hn::ScalableTag<float> d;
      const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
      auto vmax_scale = hn::LoadU(d, vs);
      for (std::int64_t i = N; i < t.nv; i += N)
        vmax_scale = hn::Max(vmax_scale, hn::LoadU(d, vs + i));
      v_direct_ = hn::GetLane(hn::MaxOfLanes(d, vmax_scale)) < 0x1.0p7f;
    }
    return v_direct_ ? kDirectUnit : kUnit;
  }
  // tiles_bf16: the V tile's nt rows [nt][d_h] (in whole 64-byte lines), at V's unit: the direct
  // bits (v_direct) or q · 2^−8. (A tall unit: one sub-tile, k0 = 0.)
  HWY_INLINE void PrepareValues(const DecodeUnit& u, const DecodeTile<fp8_e4m3_t>& t,
                                std::int64_t vld) {
    if constexpr (kFp8TilesAsBf16) {
      if (tiles_bf16_) {
        const hn::ScalableTag<float> d;
        Fp8TileToBf16(d, t.vt, std::min(u.a->layout.tile_elems(), (t.nt * vld + 63) / 64 * 64),
                      v_direct_, v_bf16_);
      }
    }
  }
  // P·V (4.5): the converted tile, the quads (direct, or the f16 reading's values in the quads'
  // column order), the direct bits, the f16 bits.
  HWY_INLINE std::int64_t Values(const DecodeUnit& u, const fp8_e4m3_t* vk,
                                 const fp8_e4m3_t* vk_next, std::int64_t k0, std::int64_t nk,
                                 std::int64_t vld, PrefetchCursor* cur) const {
    if constexpr (kFp8TilesAsBf16) {
      if (tiles_bf16_) {
        constexpr const bf16_split_t* kNoPrefetch = nullptr;
        return ValueProduct(u, reinterpret_cast<const bf16_split_t*>(v_bf16_ + k0 * vld),
                            kNoPrefetch, k0, nk, vld, cur);
      }
    }
    if (kQuadBuilt && quad_ && v_direct_) {
      return ValueProduct(u, reinterpret_cast<const TQ*>(vk), reinterpret_cast<const TQ*>(vk_next),
                          k0, nk, vld, cur);
    }
    if (kQuadBuilt && quad_) {
      return ValueProduct(u, reinterpret_cast<const TQ16*>(vk),
                          reinterpret_cast<const TQ16*>(vk_next), k0, nk, vld, cur);
    }
    if (kDirectBuilt && v_direct_) {
      return ValueProduct(u, reinterpret_cast<const TD*>(vk), reinterpret_cast<const TD*>(vk_next),
                          k0, nk, vld, cur);
    }
    return ValueProduct(u, vk, vk_next, k0, nk, vld, cur);
  }
  static std::int64_t ValueIndex(const DecodeArgs&, std::int64_t u, std::int64_t x,
                                 std::int64_t vld) {
    return u * vld + x;
  }
  // Õ's blocked columns back in order (the bf16 pairs of converted tiles, the quads).
  HWY_INLINE void EndUnit(const DecodeUnit& u) const {
    const std::int64_t blocked = u.dh_vec / u.w_blk * u.w_blk;
    if (tiles_bf16_ && !tiles.on()) UnsplitPairs(u.acc, u.dh, u.nrows, blocked);
    if (quad_) UnsplitQuads(u.acc, u.dh, u.nrows, blocked);
  }

 private:
  bool direct_ok_ = false, direct_unit_ = false, k_direct_ = false, v_direct_ = false;
  bool quad_ = false, tiles_bf16_ = false;
  float k_post_ = 1.0f / kUnit;
  hwy::bfloat16_t* k_bf16_ = nullptr;
  hwy::bfloat16_t* v_bf16_ = nullptr;
};

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
