// tests/unit/test_gqa_causality.cpp — grouped/multi-query attention as MHA with repeated K/V heads
// (SPEC 4.8), and causality (SPEC 4.3–4.4): an input at position s never changes an output that
// cannot see it, bit for bit.
//
// Bounds (u = 2^-24): GQA and the equivalent MHA compute the same sums per query row; only the
// order of accumulation may differ between code paths, so outputs and dq agree within
// γ_{T_k + d_h}-ish ≈ (T_k + d_h)·u; 1e-6 ≈ 17u relative covers T ≤ 12, d_h = 8 with a margin
// from attention's averaging. dk/dv of GQA are the group sum of g MHA gradients, summed here in
// double: add g·u → bound 2e-6. Both are also checked against the float64 oracle at 1e-5
// (the kernel's worst-case error ≈ (T_k + d_h + 10)·u, ×3 margin; see test_merge.cpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace tokenmix::testing {
namespace {

constexpr double kOracleBound = 1e-5;

reference::Options ref_options(const AttentionOptions& o) {
  reference::Options r;
  r.scale = o.scale;
  r.causal = o.causal;
  r.align = o.align == CausalAlign::bottom_right ? reference::Align::bottom_right
                                                 : reference::Align::top_left;
  return r;
}

struct Grads {
  StridedTensor out, dq, dk, dv;
  std::vector<float> lse;
  Grads(std::int64_t B, std::int64_t Tq, std::int64_t Tk, std::int64_t Hq, std::int64_t Hkv,
        std::int64_t D, Layout l)
      : out(B, Tq, Hq, D, l),
        dq(B, Tq, Hq, D, l),
        dk(B, Tk, Hkv, D, l),
        dv(B, Tk, Hkv, D, l),
        lse(static_cast<std::size_t>(B * Hq * Tq), kPoison) {}
};

void run(StridedTensor& q, StridedTensor& k, StridedTensor& v, StridedTensor& dout, Grads& g,
         const AttentionOptions& opt) {
  const auto& s = q.view.shape;
  const TensorView lse = TensorView::bht(g.lse.data(), s[0], s[2], s[1]);
  attention_forward(q.view, k.view, v.view, g.out.view, lse, opt);
  attention_backward(q.view, k.view, v.view, g.out.view, lse, dout.view, g.dq.view, g.dk.view,
                     g.dv.view, opt);
}

TEST(Gqa, EqualsMhaWithRepeatedKvHeads) {
  std::mt19937_64 rng(41);
  const std::int64_t B = 2, T = 12, Hq = 8, D = 8;
  for (std::int64_t Hkv : {8, 4, 2, 1}) {  // MHA, GQA (g = 2, 4), MQA (g = 8)
    for (Layout layout : {Layout::bthd, Layout::bhtd, Layout::strided}) {
      const std::int64_t g = Hq / Hkv;
      SCOPED_TRACE(::testing::Message() << "H_kv=" << Hkv << " " << layout_name(layout));
      StridedTensor q(B, T, Hq, D, layout), k(B, T, Hkv, D, layout), v(B, T, Hkv, D, layout),
          dout(B, T, Hq, D, layout);
      q.fill_random(rng), k.fill_random(rng), v.fill_random(rng), dout.fill_random(rng);
      // MHA inputs: K/V head h is the GQA head j(h) = ⌊h / g⌋ (SPEC 4.8).
      StridedTensor kr(B, T, Hq, D, layout), vr(B, T, Hq, D, layout);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t h = 0; h < Hq; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              kr.at(b, t, h, d) = k.at(b, t, h / g, d);
              vr.at(b, t, h, d) = v.at(b, t, h / g, d);
            }
      AttentionOptions opt;
      Grads gqa(B, T, T, Hq, Hkv, D, layout), mha(B, T, T, Hq, Hq, D, layout);
      run(q, k, v, dout, gqa, opt);
      run(q, kr, vr, dout, mha, opt);

      const Tensor64 mha_out = mha.out.to64(), mha_dq = mha.dq.to64();
      EXPECT_LE(rel_err(gqa.out, mha_out), 1e-6);
      EXPECT_LE(rel_err_flat(gqa.lse, std::vector<double>(mha.lse.begin(), mha.lse.end())), 1e-6);
      EXPECT_LE(rel_err(gqa.dq, mha_dq), 1e-6);
      // dK_j, dV_j = Σ over the group of the MHA gradients of its g copies (SPEC "Backward pass").
      Tensor64 dk_sum({B, T, Hkv, D}), dv_sum({B, T, Hkv, D});
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t h = 0; h < Hq; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              dk_sum.at(b, t, h / g, d) += mha.dk.at(b, t, h, d);
              dv_sum.at(b, t, h / g, d) += mha.dv.at(b, t, h, d);
            }
      EXPECT_LE(rel_err(gqa.dk, dk_sum), 2e-6);
      EXPECT_LE(rel_err(gqa.dv, dv_sum), 2e-6);

      // Both against the oracle, which implements j(h) directly.
      const auto fwd = reference::attention_forward(q.to64(), k.to64(), v.to64(), ref_options(opt));
      const auto bwd = reference::attention_backward(q.to64(), k.to64(), v.to64(), dout.to64(),
                                                     ref_options(opt));
      EXPECT_LE(rel_err(gqa.out, fwd.out), kOracleBound);
      EXPECT_LE(rel_err(gqa.dq, bwd.dq), kOracleBound);
      EXPECT_LE(rel_err(gqa.dk, bwd.dk), kOracleBound);
      EXPECT_LE(rel_err(gqa.dv, bwd.dv), kOracleBound);
    }
  }
}

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

/// First query row whose output may depend on key position s (SPEC 4.3): bottom-right query t
/// sees u ≤ t + (T_k − T_q), so key s is first seen by t = s − (T_k − T_q); top-left by t = s.
std::int64_t first_row_seeing_key(std::int64_t s, std::int64_t Tq, std::int64_t Tk, CausalAlign a) {
  return a == CausalAlign::bottom_right ? s - (Tk - Tq) : s;
}

TEST(Causality, PerturbingAPositionChangesNoEarlierOutputBitwise) {
  std::mt19937_64 rng(42);
  const std::int64_t B = 2, Hq = 4, Hkv = 2, D = 8;
  struct Lengths {
    std::int64_t Tq, Tk;
  };
  for (Lengths len : {Lengths{9, 9}, Lengths{5, 12}, Lengths{12, 5}}) {
    for (CausalAlign align : {CausalAlign::bottom_right, CausalAlign::top_left}) {
      const std::int64_t Tq = len.Tq, Tk = len.Tk;
      AttentionOptions opt;
      opt.align = align;
      StridedTensor q(B, Tq, Hq, D, Layout::bhtd), k(B, Tk, Hkv, D, Layout::bthd),
          v(B, Tk, Hkv, D, Layout::strided), dout(B, Tq, Hq, D, Layout::bthd);
      q.fill_random(rng), k.fill_random(rng), v.fill_random(rng), dout.fill_random(rng);
      Grads base(B, Tq, Tk, Hq, Hkv, D, Layout::bthd);
      run(q, k, v, dout, base, opt);
      // attention.hpp: results do not depend on the thread count. The many perturbed runs below
      // use one thread (fast on a loaded machine) and are compared with this all-threads run.
      AttentionOptions one = opt;
      one.threads = 1;
      {
        Grads single(B, Tq, Tk, Hq, Hkv, D, Layout::bthd);
        run(q, k, v, dout, single, one);
        for (auto [x, y] : {std::pair{&base.out, &single.out},
                            {&base.dq, &single.dq},
                            {&base.dk, &single.dk},
                            {&base.dv, &single.dv}}) {
          EXPECT_EQ(std::memcmp(x->storage.data(), y->storage.data(), x->storage.size() * 4), 0);
        }
        EXPECT_EQ(std::memcmp(base.lse.data(), single.lse.data(), base.lse.size() * 4), 0);
      }

      // Rows that see no key (bottom-right, T_q > T_k): O = 0, L = −∞ (SPEC 4.3), never NaN.
      for (std::int64_t t = 0; t < Tq; ++t) {
        if (visible_keys(t, Tq, Tk, true, align) != 0) continue;
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t h = 0; h < Hq; ++h) {
            const float l = base.lse[(b * Hq + h) * Tq + t];
            EXPECT_TRUE(std::isinf(l) && l < 0) << "row " << t;
            for (std::int64_t d = 0; d < D; ++d) {
              EXPECT_EQ(base.out.at(b, t, h, d), 0.0f);
              EXPECT_EQ(base.dq.at(b, t, h, d), 0.0f);
            }
          }
      }

      for (char which : {'q', 'k', 'v'}) {
        StridedTensor& x = which == 'q' ? q : which == 'k' ? k : v;
        const std::int64_t Tx = x.view.shape[1];
        for (std::int64_t s = 0; s < Tx; ++s) {
          SCOPED_TRACE(::testing::Message()
                       << "T_q=" << Tq << " T_k=" << Tk << " "
                       << (align == CausalAlign::bottom_right ? "bottom_right" : "top_left")
                       << " perturb " << which << " at " << s);
          // Perturb every element at position s (all batches and heads) by +1; restore the
          // saved originals afterwards ((x + 1) − 1 need not give x back in fp32).
          const std::vector<float> saved = x.storage;
          for (std::int64_t b = 0; b < B; ++b)
            for (std::int64_t h = 0; h < x.view.shape[2]; ++h)
              for (std::int64_t d = 0; d < D; ++d) x.at(b, s, h, d) += 1.0f;
          Grads pert(B, Tq, Tk, Hq, Hkv, D, Layout::bthd);
          run(q, k, v, dout, pert, one);
          std::copy(saved.begin(), saved.end(), x.storage.begin());

          // A query input at s affects row s only; a key/value at s only rows that see it.
          const std::int64_t first = which == 'q' ? s : first_row_seeing_key(s, Tq, Tk, align);
          bool changed_any_later = false;
          for (std::int64_t t = 0; t < Tq; ++t) {
            const bool may_change = which == 'q' ? t == s : t >= first;
            for (std::int64_t b = 0; b < B; ++b)
              for (std::int64_t h = 0; h < Hq; ++h) {
                bool row_same =
                    same_bits(base.lse[(b * Hq + h) * Tq + t], pert.lse[(b * Hq + h) * Tq + t]);
                for (std::int64_t d = 0; d < D; ++d) {
                  row_same =
                      row_same && same_bits(base.out.at(b, t, h, d), pert.out.at(b, t, h, d));
                  row_same = row_same && same_bits(base.dq.at(b, t, h, d), pert.dq.at(b, t, h, d));
                }
                if (!may_change) {
                  EXPECT_TRUE(row_same) << "row t=" << t << " b=" << b << " h=" << h;
                }
                if (may_change && !row_same) changed_any_later = true;
              }
          }
          // The perturbation is visible somewhere if any row can see it (sanity of the test).
          const bool seen = which == 'q' ? visible_keys(s, Tq, Tk, true, align) > 0 : first < Tq;
          EXPECT_EQ(changed_any_later, seen);
        }
      }
    }
  }
}

}  // namespace
}  // namespace tokenmix::testing
