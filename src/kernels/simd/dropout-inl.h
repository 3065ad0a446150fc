// src/kernels/simd/dropout-inl.h — attention dropout's keep mask Z in SIMD lanes (docs/design.md
// "Attention dropout", D.2–D.3; the scalar form, which this reproduces bit for bit, is
// kernels/dropout.hpp). Philox4x32-10 on vectors of counters: each lane runs its own generator,
// so one call yields the 16-bit words of 8 consecutive keys for N lanes.
//
// Highway 1.0 has no 32-bit MulHigh: a round's two 32 × 32 → 64 products come from MulEven on the
// even lanes and on the odd lanes shifted down, recombined into the high and low words (integer
// operations only: exact on every target).
//
// Highway "-inl" header: included once per target from a foreach_target translation unit.
#if defined(TOKENMIX_KERNELS_SIMD_DROPOUT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DROPOUT_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DROPOUT_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DROPOUT_INL_H_
#endif

#include <algorithm>
#include <cstdint>

#include "hwy/highway.h"
#include "kernels/dropout.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The four random words of Philox4x32-10 (D.3) per lane, for the lanes' counters c0..c3 under
// the key (k0, k1); results in c0..c3.
template <class DU, class VU = hn::Vec<DU>>
HWY_INLINE void Philox4x32Lanes(DU du, VU& c0, VU& c1, VU& c2, VU& c3, std::uint32_t k0,
                                std::uint32_t k1) {
#if HWY_TARGET == HWY_SCALAR
  (void)du;  // one lane: the scalar generator
  const auto r =
      philox4x32_10({hn::GetLane(c0), hn::GetLane(c1), hn::GetLane(c2), hn::GetLane(c3)}, {k0, k1});
  c0 = hn::Set(du, r[0]);
  c1 = hn::Set(du, r[1]);
  c2 = hn::Set(du, r[2]);
  c3 = hn::Set(du, r[3]);
#else
  const hn::Repartition<std::uint64_t, DU> d64;
  const VU m0 = hn::Set(du, kPhiloxM0), m1 = hn::Set(du, kPhiloxM1);
  // hi, lo of a · m per lane (m the same in every lane).
  const auto mul_hi_lo = [&](VU a, VU m, VU& hi, VU& lo) HWY_ATTR {
    const auto even = hn::MulEven(a, m);  // u64 products of the even lanes
    const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(d64, a))), m);
    hi = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
    lo = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  };
  for (int round = 0; round < kPhiloxRounds; ++round) {
    VU hi0, lo0, hi1, lo1;
    mul_hi_lo(c0, m0, hi0, lo0);
    mul_hi_lo(c2, m1, hi1, lo1);
    c0 = hn::Xor(hn::Xor(hi1, c1), hn::Set(du, k0));
    c1 = lo1;
    c2 = hn::Xor(hn::Xor(hi0, c3), hn::Set(du, k1));
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
#endif
}

// Query rows in lanes (the forward): lane i holds row (b, h_i, t_i), whose counter words t_i and
// row_word(b, h_i) are rows_t[i], rows_bh[i] (M lanes, N per vector). For the keys [k0, k0 + n)
// of a tile, multiplies each lane's weight P[u][i] (P: [n][M], row u = key k0 + u) by Z (D.2):
// dropped weights become exactly 0. One Philox call per vector of lanes and group of 8 keys.
template <class D>
HWY_INLINE void DropQueryLanes(D d, const Dropout& z, const std::uint32_t* rows_t,
                               const std::uint32_t* rows_bh, float* P, std::int64_t M,
                               std::int64_t k0, std::int64_t n) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  // W ≥ θ on 16-bit values held in 32-bit lanes: a signed compare is exact.
  const auto theta = hn::Set(di, static_cast<std::int32_t>(z.threshold));
  const auto low16 = hn::Set(du, 0xFFFFu);
  for (std::int64_t i = 0; i < M; i += N) {
    const auto t_words = hn::Load(du, rows_t + i), bh_words = hn::Load(du, rows_bh + i);
    for (std::int64_t group = k0 >> 3; group <= (k0 + n - 1) >> 3; ++group) {
      hn::Vec<decltype(du)> r[4] = {hn::Set(du, static_cast<std::uint32_t>(group)), t_words,
                                    bh_words, hn::Set(du, z.offset)};
      Philox4x32Lanes(du, r[0], r[1], r[2], r[3], z.key0, z.key1);
      for (std::int64_t x = 0; x < 8; ++x) {  // key 8·group + x: half x % 2 of word x / 2
        const std::int64_t u = group * 8 + x - k0;
        if (u < 0 || u >= n) continue;
        const auto word = r[x >> 1];
        const auto w16 = (x & 1) != 0 ? hn::ShiftRight<16>(word) : hn::And(word, low16);
        const auto kept = hn::Not(hn::Lt(hn::BitCast(di, w16), theta));  // W ≥ θ
        float* row = P + u * M + i;
        hn::Store(hn::IfThenElseZero(hn::RebindMask(d, kept), hn::Load(d, row)), d, row);
      }
    }
  }
}

// Keys in lanes (the backward): for row (b, h, t) and keys [u0, u0 + n), writes each key's factor
// Z / (1 − p) of (D.1) (0 or z.scale) to factor[0 .. n). Lanes of one Philox call are consecutive
// groups of 8 keys; its four result vectors, stored interleaved, are the groups' 16-bit words in
// key order (word w of group l holds keys 8l + 2w, 8l + 2w + 1 in its low and high halves).
template <class D>
HWY_INLINE void DropFactorsKeyLanes(D d, const Dropout& z, std::int64_t b, std::int64_t h,
                                    std::int64_t t, std::int64_t u0, std::int64_t n,
                                    float* factor) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<std::uint16_t, D> d16;  // N 16-bit words, widened to N 32-bit lanes
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto theta = hn::Set(di, static_cast<std::int32_t>(z.threshold));
  const auto scale = hn::Set(d, z.scale);
  const std::int64_t g0 = u0 >> 3, first = u0 - g0 * 8;  // key u0 is word `first` of group g0
  // 8N 16-bit words from group g0 + k·N, and room for the last vector's read past them (from
  // word `first` on, vectors of N end up to first < 8 words beyond 8N; those lanes are keys of
  // the next k, overwritten there, or past n, never stored).
  HWY_ALIGN std::uint32_t words[5 * hn::MaxLanes(d)] = {};
  const auto* w16 = reinterpret_cast<const std::uint16_t*>(words);
  const auto lane_groups = hn::Iota(du, 0);
  for (std::int64_t k = 0; k * 8 * N < first + n; ++k) {
    hn::Vec<decltype(du)> r[4] = {
        hn::Add(lane_groups, hn::Set(du, static_cast<std::uint32_t>(g0 + k * N))),
        hn::Set(du, static_cast<std::uint32_t>(t)), hn::Set(du, z.row_word(b, h)),
        hn::Set(du, z.offset)};
    Philox4x32Lanes(du, r[0], r[1], r[2], r[3], z.key0, z.key1);
    hn::StoreInterleaved4(r[0], r[1], r[2], r[3], du, words);  // little-endian: key order
    const std::int64_t lo = k * 8 * N - first;                 // key u0 + lo is w16[0]
    for (std::int64_t x = std::max<std::int64_t>(0, -lo); x < 8 * N && lo + x < n; x += N) {
      const auto w = hn::PromoteTo(di, hn::LoadU(d16, w16 + x));
      const auto f = hn::IfThenElseZero(hn::RebindMask(d, hn::Not(hn::Lt(w, theta))), scale);
      if (lo + x + N <= n) {
        hn::StoreU(f, d, factor + lo + x);
      } else {  // the last partial vector
        HWY_ALIGN float tail[hn::MaxLanes(d)];
        hn::Store(f, d, tail);
        std::copy(tail, tail + (n - lo - x), factor + lo + x);
      }
    }
  }
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)
