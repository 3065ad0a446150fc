// src/kernels/dropout.hpp — attention dropout's keep mask Z (docs/design.md "Attention dropout",
// equations D.1–D.4), the scalar form every path and the float64 oracle share.
//
//   P̃ = P ⊙ Z / (1 − p)                                                          (D.1)
//   Z_{b,h,t,u} = [ W_{u mod 8} ≥ θ ],  θ = ⌊p · 2^16⌋,  W_{2w} and W_{2w+1} the low and
//                 high 16 bits of R_w                                            (D.2)
//   R = Philox4x32-10(counter (⌊u/8⌋, t, b·H_q + h, offset), key (seed mod 2^32, ⌊seed / 2^32⌋))
//                                                                                 (D.3)
// Sixteen bits per key (one Philox call serves 8 consecutive keys; the generator's cost per key is
// half that of a 32-bit word, D-drop-1): a key is kept with probability 1 − θ/2^16, within 2^−16
// of 1 − p.
// Philox4x32-10 is Salmon et al.'s counter-based generator (SC'11, "Parallel random numbers: as
// easy as 1, 2, 3"): ten rounds of two 32 × 32 → 64-bit multiplies, the key bumped by the Weyl
// constants between rounds. Z is a pure function of (seed, offset, b, h, t, u), so every kernel
// path, tile size and thread count draws the same mask, and the backward regenerates it instead
// of storing anything T×T.
#pragma once

#include <array>
#include <cstdint>

namespace tokenmix::kernels {

/// Philox4x32's constants (Random123): the round multipliers and the key's Weyl increments.
inline constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
inline constexpr int kPhiloxRounds = 10;

/// Philox4x32-10 of counter c under key k (D.3), scalar.
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> c,
                                                  std::array<std::uint32_t, 2> k) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const std::uint64_t p0 = std::uint64_t{kPhiloxM0} * c[0];
    const std::uint64_t p1 = std::uint64_t{kPhiloxM1} * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<std::uint32_t>(p0)};
    k[0] += kPhiloxW0;
    k[1] += kPhiloxW1;
  }
  return c;
}

/// One call's dropout, validated by the API (src/api/variants.cpp): active only for p > 0.
struct Dropout {
  bool active = false;
  std::uint32_t threshold = 0;  ///< θ of (D.2), < 2^16: key u is kept iff W_{u mod 8} ≥ θ
  float scale = 1.0f;           ///< 1 / (1 − p), rounded to float32 once
  std::uint32_t key0 = 0, key1 = 0;
  std::uint32_t offset = 0;  ///< the counter's last word
  /// Added to b in the counter (varlen: sequence i of a packed batch is b = i, each sequence
  /// running as a B = 1 call).
  std::int64_t batch_base = 0;
  std::int64_t hq = 1;  ///< H_q of the call (the counter's b·H_q + h)

  /// The counter's third word for (b, h): (b + batch_base)·H_q + h mod 2^32 (the API checks it
  /// fits, so no two rows of a call share it).
  std::uint32_t row_word(std::int64_t b, std::int64_t h) const {
    return static_cast<std::uint32_t>((b + batch_base) * hq + h);
  }
  /// Z_{b,h,t,u} of (D.2), scalar.
  bool keep(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    if (!active) return true;
    const auto r = philox4x32_10(
        {static_cast<std::uint32_t>(u >> 3), static_cast<std::uint32_t>(t), row_word(b, h), offset},
        {key0, key1});
    const std::uint32_t word = r[static_cast<std::size_t>((u >> 1) & 3)];
    return ((u & 1) != 0 ? word >> 16 : word & 0xFFFFu) >= threshold;
  }
  /// Z / (1 − p) of key u: the factor P is multiplied by in (D.1).
  float factor(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    return keep(b, h, t, u) ? scale : 0.0f;
  }
};

}  // namespace tokenmix::kernels
