// tests/unit/variant_run.hpp — one attention case with score variants (SPEC "Score variants
// used by real models"), shared by the variant suites (test_variants.cpp) and the attention
// weights (test_attention_weights.cpp): the case description (VariantCase), an owned mask with
// broadcast dimensions and odd memory layouts plus its dense expansion for the float64 oracle
// (MaskTensor), and the inputs, outputs and options of one run (VariantRun).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {

// ---------------------------------------------------------------------------------------------
// Masks

enum class MaskShape {
  none,
  causal_shape,  ///< bool, u ≤ p(t) (bottom-right), broadcast over B and H: intervals
  left_pad,      ///< bool, u ≥ pad[b], broadcast over H and T_q: intervals
  right_pad,     ///< bool, u < len[b]: intervals
  band,          ///< bool, p(t) − 5 < u ≤ p(t) + 2 per head offset: intervals
  random_bool,   ///< bool, Bernoulli(0.7) per element of the mask's own dims: general
  random_bias,  ///< f32 N(0, 1) with ~20 % −∞ entries and one all −∞ row per (b, h) row set
};

inline const char* mask_name(MaskShape m) {
  switch (m) {
    case MaskShape::none:
      return "nomask";
    case MaskShape::causal_shape:
      return "boolcausal";
    case MaskShape::left_pad:
      return "leftpad";
    case MaskShape::right_pad:
      return "rightpad";
    case MaskShape::band:
      return "band";
    case MaskShape::random_bool:
      return "randbool";
    case MaskShape::random_bias:
      return "bias";
  }
  return "?";
}

/// How the mask's memory is laid out.
enum class MaskMemory {
  dense,      ///< contiguous over its own dims; size-1 dims with stride 0
  padded,     ///< every stride larger than dense, size-1 dims with an arbitrary large stride
  transposed  ///< T_q and T_k axes swapped in memory
};

struct VariantCase {
  std::int64_t B = 1, Tq = 1, Tk = 1, Hq = 1, Hkv = 1, D = 8;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  Layout layout = Layout::bthd;
  std::optional<std::int64_t> window{};
  std::optional<double> softcap{};
  bool alibi = false, sinks = false, key_lengths = false;
  MaskShape mask = MaskShape::none;
  std::array<bool, 4> mask_full{true, true, true, true};  ///< false: that dimension is 1
  MaskMemory mask_memory = MaskMemory::dense;
  double dropout = 0.0;                     ///< options.dropout.p (docs/design.md D.1)
  std::uint64_t dropout_seed = 0x5eedf00d;  ///< options.dropout.seed (offset 3)

  std::string name() const {
    std::string s = "B" + std::to_string(B) + "_Tq" + std::to_string(Tq) + "_Tk" +
                    std::to_string(Tk) + "_Hq" + std::to_string(Hq) + "_Hkv" + std::to_string(Hkv) +
                    "_d" + std::to_string(D) + (causal ? "" : "_noncausal") +
                    (align == CausalAlign::top_left ? "_topleft" : "") + "_" + layout_name(layout);
    if (window) s += "_W" + std::to_string(*window);
    if (softcap) s += "_cap" + std::to_string(*softcap);
    if (alibi) s += "_alibi";
    if (sinks) s += "_sinks";
    if (key_lengths) s += "_keylen";
    if (dropout > 0.0) s += "_drop" + std::to_string(dropout);
    if (mask != MaskShape::none) {
      s += std::string("_") + mask_name(mask) + "[";
      for (bool f : mask_full) s += f ? 'F' : '1';
      s += "]" + std::to_string(static_cast<int>(mask_memory));
    }
    return s;
  }
};

/// An owned mask of logical shape [B, H_q, T_q, T_k] with broadcast dims, plus its dense
/// expansion for the oracle.
struct MaskTensor {
  std::vector<std::uint8_t> bytes;
  std::vector<float> floats;
  ConstTensorView view;
  std::vector<std::uint8_t> dense_bool;
  std::vector<double> dense_bias;

  MaskTensor(const VariantCase& c, std::mt19937_64& rng) {
    if (c.mask == MaskShape::none) return;
    const std::array<std::int64_t, 4> full{c.B, c.Hq, c.Tq, c.Tk};
    std::array<std::int64_t, 4> dims{};
    for (int i = 0; i < 4; ++i) dims[i] = c.mask_full[i] ? full[i] : 1;
    // Strides over the mask's own dims; memory order [0, 1, 2, 3] or [0, 1, 3, 2] (transposed).
    std::array<int, 4> order{0, 1, 2, 3};
    if (c.mask_memory == MaskMemory::transposed) order = {0, 1, 3, 2};
    std::array<std::int64_t, 4> strides{};
    const std::int64_t pad = c.mask_memory == MaskMemory::padded ? 1 : 0;
    std::int64_t step = c.mask_memory == MaskMemory::padded ? 2 : 1;
    for (int k = 3; k >= 0; --k) {
      const int i = order[k];
      strides[i] = step;
      step *= dims[i] + pad;
    }
    const std::int64_t total = step;
    for (int i = 0; i < 4; ++i) {
      if (dims[i] == 1) strides[i] = c.mask_memory == MaskMemory::padded ? 12345 : 0;
    }
    const bool is_bool = c.mask != MaskShape::random_bias;
    const std::int64_t shift = c.align == CausalAlign::bottom_right ? c.Tk - c.Tq : 0;
    std::vector<std::int64_t> pads(static_cast<std::size_t>(c.B)), lens(pads.size());
    for (std::int64_t b = 0; b < c.B; ++b) {
      pads[static_cast<std::size_t>(b)] = (b * 7 + 3) % (c.Tk + 1);
      lens[static_cast<std::size_t>(b)] = c.Tk - (b * 5 + 1) % (c.Tk + 1);
    }
    std::bernoulli_distribution coin(0.7), neg_inf(0.2);
    std::normal_distribution<float> normal;
    auto value = [&](std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) -> double {
      switch (c.mask) {
        case MaskShape::causal_shape:
          return u <= t + shift;
        case MaskShape::left_pad:
          return u >= pads[static_cast<std::size_t>(b)];
        case MaskShape::right_pad:
          return u < lens[static_cast<std::size_t>(b)];
        case MaskShape::band:
          return u > t + shift - 5 - h && u <= t + shift + 2;
        case MaskShape::random_bool:
          return coin(rng);
        case MaskShape::random_bias:
          if (t == dims[2] / 2 && dims[2] > 1)
            return -std::numeric_limits<double>::infinity();  // a row that sees nothing
          return neg_inf(rng) ? -std::numeric_limits<double>::infinity()
                              : static_cast<double>(normal(rng));
        case MaskShape::none:
          break;
      }
      return 0.0;
    };
    // Memory is filled with a value that would be wrong if read (padding): bool 0xAB, NaN.
    if (is_bool) {
      bytes.assign(static_cast<std::size_t>(total), 0xAB);
    } else {
      floats.assign(static_cast<std::size_t>(total), std::numeric_limits<float>::quiet_NaN());
    }
    std::vector<double> own(static_cast<std::size_t>(dims[0] * dims[1] * dims[2] * dims[3]));
    for (std::int64_t b = 0; b < dims[0]; ++b)
      for (std::int64_t h = 0; h < dims[1]; ++h)
        for (std::int64_t t = 0; t < dims[2]; ++t)
          for (std::int64_t u = 0; u < dims[3]; ++u) {
            const double x = value(b, h, t, u);
            own[static_cast<std::size_t>(((b * dims[1] + h) * dims[2] + t) * dims[3] + u)] = x;
            const std::int64_t at =
                (dims[0] > 1 ? b * strides[0] : 0) + (dims[1] > 1 ? h * strides[1] : 0) +
                (dims[2] > 1 ? t * strides[2] : 0) + (dims[3] > 1 ? u * strides[3] : 0);
            if (is_bool) {
              // Nonzero bytes other than 1 also mean true.
              bytes[static_cast<std::size_t>(at)] =
                  x != 0.0 ? static_cast<std::uint8_t>(1 + u % 3) : 0;
            } else {
              floats[static_cast<std::size_t>(at)] = static_cast<float>(x);
            }
          }
    view = {is_bool ? static_cast<const void*>(bytes.data()) : floats.data(),
            is_bool ? DType::boolean : DType::f32, 4, dims, strides};
    const std::size_t n = static_cast<std::size_t>(c.B * c.Hq * c.Tq * c.Tk);
    if (is_bool) dense_bool.resize(n);
    if (!is_bool) dense_bias.resize(n);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t t = 0; t < c.Tq; ++t)
          for (std::int64_t u = 0; u < c.Tk; ++u) {
            const std::int64_t i0 = dims[0] > 1 ? b : 0, i1 = dims[1] > 1 ? h : 0,
                               i2 = dims[2] > 1 ? t : 0, i3 = dims[3] > 1 ? u : 0;
            const double x =
                own[static_cast<std::size_t>(((i0 * dims[1] + i1) * dims[2] + i2) * dims[3] + i3)];
            const std::size_t d = static_cast<std::size_t>(((b * c.Hq + h) * c.Tq + t) * c.Tk + u);
            if (is_bool) {
              dense_bool[d] = x != 0.0 ? 1 : 0;
            } else {
              dense_bias[d] = static_cast<double>(static_cast<float>(x));
            }
          }
  }
};

/// `c` with the variants that combine with any shape all on: a window of 17, soft-capping at 2,
/// ALiBi, sinks and key lengths (the case tables' "everything at once" rows).
inline VariantCase with_all_variants(VariantCase c) {
  c.window = 17;
  c.softcap = 2.0;
  c.alibi = true;
  c.sinks = true;
  c.key_lengths = true;
  return c;
}

// ---------------------------------------------------------------------------------------------
// One case: inputs, options for the library and the oracle

struct VariantRun {
  VariantCase c;
  StridedTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse, slopes, sinks, dsinks;
  std::vector<std::int32_t> key_lengths;
  MaskTensor mask;

  VariantRun(const VariantCase& vc, std::mt19937_64& rng)
      : c(vc),
        q(c.B, c.Tq, c.Hq, c.D, c.layout),
        k(c.B, c.Tk, c.Hkv, c.D, c.layout),
        v(c.B, c.Tk, c.Hkv, c.D, c.layout),
        out(c.B, c.Tq, c.Hq, c.D, c.layout),
        dout(c.B, c.Tq, c.Hq, c.D, c.layout),
        dq(c.B, c.Tq, c.Hq, c.D, c.layout),
        dk(c.B, c.Tk, c.Hkv, c.D, c.layout),
        dv(c.B, c.Tk, c.Hkv, c.D, c.layout),
        lse(static_cast<std::size_t>(c.B * c.Hq * c.Tq), kPoison),
        mask(vc, rng) {
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
    dout.fill_random(rng);
    if (c.alibi) {  // the usual slopes 2^(−8(h+1)/H) (SPEC "ALiBi"), every other one doubled
      for (std::int64_t h = 0; h < c.Hq; ++h)
        slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(c.Hq)) *
                         (h % 2 ? 2.0f : 1.0f));
    }
    if (c.sinks) {
      std::normal_distribution<float> dist(0.5f, 1.0f);
      for (std::int64_t h = 0; h < c.Hq; ++h) sinks.push_back(dist(rng));
    }
    if (c.key_lengths) {
      for (std::int64_t b = 0; b < c.B; ++b)
        key_lengths.push_back(static_cast<std::int32_t>((c.Tk * (b + 1)) / (c.B + 1) + b % 2));
    }
    dsinks.assign(static_cast<std::size_t>(c.Hq), kPoison);
  }

  AttentionOptions options(Isa isa, int threads = 0) const {
    AttentionOptions o;
    o.causal = c.causal;
    o.align = c.align;
    o.isa = isa;
    o.threads = threads;
    o.window = c.window;
    o.softcap = c.softcap;
    if (c.alibi) o.alibi_slopes = {slopes.data(), DType::f32, 1, {c.Hq}, {1}};
    if (c.sinks) o.sinks = {sinks.data(), DType::f32, 1, {c.Hq}, {1}};
    if (c.key_lengths) o.key_lengths = {key_lengths.data(), DType::i32, 1, {c.B}, {1}};
    if (c.mask != MaskShape::none) o.mask = mask.view;
    o.dropout = {c.dropout, c.dropout_seed, 3};
    return o;
  }

  reference::Options ref_options() const {
    reference::Options o;
    o.causal = c.causal;
    o.align = testkit::to_reference(c.align);
    o.window = c.window;
    o.softcap = c.softcap;
    for (float s : slopes) o.alibi_slopes.push_back(s);
    for (float s : sinks) o.sinks.push_back(s);
    for (std::int32_t l : key_lengths) o.key_lengths.push_back(l);
    o.mask_bool = mask.dense_bool;
    o.mask_bias = mask.dense_bias;
    if (c.dropout > 0.0) {  // the same Z (D.2) as the library draws, dense for the oracle
      o.dropout_p = c.dropout;
      o.dropout_keep.resize(static_cast<std::size_t>(c.B * c.Hq * c.Tq * c.Tk));
      attention_dropout_mask({o.dropout_keep.data(),
                              DType::boolean,
                              4,
                              {c.B, c.Hq, c.Tq, c.Tk},
                              {c.Hq * c.Tq * c.Tk, c.Tq * c.Tk, c.Tk, 1}},
                             options(Isa::portable));
    }
    return o;
  }

  TensorView lse_view() { return TensorView::bht(lse.data(), c.B, c.Hq, c.Tq); }

  void forward(Isa isa, int threads = 0) {
    out.poison();
    std::fill(lse.begin(), lse.end(), kPoison);
    attention_forward(q.view, k.view, v.view, out.view, lse_view(), options(isa, threads));
  }
  // Forward then backward, gradients poisoned before the call.
  void backward(Isa isa, int threads = 0) {
    forward(isa, threads);
    dq.poison();
    dk.poison();
    dv.poison();
    std::fill(dsinks.begin(), dsinks.end(), kPoison);
    TensorView ds{};
    if (c.sinks) ds = {dsinks.data(), DType::f32, 1, {c.Hq}, {1}};
    attention_backward(q.view, k.view, v.view, out.view, lse_view(), dout.view, dq.view, dk.view,
                       dv.view, options(isa, threads), ds);
  }
};

// ---------------------------------------------------------------------------------------------
// Checks shared by the variant and dropout suites

/// L against the oracle's: −∞ exactly where the oracle has −∞ (else a failure and +∞),
/// |ΔL| / max(1, |L|) elsewhere (returned).
inline double lse_error(const VariantRun& r, const reference::Tensor64& ref) {
  double max_diff = 0.0;
  const auto& c = r.c;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t t = 0; t < c.Tq; ++t) {
        const double want = ref.at(b, h, t, 0);
        const float got = r.lse[static_cast<std::size_t>((b * c.Hq + h) * c.Tq + t)];
        if (std::isinf(want)) {
          if (got != want) {
            ADD_FAILURE() << "L[b=" << b << ", h=" << h << ", t=" << t << "] = " << got << ", want "
                          << want;
            return std::numeric_limits<double>::infinity();
          }
        } else if (!std::isfinite(got)) {
          ADD_FAILURE() << "L[b=" << b << ", h=" << h << ", t=" << t << "] = " << got;
          return std::numeric_limits<double>::infinity();
        } else {
          max_diff = std::max(max_diff, std::fabs(got - want) / std::max(1.0, std::fabs(want)));
        }
      }
  return max_diff;
}

/// Forward and backward of r on `isa` with 1, 2 and 3 threads: O, L, dQ, dK, dV and dσ are the
/// same bits each time.
inline void ExpectBitwiseAcrossThreadCounts(VariantRun& r, Isa isa) {
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    r.backward(isa, threads);
    std::vector<float> all = r.out.storage;
    for (const auto* x : {&r.lse, &r.dq.storage, &r.dk.storage, &r.dv.storage, &r.dsinks})
      all.insert(all.end(), x->begin(), x->end());
    results.push_back(all);
  }
  for (std::size_t i = 1; i < results.size(); ++i) {
    ASSERT_EQ(results[0].size(), results[i].size());
    EXPECT_EQ(0,
              std::memcmp(results[0].data(), results[i].data(), results[0].size() * sizeof(float)));
  }
}

/// Central differences of the float64 forward (loss = Σ dO ⊙ O, the options of r held fixed,
/// with its dropout mask) against the fp32 backward r ran: dQ, dK, dV and, with sinks, dσ,
/// within `bound` of the largest difference quotient.
inline void ExpectGradientsMatchFiniteDifferences(VariantRun& r, double bound) {
  auto q64 = r.q.to64(), k64 = r.k.to64(), v64 = r.v.to64();
  const auto do64 = r.dout.to64();
  auto ro = r.ref_options();
  const auto loss = [&] { return testkit::attention_loss(q64, k64, v64, do64, ro); };
  double max_diff = 0.0, max_ref = 0.0;
  auto check = [&](const reference::Tensor64& fd, StridedTensor& grad) {
    const auto& sh = fd.shape;
    for (std::int64_t b = 0; b < sh[0]; ++b)
      for (std::int64_t t = 0; t < sh[1]; ++t)
        for (std::int64_t h = 0; h < sh[2]; ++h)
          for (std::int64_t e = 0; e < sh[3]; ++e) {
            max_diff = std::max(max_diff, std::fabs(fd.at(b, t, h, e) - grad.at(b, t, h, e)));
            max_ref = std::max(max_ref, std::fabs(fd.at(b, t, h, e)));
          }
  };
  check(testkit::central_differences(q64, loss), r.dq);
  check(testkit::central_differences(k64, loss), r.dk);
  check(testkit::central_differences(v64, loss), r.dv);
  EXPECT_LE(max_diff / max_ref, bound);
  if (r.c.sinks) {
    EXPECT_LE(rel_err_flat(r.dsinks, testkit::central_differences(ro.sinks, loss)), bound)
        << "dsinks";
  }
}

}  // namespace tokenmix::testing
