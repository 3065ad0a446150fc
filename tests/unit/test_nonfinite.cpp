// tests/unit/test_nonfinite.cpp — NaN and ±∞ inputs (SPEC 4.3 "Non-finite inputs"; the rules
// are in docs/design.md "Numerics" and src/kernels/nonfinite.hpp), on every ISA path this
// machine supports, forced in turn, for the forward, the backward and decode, and for the
// softmax, log-sum-exp and merge helpers and the float64 oracle.
//
// Expectations are derived from first principles, not from another run of the code under test:
//   * a NaN in q_t, in a visible k_u or in L_t reaches every score (or weight) of row t, so the
//     row's O and L are NaN; rows that do not read it are bitwise equal to the run without it;
//   * a NaN or ±∞ in v_u[x] reaches column x of O_t for exactly the rows t that see u (weights
//     are > 0 here, so ±∞ stays ±∞); L and every other column are bitwise unchanged;
//   * a key a row does not see (a future key) takes no part in it, whatever it holds: the row
//     is bitwise equal to the clean run (this covers tiles that cross the causal diagonal,
//     where masked keys sit next to visible ones in the same SIMD tile);
//   * backward: NaN in L_t or q_t makes dq_t and dk_u, dv_u of every key u that t sees NaN; a
//     NaN in dO_t[x] makes dq_t, dk_u NaN and only column x of dv_u (dV = Σ_t A_tu dO_t).
// For ±∞ in q or k, where the score is ±∞ depending on signs, the float64 oracle (which now
// propagates as IEEE says) gives the expected class of every element (NaN, +∞, −∞, finite).
// Shapes straddle the 64-key tile and the lane blocks (T = 130, positions 0, 63, 64, 65, 129),
// both layouts, GQA, and the backward's query ranges (B·H_kv < 8: several, ≥ 8: one; D-bwd-6).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

bool same_bits(float a, float b) {
  return std::memcmp(&a, &b, sizeof(float)) == 0;
}

// What one output element must be.
enum class Expect { clean, nan, pos_inf, neg_inf, oracle };
Expect expect_value(float v) {
  return std::isnan(v) ? Expect::nan : v > 0 ? Expect::pos_inf : Expect::neg_inf;
}

// Checks got against its expectation: bitwise equal to `clean`, NaN, ±∞, or (oracle) the class
// of the float64 reference and, where finite, within 1e-4·max(1, |ref|).
void check_element(float got, Expect e, float clean, double ref, const std::string& where) {
  switch (e) {
    case Expect::clean:
      ASSERT_TRUE(same_bits(got, clean)) << where << ": got " << got << ", clean run " << clean;
      break;
    case Expect::nan:
      ASSERT_TRUE(std::isnan(got)) << where << ": got " << got << ", expected NaN";
      break;
    case Expect::pos_inf:
      ASSERT_EQ(got, kInf) << where;
      break;
    case Expect::neg_inf:
      ASSERT_EQ(got, -kInf) << where;
      break;
    case Expect::oracle:
      if (std::isnan(ref)) {
        ASSERT_TRUE(std::isnan(got)) << where << ": got " << got << ", oracle NaN";
      } else if (std::isinf(ref)) {
        ASSERT_EQ(static_cast<double>(got), ref) << where;
      } else {
        ASSERT_LE(std::fabs(got - ref), 1e-4 * std::max(1.0, std::fabs(ref)))
            << where << ": got " << got << ", oracle " << ref;
      }
      break;
  }
}

struct Problem {
  std::int64_t B, Tq, Tk, Hq, Hkv, D;
  Layout layout = Layout::bthd;
  CausalAlign align = CausalAlign::bottom_right;
  std::int64_t g() const { return Hq / Hkv; }
  bool sees(std::int64_t t, std::int64_t u) const {
    const std::int64_t shift = align == CausalAlign::bottom_right ? Tk - Tq : 0;
    return u <= t + shift;
  }
  std::string name() const {
    return "B" + std::to_string(B) + "_Tq" + std::to_string(Tq) + "_Tk" + std::to_string(Tk) +
           "_Hq" + std::to_string(Hq) + "_Hkv" + std::to_string(Hkv) + "_d" + std::to_string(D) +
           "_" + layout_name(layout) + (align == CausalAlign::top_left ? "_topleft" : "");
  }
  reference::Options ref_options() const {
    reference::Options o;
    o.align = align == CausalAlign::bottom_right ? reference::Align::bottom_right
                                                 : reference::Align::top_left;
    return o;
  }
};

std::vector<Problem> forward_problems() {
  return {{2, 130, 130, 4, 2, 24, Layout::bthd},
          {1, 130, 130, 4, 2, 24, Layout::bhtd},
          {1, 20, 150, 8, 1, 64, Layout::bthd},  // T_q < T_k: every row sees ≥ 131 keys
          {1, 70, 66, 2, 1, 17, Layout::strided, CausalAlign::top_left}};
}

struct Inputs {
  StridedTensor q, k, v;
  Inputs(const Problem& p, std::uint64_t seed)
      : q(p.B, p.Tq, p.Hq, p.D, p.layout),
        k(p.B, p.Tk, p.Hkv, p.D, p.layout),
        v(p.B, p.Tk, p.Hkv, p.D, p.layout) {
    std::mt19937_64 rng(seed);
    q.fill_random(rng);
    k.fill_random(rng);
    v.fill_random(rng);
  }
  // A deep copy whose views point at its own storage.
  Inputs(const Inputs& o) : q(o.q), k(o.k), v(o.v) {
    for (StridedTensor* t : {&q, &k, &v}) t->view.data = t->storage.data();
  }
};

struct Fwd {
  StridedTensor out;
  std::vector<float> lse;
};

AttentionOptions options_for(const Problem& p, Isa isa) {
  AttentionOptions opt;
  opt.align = p.align;
  opt.isa = isa;
  opt.threads = 2;
  return opt;
}

Fwd forward(Inputs& in, const Problem& p, Isa isa) {
  Fwd f{StridedTensor(p.B, p.Tq, p.Hq, p.D, p.layout),
        std::vector<float>(static_cast<std::size_t>(p.B * p.Hq * p.Tq), kPoison)};
  f.out.poison();
  attention_forward(in.q.view, in.k.view, in.v.view, f.out.view,
                    TensorView::bht(f.lse.data(), p.B, p.Hq, p.Tq), options_for(p, isa));
  return f;
}

float& lse_at(std::vector<float>& lse, const Problem& p, std::int64_t b, std::int64_t h,
              std::int64_t t) {
  return lse[static_cast<std::size_t>((b * p.Hq + h) * p.Tq + t)];
}

// Expectation per O element (b, t, h, x) and per L entry (b, h, t).
using OutRule = std::function<Expect(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>;
using LseRule = std::function<Expect(std::int64_t, std::int64_t, std::int64_t)>;

void check_forward(Fwd& got, Fwd& clean, const reference::ForwardResult* ref, const Problem& p,
                   const OutRule& o_rule, const LseRule& l_rule) {
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t t = 0; t < p.Tq; ++t) {
        const std::string row =
            "b=" + std::to_string(b) + " t=" + std::to_string(t) + " h=" + std::to_string(h);
        for (std::int64_t x = 0; x < p.D; ++x) {
          ASSERT_NO_FATAL_FAILURE(check_element(
              got.out.at(b, t, h, x), o_rule(b, t, h, x), clean.out.at(b, t, h, x),
              ref ? ref->out.at(b, t, h, x) : 0.0, "O " + row + " x=" + std::to_string(x)));
        }
        ASSERT_NO_FATAL_FAILURE(check_element(lse_at(got.lse, p, b, h, t), l_rule(b, h, t),
                                              lse_at(clean.lse, p, b, h, t),
                                              ref ? ref->lse.at(b, h, t, 0) : 0.0, "L " + row));
      }
}

class NonFinite : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    const auto avail = available_isas();
    if (std::find(avail.begin(), avail.end(), GetParam()) == avail.end()) {
      GTEST_SKIP() << "ISA " << to_string(GetParam()) << " is not available on this CPU/build";
    }
  }
};

// NaN in one element of q: that row's O and L are NaN; every other row is bitwise unchanged.
TEST_P(NonFinite, ForwardNaNInQueryPoisonsOnlyItsRow) {
  for (const Problem& p : forward_problems()) {
    SCOPED_TRACE(p.name());
    Inputs in(p, 1);
    Fwd clean = forward(in, p, GetParam());
    for (std::int64_t t : {std::int64_t{0}, std::int64_t{63}, std::int64_t{64}, p.Tq - 1}) {
      if (t >= p.Tq || !p.sees(t, 0)) continue;
      SCOPED_TRACE("t*=" + std::to_string(t));
      const std::int64_t b = p.B - 1, h = p.Hq - 1, x = p.D / 2;
      const float keep = in.q.at(b, t, h, x);
      in.q.at(b, t, h, x) = kNaN;
      Fwd got = forward(in, p, GetParam());
      in.q.at(b, t, h, x) = keep;
      auto hit = [&](std::int64_t bb, std::int64_t tt, std::int64_t hh) {
        return bb == b && tt == t && hh == h;
      };
      check_forward(
          got, clean, nullptr, p,
          [&](auto bb, auto tt, auto hh, auto) {
            return hit(bb, tt, hh) ? Expect::nan : Expect::clean;
          },
          [&](auto bb, auto hh, auto tt) { return hit(bb, tt, hh) ? Expect::nan : Expect::clean; });
    }
  }
}

// NaN in one element of a key: exactly the rows that see it (all heads of its group) are NaN.
// NaN in the whole K and V rows of a key: the same; rows before it (for which it is a future
// key, often in the same 64-key tile) are bitwise unchanged.
TEST_P(NonFinite, ForwardNaNInKeyPoisonsExactlyTheRowsThatSeeIt) {
  for (const Problem& p : forward_problems()) {
    SCOPED_TRACE(p.name());
    Inputs in(p, 2);
    Fwd clean = forward(in, p, GetParam());
    for (std::int64_t u :
         {std::int64_t{0}, std::int64_t{63}, std::int64_t{64}, std::int64_t{65}, p.Tk - 1}) {
      for (bool whole_rows : {false, true}) {
        SCOPED_TRACE("u*=" + std::to_string(u) +
                     (whole_rows ? " (K and V rows)" : " (one K element)"));
        const std::int64_t b = 0, j = p.Hkv - 1;
        Inputs poisoned = in;
        for (std::int64_t x = 0; x < p.D; ++x) {
          if (!whole_rows && x != 1 % p.D) continue;
          poisoned.k.at(b, u, j, x) = kNaN;
          if (whole_rows) poisoned.v.at(b, u, j, x) = kNaN;
        }
        Fwd got = forward(poisoned, p, GetParam());
        auto hit = [&](std::int64_t bb, std::int64_t tt, std::int64_t hh) {
          return bb == b && hh / p.g() == j && p.sees(tt, u);
        };
        check_forward(
            got, clean, nullptr, p,
            [&](auto bb, auto tt, auto hh, auto) {
              return hit(bb, tt, hh) ? Expect::nan : Expect::clean;
            },
            [&](auto bb, auto hh, auto tt) {
              return hit(bb, tt, hh) ? Expect::nan : Expect::clean;
            });
      }
    }
  }
}

// NaN / +∞ / −∞ in one element v_u[x]: column x of O becomes that value in the rows that see u;
// L and all other elements are bitwise unchanged.
TEST_P(NonFinite, ForwardNonFiniteValueReachesOnlyItsColumn) {
  for (const Problem& p : forward_problems()) {
    SCOPED_TRACE(p.name());
    Inputs in(p, 3);
    Fwd clean = forward(in, p, GetParam());
    for (float val : {kNaN, kInf, -kInf}) {
      for (std::int64_t u : {std::int64_t{0}, std::int64_t{64}, p.Tk - 1}) {
        SCOPED_TRACE("u*=" + std::to_string(u) + " value " + std::to_string(val));
        const std::int64_t b = 0, j = 0, x = p.D - 1;
        const float keep = in.v.at(b, u, j, x);
        in.v.at(b, u, j, x) = val;
        Fwd got = forward(in, p, GetParam());
        in.v.at(b, u, j, x) = keep;
        check_forward(
            got, clean, nullptr, p,
            [&](auto bb, auto tt, auto hh, auto xx) {
              return bb == b && hh / p.g() == j && xx == x && p.sees(tt, u) ? expect_value(val)
                                                                            : Expect::clean;
            },
            [&](auto, auto, auto) { return Expect::clean; });
      }
    }
  }
}

// ±∞ in q or k: scores become ±∞ by the signs of the other operand; a +∞ score makes the row
// NaN (e^{∞−∞}), a −∞ one is a weight of 0. The float64 oracle gives each element's class;
// rows that do not read the ∞ are bitwise unchanged.
TEST_P(NonFinite, ForwardInfinityInQueryOrKeyMatchesOracle) {
  for (const Problem& p : forward_problems()) {
    SCOPED_TRACE(p.name());
    Inputs in(p, 4);
    Fwd clean = forward(in, p, GetParam());
    for (float val : {kInf, -kInf}) {
      for (bool in_q : {true, false}) {
        for (std::int64_t pos : {std::int64_t{0}, std::int64_t{64}, std::int64_t{65}}) {
          SCOPED_TRACE(std::string(in_q ? "q" : "k") + " pos " + std::to_string(pos) + " value " +
                       std::to_string(val));
          const std::int64_t b = 0, x = 2 % p.D;
          Inputs poisoned = in;
          const std::int64_t head = 0;  // query head 0, or KV head 0 (query heads 0 … g − 1)
          if (in_q) {
            if (pos >= p.Tq) continue;
            poisoned.q.at(b, pos, head, x) = val;
          } else {
            poisoned.k.at(b, pos, head, x) = val;
          }
          Fwd got = forward(poisoned, p, GetParam());
          const auto ref = reference::attention_forward(poisoned.q.to64(), poisoned.k.to64(),
                                                        poisoned.v.to64(), p.ref_options());
          auto hit = [&](std::int64_t bb, std::int64_t tt, std::int64_t hh) {
            if (bb != b) return false;
            return in_q ? (tt == pos && hh == head) : (hh / p.g() == head && p.sees(tt, pos));
          };
          check_forward(
              got, clean, &ref, p,
              [&](auto bb, auto tt, auto hh, auto) {
                return hit(bb, tt, hh) ? Expect::oracle : Expect::clean;
              },
              [&](auto bb, auto hh, auto tt) {
                return hit(bb, tt, hh) ? Expect::oracle : Expect::clean;
              });
        }
      }
    }
  }
}

// A row whose visible scores are all −∞ is like a fully masked row: O = 0, L = −∞ (never NaN),
// on every path. Made with q = [+∞, 0, …] against keys whose first coordinate is negative.
TEST_P(NonFinite, ForwardRowOfMinusInfinityScoresGivesZerosAndMinusInfinity) {
  const Problem p{1, 5, 5, 1, 1, 4};
  Inputs in(p, 5);
  for (std::int64_t u = 0; u < p.Tk; ++u) in.k.at(0, u, 0, 0) = -1.0f - static_cast<float>(u);
  for (std::int64_t x = 0; x < p.D; ++x) in.q.at(0, 2, 0, x) = x == 0 ? kInf : 0.0f;
  Fwd got = forward(in, p, GetParam());
  for (std::int64_t x = 0; x < p.D; ++x) EXPECT_EQ(got.out.at(0, 2, 0, x), 0.0f) << x;
  EXPECT_EQ(lse_at(got.lse, p, 0, 0, 2), -kInf);
  const auto ref = reference::attention_forward(in.q.to64(), in.k.to64(), in.v.to64());
  EXPECT_EQ(ref.lse.at(0, 0, 2, 0), -std::numeric_limits<double>::infinity());
}

// The NaN/∞ class of every output element is the same on every available path (one input
// holding NaN in q, NaN in a key, +∞ and −∞ in values, across tile edges).
TEST(NonFiniteAcrossPaths, IdenticalClassPatterns) {
  const Problem p{1, 130, 130, 4, 2, 24};
  Inputs in(p, 6);
  in.q.at(0, 70, 1, 3) = kNaN;
  in.k.at(0, 100, 0, 5) = kNaN;
  in.v.at(0, 10, 1, 7) = kInf;
  in.v.at(0, 64, 1, 8) = -kInf;
  in.k.at(0, 120, 1, 2) = kInf;
  auto cls = [](float x) { return std::isnan(x) ? 0 : std::isinf(x) ? (x > 0 ? 1 : 2) : 3; };
  std::vector<int> first;
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(to_string(isa));
    Fwd f = forward(in, p, isa);
    std::vector<int> pattern;
    f.out.for_each([&](float& x) { pattern.push_back(cls(x)); });
    for (float x : f.lse) pattern.push_back(cls(x));
    if (first.empty()) {
      first = pattern;
    } else {
      EXPECT_EQ(pattern, first);
    }
  }
}

// ---- Backward ----

std::vector<Problem> backward_problems() {
  return {{1, 130, 130, 4, 2, 24, Layout::bthd},   // B·H_kv = 2: 4 query ranges
          {2, 130, 130, 8, 4, 16, Layout::bhtd}};  // B·H_kv = 8: one range
}

struct Grads {
  StridedTensor dq, dk, dv;
  explicit Grads(const Problem& p)
      : dq(p.B, p.Tq, p.Hq, p.D, p.layout),
        dk(p.B, p.Tk, p.Hkv, p.D, p.layout),
        dv(p.B, p.Tk, p.Hkv, p.D, p.layout) {
    dq.poison();
    dk.poison();
    dv.poison();
  }
};

Grads backward(Inputs& in, Fwd& f, StridedTensor& dout, const Problem& p, Isa isa) {
  Grads g(p);
  attention_backward(in.q.view, in.k.view, in.v.view, f.out.view,
                     ConstTensorView::bht(f.lse.data(), p.B, p.Hq, p.Tq), dout.view, g.dq.view,
                     g.dk.view, g.dv.view, options_for(p, isa));
  return g;
}

// Expectations: dq element (b, t, h, x); dk / dv element (b, u, j, x).
using GradRule = std::function<Expect(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>;

void check_grad(StridedTensor& got, StridedTensor& clean, const GradRule& rule, const char* name) {
  const auto& s = got.view.shape;
  for (std::int64_t b = 0; b < s[0]; ++b)
    for (std::int64_t t = 0; t < s[1]; ++t)
      for (std::int64_t h = 0; h < s[2]; ++h)
        for (std::int64_t x = 0; x < s[3]; ++x) {
          ASSERT_NO_FATAL_FAILURE(check_element(
              got.at(b, t, h, x), rule(b, t, h, x), clean.at(b, t, h, x), 0.0,
              std::string(name) + " b=" + std::to_string(b) + " row=" + std::to_string(t) +
                  " head=" + std::to_string(h) + " x=" + std::to_string(x)));
        }
}

TEST_P(NonFinite, BackwardPropagatesNaNFromLseDoutQueryAndFutureKeys) {
  for (const Problem& p : backward_problems()) {
    SCOPED_TRACE(p.name());
    Inputs in(p, 7);
    StridedTensor dout(p.B, p.Tq, p.Hq, p.D, p.layout);
    std::mt19937_64 rng(8);
    dout.fill_random(rng);
    Fwd f = forward(in, p, GetParam());
    Grads clean = backward(in, f, dout, p, GetParam());
    const std::int64_t b = p.B - 1, h = 1, j = h / p.g(), xo = 3;

    for (std::int64_t t :
         {std::int64_t{0}, std::int64_t{63}, std::int64_t{64}, std::int64_t{100}}) {
      SCOPED_TRACE("t*=" + std::to_string(t));
      // Rows / keys touched by a NaN in row t of head h: dq of (b, t, h); dk, dv of keys t sees.
      auto row = [&](auto bb, auto tt, auto hh) { return bb == b && tt == t && hh == h; };
      auto key = [&](auto bb, auto uu, auto jj) { return bb == b && jj == j && p.sees(t, uu); };
      const auto nan_if = [](bool c) { return c ? Expect::nan : Expect::clean; };
      {  // NaN in L_t
        SCOPED_TRACE("NaN in L");
        const float keep = lse_at(f.lse, p, b, h, t);
        lse_at(f.lse, p, b, h, t) = kNaN;
        Grads g = backward(in, f, dout, p, GetParam());
        lse_at(f.lse, p, b, h, t) = keep;
        check_grad(
            g.dq, clean.dq,
            [&](auto bb, auto tt, auto hh, auto) { return nan_if(row(bb, tt, hh)); }, "dq");
        check_grad(
            g.dk, clean.dk,
            [&](auto bb, auto uu, auto jj, auto) { return nan_if(key(bb, uu, jj)); }, "dk");
        check_grad(
            g.dv, clean.dv,
            [&](auto bb, auto uu, auto jj, auto) { return nan_if(key(bb, uu, jj)); }, "dv");
      }
      {  // NaN in dO_t[xo]: D_t and dA_t are NaN; dV = Σ A dO only in column xo
        SCOPED_TRACE("NaN in dO");
        const float keep = dout.at(b, t, h, xo);
        dout.at(b, t, h, xo) = kNaN;
        Grads g = backward(in, f, dout, p, GetParam());
        dout.at(b, t, h, xo) = keep;
        check_grad(
            g.dq, clean.dq,
            [&](auto bb, auto tt, auto hh, auto) { return nan_if(row(bb, tt, hh)); }, "dq");
        check_grad(
            g.dk, clean.dk,
            [&](auto bb, auto uu, auto jj, auto) { return nan_if(key(bb, uu, jj)); }, "dk");
        check_grad(
            g.dv, clean.dv,
            [&](auto bb, auto uu, auto jj, auto x) { return nan_if(key(bb, uu, jj) && x == xo); },
            "dv");
      }
      {  // NaN in q_t (forward and backward): the row's P is NaN
        SCOPED_TRACE("NaN in q");
        const float keep = in.q.at(b, t, h, xo);
        in.q.at(b, t, h, xo) = kNaN;
        Fwd fp = forward(in, p, GetParam());
        Grads g = backward(in, fp, dout, p, GetParam());
        in.q.at(b, t, h, xo) = keep;
        check_grad(
            g.dq, clean.dq,
            [&](auto bb, auto tt, auto hh, auto) { return nan_if(row(bb, tt, hh)); }, "dq");
        check_grad(
            g.dk, clean.dk,
            [&](auto bb, auto uu, auto jj, auto) { return nan_if(key(bb, uu, jj)); }, "dk");
        check_grad(
            g.dv, clean.dv,
            [&](auto bb, auto uu, auto jj, auto) { return nan_if(key(bb, uu, jj)); }, "dv");
      }
    }
    for (std::int64_t u :
         {std::int64_t{1}, std::int64_t{64}, std::int64_t{65}, std::int64_t{129}}) {
      // NaN in the whole K and V rows of key u (forward and backward): rows that see u are NaN,
      // so are dk, dv of every key such a row sees; rows before u (u is their future) and keys
      // seen by none of the NaN rows are bitwise unchanged.
      SCOPED_TRACE("NaN K, V rows of key " + std::to_string(u));
      Inputs poisoned = in;
      for (std::int64_t x = 0; x < p.D; ++x)
        poisoned.k.at(b, u, j, x) = poisoned.v.at(b, u, j, x) = kNaN;
      Fwd fp = forward(poisoned, p, GetParam());
      Grads g = backward(poisoned, fp, dout, p, GetParam());
      auto row_hit = [&](auto bb, auto tt, auto hh) {
        return bb == b && hh / p.g() == j && p.sees(tt, u);
      };
      auto key_hit = [&](auto bb, auto uu, auto jj) {
        if (bb != b || jj != j) return false;
        for (std::int64_t t = 0; t < p.Tq; ++t)
          if (p.sees(t, u) && p.sees(t, uu)) return true;
        return false;
      };
      check_grad(
          g.dq, clean.dq,
          [&](auto bb, auto tt, auto hh, auto) {
            return row_hit(bb, tt, hh) ? Expect::nan : Expect::clean;
          },
          "dq");
      check_grad(
          g.dk, clean.dk,
          [&](auto bb, auto uu, auto jj, auto) {
            return key_hit(bb, uu, jj) ? Expect::nan : Expect::clean;
          },
          "dk");
      check_grad(
          g.dv, clean.dv,
          [&](auto bb, auto uu, auto jj, auto) {
            return key_hit(bb, uu, jj) ? Expect::nan : Expect::clean;
          },
          "dv");
    }
  }
}

// ---- Decode ----

struct DecodeSetup {
  std::int64_t B = 2, Hkv = 2, Hq = 4, D = 32, tnew = 1;
  std::vector<std::int64_t> lengths{1100, 70};  // 1100 > one 1024-key chunk: the merge runs
  std::vector<float> k, v;                      // [B][lmax][Hkv][D]
  std::int64_t lmax() const { return *std::max_element(lengths.begin(), lengths.end()); }
  float& K(std::int64_t b, std::int64_t u, std::int64_t j, std::int64_t x) {
    return k[static_cast<std::size_t>(((b * lmax() + u) * Hkv + j) * D + x)];
  }
  float& V(std::int64_t b, std::int64_t u, std::int64_t j, std::int64_t x) {
    return v[static_cast<std::size_t>(((b * lmax() + u) * Hkv + j) * D + x)];
  }
};

struct DecodeResult {
  StridedTensor out;
  std::vector<float> lse;
};

DecodeResult decode(DecodeSetup& s, StridedTensor& q, Isa isa, DType dtype) {
  KVCache cache({1, s.B, s.Hkv, s.D, s.lmax(), dtype, 0, 0});
  for (std::int64_t b = 0; b < s.B; ++b) {
    const std::array<std::int64_t, 4> strides{s.lmax() * s.Hkv * s.D, s.Hkv * s.D, s.D, 1};
    cache.append(
        0, b,
        ConstTensorView{&s.K(b, 0, 0, 0), DType::f32, 4, {1, s.lengths[b], s.Hkv, s.D}, strides},
        ConstTensorView{&s.V(b, 0, 0, 0), DType::f32, 4, {1, s.lengths[b], s.Hkv, s.D}, strides});
  }
  DecodeResult r{StridedTensor(s.B, s.tnew, s.Hq, s.D, Layout::bthd),
                 std::vector<float>(static_cast<std::size_t>(s.B * s.Hq * s.tnew), kPoison)};
  r.out.poison();
  DecodeOptions o;
  o.isa = isa;
  o.threads = 2;
  attention_decode(q.view, cache, 0, r.out.view, TensorView::bht(r.lse.data(), s.B, s.Hq, s.tnew),
                   o);
  return r;
}

TEST_P(NonFinite, DecodePropagatesNaNFromQueryAndCachedKeysAndValues) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (std::int64_t tnew : {1, 3}) {
      SCOPED_TRACE(std::string(dtype == DType::f32 ? "f32" : "bf16") +
                   " tnew=" + std::to_string(tnew));
      DecodeSetup s;
      s.tnew = tnew;
      std::mt19937_64 rng(9);
      std::normal_distribution<float> dist;
      s.k.resize(static_cast<std::size_t>(s.B * s.lmax() * s.Hkv * s.D));
      s.v.resize(s.k.size());
      for (float& x : s.k) x = dist(rng);
      for (float& x : s.v) x = dist(rng);
      StridedTensor q(s.B, tnew, s.Hq, s.D, Layout::bthd);
      q.fill_random(rng);
      DecodeResult clean = decode(s, q, GetParam(), dtype);
      const std::int64_t g = s.Hq / s.Hkv;
      // Row t of sequence b sees keys u < lengths[b] − tnew + t + 1.
      auto sees = [&](std::int64_t b, std::int64_t t, std::int64_t u) {
        return u < s.lengths[b] - tnew + t + 1;
      };
      auto check =
          [&](DecodeResult& got,
              const std::function<Expect(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>&
                  o_rule,
              const std::function<Expect(std::int64_t, std::int64_t, std::int64_t)>& l_rule) {
            for (std::int64_t b = 0; b < s.B; ++b)
              for (std::int64_t t = 0; t < tnew; ++t)
                for (std::int64_t h = 0; h < s.Hq; ++h) {
                  const std::string row = "b=" + std::to_string(b) + " t=" + std::to_string(t) +
                                          " h=" + std::to_string(h);
                  for (std::int64_t x = 0; x < s.D; ++x)
                    ASSERT_NO_FATAL_FAILURE(check_element(
                        got.out.at(b, t, h, x), o_rule(b, t, h, x), clean.out.at(b, t, h, x), 0.0,
                        "O " + row + " x=" + std::to_string(x)));
                  const std::size_t li = static_cast<std::size_t>((b * s.Hq + h) * tnew + t);
                  ASSERT_NO_FATAL_FAILURE(
                      check_element(got.lse[li], l_rule(b, h, t), clean.lse[li], 0.0, "L " + row));
                }
          };
      {  // NaN query: that row only
        SCOPED_TRACE("NaN query");
        const std::int64_t b = 0, t = tnew - 1, h = 1;
        const float keep = q.at(b, t, h, 4);
        q.at(b, t, h, 4) = kNaN;
        DecodeResult got = decode(s, q, GetParam(), dtype);
        q.at(b, t, h, 4) = keep;
        auto hit = [&](auto bb, auto tt, auto hh) { return bb == b && tt == t && hh == h; };
        check(
            got,
            [&](auto bb, auto tt, auto hh, auto) {
              return hit(bb, tt, hh) ? Expect::nan : Expect::clean;
            },
            [&](auto bb, auto hh, auto tt) {
              return hit(bb, tt, hh) ? Expect::nan : Expect::clean;
            });
      }
      // Keys in the first chunk, at a tile edge, in the second chunk, and the next-to-last key
      // (with tnew = 3 a future key of row 0, in the tile it reads).
      for (std::int64_t u :
           {std::int64_t{5}, std::int64_t{64}, std::int64_t{1050}, s.lengths[0] - 2}) {
        for (bool value : {false, true}) {
          SCOPED_TRACE(std::string(value ? "NaN in V" : "NaN in K") + " of key " +
                       std::to_string(u));
          const std::int64_t b = 0, j = 1, x = 6;
          float& slot = value ? s.V(b, u, j, x) : s.K(b, u, j, x);
          const float keep = slot;
          slot = kNaN;
          DecodeResult got = decode(s, q, GetParam(), dtype);
          slot = keep;
          auto hit = [&](auto bb, auto tt, auto hh) {
            return bb == b && hh / g == j && sees(bb, tt, u);
          };
          check(
              got,
              [&](auto bb, auto tt, auto hh, auto xx) {
                return hit(bb, tt, hh) && (!value || xx == x) ? Expect::nan : Expect::clean;
              },
              [&](auto bb, auto hh, auto tt) {
                return hit(bb, tt, hh) && !value ? Expect::nan : Expect::clean;
              });
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, NonFinite,
                         ::testing::Values(Isa::portable, Isa::avx2, Isa::avx512, Isa::neon),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(to_string(info.param));
                         });

// ---- Helpers: softmax, log-sum-exp, the Jacobian product, merge_partials, the oracle ----

TEST(NonFiniteHelpers, SoftmaxAndLogSumExpPropagateNaN) {
  std::vector<float> z{-kInf, kNaN}, a(2, 0.0f);
  softmax_rows(z, a, 1, 2);
  EXPECT_TRUE(std::isnan(a[0]) && std::isnan(a[1])) << a[0] << " " << a[1];
  EXPECT_TRUE(std::isnan(logsumexp(z)));
  z = {kNaN, 1.0f, 2.0f};  // NaN first: std::max_element used to skip it
  a.assign(3, 0.0f);
  softmax_rows(z, a, 1, 3);
  for (float x : a) EXPECT_TRUE(std::isnan(x));
  EXPECT_TRUE(std::isnan(logsumexp(z)));
  // +∞: softmax is NaN (e^{∞−∞}), as in PyTorch; log-sum-exp is +∞ (torch.logsumexp agrees).
  z = {1.0f, kInf};
  a.assign(2, 0.0f);
  softmax_rows(z, a, 1, 2);
  EXPECT_TRUE(std::isnan(a[0]) && std::isnan(a[1]));
  EXPECT_EQ(logsumexp(z), kInf);
  // A −∞ entry next to finite ones has weight exactly 0; a row of −∞ is zeros and L = −∞.
  z = {-kInf, 0.0f};
  softmax_rows(z, a, 1, 2);
  EXPECT_EQ(a[0], 0.0f);
  EXPECT_EQ(a[1], 1.0f);
  z = {-kInf, -kInf};
  softmax_rows(z, a, 1, 2);
  EXPECT_EQ(a[0], 0.0f);
  EXPECT_EQ(a[1], 0.0f);
  EXPECT_EQ(logsumexp(z), -kInf);
  // Rows are independent: a NaN in row 0 leaves row 1 untouched.
  z = {kNaN, 0.0f, 0.0f, 0.0f};
  a.assign(4, 0.0f);
  softmax_rows(z, a, 2, 2);
  EXPECT_TRUE(std::isnan(a[0]) && std::isnan(a[1]));
  EXPECT_EQ(a[2], 0.5f);
  EXPECT_EQ(a[3], 0.5f);
}

TEST(NonFiniteHelpers, JacobianPropagatesNaN) {
  const std::vector<float> a{0.25f, kNaN, 0.75f}, g{1.0f, 2.0f, 3.0f};
  std::vector<float> out(3, 0.0f), J(9, 0.0f);
  softmax_jacobian_vector_product(a, g, out);
  for (float x : out) EXPECT_TRUE(std::isnan(x));
  softmax_jacobian(a, J);
  EXPECT_EQ(J[0], 0.25f - 0.0625f);  // J_00 = a_0 (1 − a_0): no NaN read
  EXPECT_TRUE(std::isnan(J[1]) && std::isnan(J[3]) && std::isnan(J[4]));
}

TEST(NonFiniteHelpers, MergePartialsNaNIsNotEmpty) {
  const std::int64_t B = 1, T = 5, H = 1, D = 3;
  std::vector<float> o1(T * D, 1.0f), o2(T * D, 2.0f), out(T * D, kPoison);
  std::vector<float> l1{kNaN, -kInf, 0.0f, 0.0f, -kInf}, l2{0.0f, 0.5f, -800.0f, -kInf, kNaN},
      lo(T, kPoison);
  o1[1 * D + 0] = kNaN;  // row 1: part 1 is empty (L = −∞), its O is not read
  o2[2 * D + 1] = kNaN;  // row 2: part 2's weight e^{−800} underflows to 0, but it is not empty
  merge_partials(
      ConstTensorView::bthd(o1.data(), B, T, H, D), ConstTensorView::bht(l1.data(), B, H, T),
      ConstTensorView::bthd(o2.data(), B, T, H, D), ConstTensorView::bht(l2.data(), B, H, T),
      TensorView::bthd(out.data(), B, T, H, D), TensorView::bht(lo.data(), B, H, T));
  // Rows 0 and 4: a NaN L makes the row NaN, on either side (it used to count as empty when
  // the other part was empty, std::max(−∞, NaN) being −∞).
  for (int r : {0, 4}) {
    EXPECT_TRUE(std::isnan(lo[r])) << r;
    for (int x = 0; x < D; ++x) EXPECT_TRUE(std::isnan(out[r * D + x])) << r << " " << x;
  }
  // Row 1: −∞ is empty: the result is part 2 exactly.
  EXPECT_EQ(lo[1], 0.5f);
  for (int x = 0; x < D; ++x) EXPECT_EQ(out[D + x], 2.0f) << x;
  // Row 2: 0 · NaN = NaN in column 1; the other columns are O¹.
  EXPECT_TRUE(std::isnan(out[2 * D + 1]));
  EXPECT_EQ(out[2 * D + 0], 1.0f);
  EXPECT_EQ(out[2 * D + 2], 1.0f);
  EXPECT_EQ(lo[2], 0.0f);
  // Row 3: part 2 empty.
  EXPECT_EQ(lo[3], 0.0f);
  for (int x = 0; x < D; ++x) EXPECT_EQ(out[3 * D + x], 1.0f) << x;
}

TEST(NonFiniteHelpers, OraclePropagatesNaNAndKeepsMaskedKeysOut) {
  const std::vector<double> sm =
      reference::softmax({-std::numeric_limits<double>::infinity(), std::nan("")});
  EXPECT_TRUE(std::isnan(sm[0]) && std::isnan(sm[1]));
  EXPECT_TRUE(std::isnan(reference::logsumexp({std::nan(""), 1.0})));
  // A NaN in a future key (K and V): earlier rows are finite in the oracle, later rows NaN.
  const Problem p{1, 6, 6, 1, 1, 4};
  Inputs in(p, 10);
  for (std::int64_t x = 0; x < p.D; ++x) in.k.at(0, 3, 0, x) = in.v.at(0, 3, 0, x) = kNaN;
  const auto f = reference::attention_forward(in.q.to64(), in.k.to64(), in.v.to64());
  for (std::int64_t t = 0; t < p.Tq; ++t) {
    EXPECT_EQ(std::isnan(f.lse.at(0, 0, t, 0)), t >= 3) << t;
    for (std::int64_t x = 0; x < p.D; ++x) EXPECT_EQ(std::isnan(f.out.at(0, t, 0, x)), t >= 3) << t;
  }
  StridedTensor dout(p.B, p.Tq, p.Hq, p.D, p.layout);
  std::mt19937_64 rng(11);
  dout.fill_random(rng);
  const auto g = reference::attention_backward(in.q.to64(), in.k.to64(), in.v.to64(), dout.to64());
  for (std::int64_t t = 0; t < p.Tq; ++t)
    for (std::int64_t x = 0; x < p.D; ++x) EXPECT_EQ(std::isnan(g.dq.at(0, t, 0, x)), t >= 3) << t;
}

}  // namespace
}  // namespace tokenmix::testing
