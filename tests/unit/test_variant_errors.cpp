// tests/unit/test_variant_errors.cpp — every bad-input path of the score variants (SPEC "Score
// variants used by real models"): the variant options of attention_forward/backward, dsinks,
// the varlen entry points and the windowed useful-work counts. As in test_errors.cpp, each case
// checks the exception class and code, that the message names the entry point, the argument and
// the offending value, and that outputs keep their sentinel content (nothing was written).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "dispatch/registry.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

namespace tokenmix::testing {
namespace {

constexpr float kSentinel = 777.0f;

bool ident_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

// `word` occurs in `text` (case-insensitive) not flanked by identifier characters.
bool has_word(const std::string& text, const std::string& word) {
  std::string t = text, w = word;
  for (auto& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (auto& c : w) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (std::size_t pos = t.find(w); pos != std::string::npos; pos = t.find(w, pos + 1)) {
    const bool left_ok = pos == 0 || !ident_char(t[pos - 1]) || !ident_char(w.front());
    const std::size_t end = pos + w.size();
    const bool right_ok = end == t.size() || !ident_char(t[end]) || !ident_char(w.back());
    if (left_ok && right_ok) return true;
  }
  return false;
}

// f must throw a tokenmix::Error with `code` (UnsupportedError for unsupported, ArgumentError
// otherwise) whose message starts with "<fn>: " and contains every word.
void expect_error(const std::function<void()>& f, ErrorCode code, const std::string& fn,
                  std::initializer_list<std::string> words) {
  try {
    f();
    ADD_FAILURE() << "no exception thrown (" << fn << ")";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.code(), code) << to_string(e.code()) << ": " << msg;
    if (code == ErrorCode::unsupported) {
      EXPECT_NE(dynamic_cast<const UnsupportedError*>(&e), nullptr) << msg;
    } else {
      EXPECT_NE(dynamic_cast<const ArgumentError*>(&e), nullptr) << msg;
    }
    EXPECT_EQ(msg.rfind(fn + ": ", 0), 0u) << msg;
    for (const auto& w : words) EXPECT_TRUE(has_word(msg, w)) << "lacks \"" << w << "\": " << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a tokenmix::Error: " << e.what();
  }
}

// A small valid problem: B = 2, T_q = 5, T_k = 6, H_q = 4, H_kv = 2, d_h = 3, portable path.
struct Problem {
  static constexpr std::int64_t B = 2, Tq = 5, Tk = 6, Hq = 4, Hkv = 2, D = 3;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv, per_head, dsinks, weights;
  std::vector<std::uint8_t> mask;
  std::vector<std::int32_t> lengths;
  AttentionOptions o;

  Problem()
      : q(B * Tq * Hq * D, 0.5f),
        k(B * Tk * Hkv * D, 0.25f),
        v(B * Tk * Hkv * D, 1.0f),
        out(B * Tq * Hq * D, kSentinel),
        lse(B * Hq * Tq, kSentinel),
        dout(B * Tq * Hq * D, 1.0f),
        dq(B * Tq * Hq * D, kSentinel),
        dk(B * Tk * Hkv * D, kSentinel),
        dv(B * Tk * Hkv * D, kSentinel),
        per_head(Hq, 0.5f),
        dsinks(Hq, kSentinel),
        weights(B * Hq * Tq * Tk, kSentinel),
        mask(B * Hq * Tq * Tk, 1),
        lengths{3, 6} {
    o.isa = Isa::portable;
  }
  ConstTensorView vec(std::int64_t n) const { return {per_head.data(), DType::f32, 1, {n}, {1}}; }
  ConstTensorView full_mask() const {
    return {mask.data(), DType::boolean, 4, {B, Hq, Tq, Tk}, {Hq * Tq * Tk, Tq * Tk, Tk, 1}};
  }
  void forward() {
    attention_forward(ConstTensorView::bthd(q.data(), B, Tq, Hq, D),
                      ConstTensorView::bthd(k.data(), B, Tk, Hkv, D),
                      ConstTensorView::bthd(v.data(), B, Tk, Hkv, D),
                      TensorView::bthd(out.data(), B, Tq, Hq, D),
                      TensorView::bht(lse.data(), B, Hq, Tq), o);
  }
  void backward(TensorView ds) {
    attention_backward(ConstTensorView::bthd(q.data(), B, Tq, Hq, D),
                       ConstTensorView::bthd(k.data(), B, Tk, Hkv, D),
                       ConstTensorView::bthd(v.data(), B, Tk, Hkv, D),
                       ConstTensorView::bthd(out.data(), B, Tq, Hq, D),
                       ConstTensorView::bht(lse.data(), B, Hq, Tq),
                       ConstTensorView::bthd(dout.data(), B, Tq, Hq, D),
                       TensorView::bthd(dq.data(), B, Tq, Hq, D),
                       TensorView::bthd(dk.data(), B, Tk, Hkv, D),
                       TensorView::bthd(dv.data(), B, Tk, Hkv, D), o, ds);
  }
  // attention_weights over every head and row, weights [B, H_q, T_q, T_k] contiguous unless
  // `view` is given.
  void weights_call(const WeightsSelection& select = {}, std::optional<TensorView> view = {}) {
    attention_weights(ConstTensorView::bthd(q.data(), B, Tq, Hq, D),
                      ConstTensorView::bthd(k.data(), B, Tk, Hkv, D),
                      ConstTensorView::bht(lse.data(), B, Hq, Tq),
                      view.value_or(weights_view(Hq, Tq)), o, select);
  }
  TensorView weights_view(std::int64_t heads, std::int64_t rows) {
    return {
        weights.data(), DType::f32, 4, {B, heads, rows, Tk}, {heads * rows * Tk, rows * Tk, Tk, 1}};
  }
  bool untouched() const {
    for (float x : weights)
      if (x != kSentinel) return false;
    for (float x : out)
      if (x != kSentinel) return false;
    for (float x : dq)
      if (x != kSentinel) return false;
    for (float x : dsinks)
      if (x != kSentinel) return false;
    return true;
  }
};

// Runs `set` on a fresh problem's options, expects the forward to fail as described and the
// outputs untouched.
void expect_forward_error(const std::function<void(Problem&)>& set, ErrorCode code,
                          std::initializer_list<std::string> words) {
  Problem p;
  set(p);
  expect_error([&] { p.forward(); }, code, "attention_forward", words);
  EXPECT_TRUE(p.untouched());
  // The backward validates the same options.
  Problem b;
  set(b);
  expect_error([&] { b.backward({}); }, code, "attention_backward", words);
  EXPECT_TRUE(b.untouched());
  // So do the attention weights.
  Problem w;
  set(w);
  expect_error([&] { w.weights_call(); }, code, "attention_weights", words);
  EXPECT_TRUE(w.untouched());
}

TEST(VariantErrors, WindowAndSoftcap) {
  for (std::int64_t w : {0, -3}) {
    expect_forward_error([&](Problem& p) { p.o.window = w; }, ErrorCode::invalid_argument,
                         {"options.window", std::to_string(w), "1"});
  }
  const double inf = std::numeric_limits<double>::infinity();
  for (double c : {0.0, -1.0, inf, -inf}) {
    expect_forward_error([&](Problem& p) { p.o.softcap = c; }, ErrorCode::invalid_argument,
                         {"options.softcap", "0"});
  }
  expect_forward_error([&](Problem& p) { p.o.softcap = std::numeric_limits<double>::quiet_NaN(); },
                       ErrorCode::invalid_argument, {"options.softcap", "nan"});
  // Finite in double but not in float32 (overflow to ∞, underflow to 0).
  expect_forward_error([&](Problem& p) { p.o.softcap = 1e300; }, ErrorCode::invalid_argument,
                       {"options.softcap", "float32", "1e+300"});
  expect_forward_error([&](Problem& p) { p.o.softcap = 1e-60; }, ErrorCode::invalid_argument,
                       {"options.softcap", "float32", "1e-60"});
}

TEST(VariantErrors, PerHeadVectors) {
  for (const char* which : {"alibi_slopes", "sinks"}) {
    SCOPED_TRACE(which);
    const std::string name = std::string("options.") + which;
    auto slot = [&](Problem& p) -> ConstTensorView& {
      return std::string(which) == "sinks" ? p.o.sinks : p.o.alibi_slopes;
    };
    expect_forward_error([&](Problem& p) { slot(p) = p.vec(Problem::Hq - 1); },
                         ErrorCode::shape_mismatch, {name, "H_q", "4", "3"});
    expect_forward_error(
        [&](Problem& p) {
          slot(p) = p.vec(Problem::Hq);
          slot(p).rank = 2;
        },
        ErrorCode::shape_mismatch, {name, "rank", "1", "2"});
    expect_forward_error(
        [&](Problem& p) {
          slot(p) = p.vec(Problem::Hq);
          slot(p).dtype = DType::bf16;
        },
        ErrorCode::unsupported, {name, "bf16", "f32"});
    expect_forward_error(
        [&](Problem& p) {
          slot(p) = p.vec(Problem::Hq);
          slot(p).strides[0] = -1;
        },
        ErrorCode::invalid_argument, {name + ".strides[0]", "-1"});
    expect_forward_error(
        [&](Problem& p) {
          slot(p) = p.vec(Problem::Hq);
          slot(p).strides[0] = INT64_MAX / 2;
        },
        ErrorCode::overflow, {name});
  }
}

TEST(VariantErrors, KeyLengths) {
  auto lengths = [](Problem& p, DType dtype = DType::i32) {
    p.o.key_lengths = {p.lengths.data(), dtype, 1, {Problem::B}, {1}};
  };
  expect_forward_error(
      [&](Problem& p) {
        p.lengths[1] = 7;  // T_k = 6
        lengths(p);
      },
      ErrorCode::invalid_argument, {"options.key_lengths[1]", "7", "T_k", "6"});
  expect_forward_error(
      [&](Problem& p) {
        p.lengths[0] = -1;
        lengths(p);
      },
      ErrorCode::invalid_argument, {"options.key_lengths[0]", "-1"});
  expect_forward_error([&](Problem& p) { lengths(p, DType::f32); }, ErrorCode::unsupported,
                       {"options.key_lengths", "f32", "i32", "i64"});
  expect_forward_error(
      [&](Problem& p) {
        lengths(p);
        p.o.key_lengths.shape[0] = 3;
      },
      ErrorCode::shape_mismatch, {"options.key_lengths", "B", "2", "3"});
  expect_forward_error(
      [&](Problem& p) {
        lengths(p);
        p.o.key_lengths.rank = 2;
      },
      ErrorCode::shape_mismatch, {"options.key_lengths", "rank"});
  // i64 lengths are read as such: 2^32 + 1 is out of range, not 1.
  std::vector<std::int64_t> big{(std::int64_t{1} << 32) + 1, 2};
  expect_forward_error(
      [&](Problem& p) {
        p.o.key_lengths = {big.data(), DType::i64, 1, {Problem::B}, {1}};
      },
      ErrorCode::invalid_argument, {"options.key_lengths[0]", "4294967297"});
}

TEST(VariantErrors, Masks) {
  expect_forward_error(
      [&](Problem& p) {
        p.o.mask = p.full_mask();
        p.o.mask.shape[2] = 4;  // T_q = 5
      },
      ErrorCode::shape_mismatch, {"options.mask.shape[2]", "T_q", "5", "4"});
  expect_forward_error(
      [&](Problem& p) {
        p.o.mask = p.full_mask();
        p.o.mask.shape[3] = 7;  // T_k = 6
      },
      ErrorCode::shape_mismatch, {"options.mask.shape[3]", "T_k", "6", "7"});
  expect_forward_error(
      [&](Problem& p) {
        p.o.mask = p.full_mask();
        p.o.mask.rank = 3;
      },
      ErrorCode::shape_mismatch, {"options.mask", "rank", "4", "3"});
  for (DType bad : {DType::i32, DType::bf16, DType::i64}) {
    expect_forward_error(
        [&](Problem& p) {
          p.o.mask = p.full_mask();
          p.o.mask.dtype = bad;
        },
        ErrorCode::unsupported, {"options.mask", to_string(bad), "bool", "f32"});
  }
  expect_forward_error(
      [&](Problem& p) {
        p.o.mask = p.full_mask();
        p.o.mask.strides[1] = -2;
      },
      ErrorCode::invalid_argument, {"options.mask.strides[1]", "-2"});
  expect_forward_error(
      [&](Problem& p) {
        p.o.mask = p.full_mask();
        p.o.mask.strides[1] = INT64_MAX / 2;  // 3 · stride overflows
      },
      ErrorCode::overflow, {"options.mask"});
  // A size-1 (broadcast) dimension may have any stride, a huge one included: it is never used.
  {
    Problem p;
    p.o.mask = p.full_mask();
    p.o.mask.shape[0] = 1;
    p.o.mask.strides[0] = INT64_MAX / 2;
    EXPECT_NO_THROW(p.forward());
  }
  // A boolean mask overlapping an output (its bytes inside out): aliasing.
  {
    Problem p;
    p.o.mask = {
        p.out.data(), DType::boolean, 4, {1, 1, Problem::Tq, Problem::Tk}, {0, 0, Problem::Tk, 1}};
    expect_error([&] { p.forward(); }, ErrorCode::aliasing, "attention_forward",
                 {"out", "options.mask"});
    Problem b;
    b.o.mask = {b.dq.data(), DType::boolean, 4, {1, 1, 1, 1}, {0, 0, 0, 0}};
    expect_error([&] { b.backward({}); }, ErrorCode::aliasing, "attention_backward",
                 {"dq", "options.mask"});
  }
  // An f32 (bias) mask overlapping an output: aliasing.
  {
    Problem p;
    p.o.mask = {
        p.out.data(), DType::f32, 4, {1, 1, Problem::Tq, Problem::Tk}, {0, 0, Problem::Tk, 1}};
    expect_error([&] { p.forward(); }, ErrorCode::aliasing, "attention_forward",
                 {"out", "options.mask"});
  }
}

TEST(VariantErrors, Dsinks) {
  // dsinks without sinks.
  {
    Problem p;
    expect_error(
        [&] {
          p.backward({p.dsinks.data(), DType::f32, 1, {Problem::Hq}, {1}});
        },
        ErrorCode::invalid_argument, "attention_backward", {"dsinks", "options.sinks"});
    EXPECT_TRUE(p.untouched());
  }
  // Wrong size, dtype, rank; overlapping an input.
  auto with_sinks = [](Problem& p) { p.o.sinks = p.vec(Problem::Hq); };
  {
    Problem p;
    with_sinks(p);
    expect_error(
        [&] {
          p.backward({p.dsinks.data(), DType::f32, 1, {3}, {1}});
        },
        ErrorCode::shape_mismatch, "attention_backward", {"dsinks", "H_q", "4", "3"});
  }
  {
    Problem p;
    with_sinks(p);
    expect_error(
        [&] {
          p.backward({p.dsinks.data(), DType::bf16, 1, {Problem::Hq}, {1}});
        },
        ErrorCode::unsupported, "attention_backward", {"dsinks", "bf16"});
  }
  {
    Problem p;
    with_sinks(p);
    expect_error(
        [&] {
          p.backward({p.dsinks.data(), DType::f32, 2, {Problem::Hq, 1}, {1, 1}});
        },
        ErrorCode::shape_mismatch, "attention_backward", {"dsinks", "rank"});
  }
  {
    Problem p;
    with_sinks(p);
    expect_error(
        [&] {
          p.backward({p.dout.data(), DType::f32, 1, {Problem::Hq}, {1}});
        },
        ErrorCode::aliasing, "attention_backward", {"dsinks", "dout"});
    expect_error(
        [&] {
          p.backward({p.per_head.data(), DType::f32, 1, {Problem::Hq}, {1}});
        },
        ErrorCode::aliasing, "attention_backward", {"dsinks", "options.sinks"});
    expect_error(
        [&] {
          p.backward({p.dsinks.data(), DType::f32, 1, {Problem::Hq}, {0}});
        },
        ErrorCode::aliasing, "attention_backward", {"dsinks", "strides[0]"});
  }
}

// A path without score_variants refuses every variant, naming the kernel and the variant; with
// no variant the same call runs.
TEST(VariantErrors, PathsWithoutTheFlagRefuseVariants) {
  for (Isa isa : testkit::concrete_isas()) {
    if (!testkit::isa_unavailable_reason(isa).empty()) continue;  // not runnable here
    if (kernels::kernel_set(isa).score_variants) {  // runs them: checked in test_variants.cpp
      Problem p;
      p.o.isa = isa;
      p.o.window = 2;
      EXPECT_NO_THROW(p.forward());
      continue;
    }
    SCOPED_TRACE(to_string(isa));
    Problem p;
    p.o.isa = isa;
    EXPECT_NO_THROW(p.forward());
    p.out.assign(p.out.size(), kSentinel);
    p.o.softcap = 3.0;
    p.o.window = 2;
    expect_error([&] { p.forward(); }, ErrorCode::unsupported, "attention_forward",
                 {std::string("attention_fwd_f32_") + to_string(isa), "window", "softcap"});
    EXPECT_TRUE(p.untouched());
  }
}

// ---------------------------------------------------------------------------------------------
// Varlen

struct Packed {
  static constexpr std::int64_t Hq = 2, Hkv = 1, D = 4;
  std::vector<float> q, k, v, out, lse, dq, dk, dv;
  std::vector<std::int64_t> cu_q{0, 2, 2, 5}, cu_k{0, 3, 4, 4};
  AttentionOptions o;
  Packed()
      : q(5 * Hq * D, 0.1f),
        k(4 * Hkv * D, 0.2f),
        v(4 * Hkv * D, 0.3f),
        out(5 * Hq * D, kSentinel),
        lse(Hq * 5, kSentinel),
        dq(5 * Hq * D, kSentinel),
        dk(4 * Hkv * D, kSentinel),
        dv(4 * Hkv * D, kSentinel) {
    o.isa = Isa::portable;
  }
  static TensorView t3(std::vector<float>& x, std::int64_t n, std::int64_t h) {
    return {x.data(), DType::f32, 3, {n, h, D}, {h * D, D, 1}};
  }
  ConstTensorView cu(std::vector<std::int64_t>& c) const {
    return {c.data(), DType::i64, 1, {static_cast<std::int64_t>(c.size())}, {1}};
  }
  void forward() {
    attention_forward_varlen(t3(q, 5, Hq), t3(k, 4, Hkv), t3(v, 4, Hkv), cu(cu_q), cu(cu_k),
                             t3(out, 5, Hq), {lse.data(), DType::f32, 2, {Hq, 5}, {5, 1}}, o);
  }
  void backward(TensorView ds = {}) {
    attention_backward_varlen(t3(q, 5, Hq), t3(k, 4, Hkv), t3(v, 4, Hkv), t3(q, 5, Hq),
                              {lse.data(), DType::f32, 2, {Hq, 5}, {5, 1}}, t3(q, 5, Hq), cu(cu_q),
                              cu(cu_k), t3(dq, 5, Hq), t3(dk, 4, Hkv), t3(dv, 4, Hkv), o, ds);
  }
  bool untouched() const {
    for (float x : out)
      if (x != kSentinel) return false;
    for (float x : dq)
      if (x != kSentinel) return false;
    return true;
  }
};

void expect_varlen_error(const std::function<void(Packed&)>& set, ErrorCode code,
                         std::initializer_list<std::string> words) {
  Packed f;
  set(f);
  expect_error([&] { f.forward(); }, code, "attention_forward_varlen", words);
  EXPECT_TRUE(f.untouched());
  Packed b;
  set(b);
  expect_error([&] { b.backward(); }, code, "attention_backward_varlen", words);
  EXPECT_TRUE(b.untouched());
}

TEST(VariantErrors, VarlenOffsets) {
  {
    Packed p;  // the valid problem runs
    EXPECT_NO_THROW(p.forward());
    EXPECT_NO_THROW(p.backward());
  }
  expect_varlen_error(
      [](Packed& p) {
        p.cu_q = {0, 2, 7, 5};
      },
      ErrorCode::invalid_argument, {"cu_seqlens_q[3]", "5", "cu_seqlens_q[2]", "7"});
  expect_varlen_error(
      [](Packed& p) {
        p.cu_k = {0, 3, 1, 4};
      },
      ErrorCode::invalid_argument, {"cu_seqlens_k[2]", "1", "cu_seqlens_k[1]", "3"});
  expect_varlen_error(
      [](Packed& p) {
        p.cu_q = {1, 2, 2, 5};
      },
      ErrorCode::invalid_argument, {"cu_seqlens_q[0]", "0", "1"});
  expect_varlen_error(
      [](Packed& p) {
        p.cu_q = {0, 2, 2, 4};
      },
      ErrorCode::invalid_argument, {"cu_seqlens_q[3]", "4", "total_q", "5"});
  expect_varlen_error(
      [](Packed& p) {
        p.cu_k = {0, 3, 4, 4, 4};
      },
      ErrorCode::shape_mismatch, {"cu_seqlens_k.shape[0]", "4", "5"});
  expect_varlen_error([](Packed& p) { p.cu_q.clear(); }, ErrorCode::shape_mismatch,
                      {"cu_seqlens_q.shape[0]", "0"});
  {
    Packed p;  // dtype and rank of the offsets
    std::vector<float> fcu{0, 2, 2, 5};
    expect_error(
        [&] {
          attention_forward_varlen(Packed::t3(p.q, 5, Packed::Hq), Packed::t3(p.k, 4, Packed::Hkv),
                                   Packed::t3(p.v, 4, Packed::Hkv),
                                   {fcu.data(), DType::f32, 1, {4}, {1}}, p.cu(p.cu_k),
                                   Packed::t3(p.out, 5, Packed::Hq), {}, p.o);
        },
        ErrorCode::unsupported, "attention_forward_varlen", {"cu_seqlens_q", "f32", "i32"});
    expect_error(
        [&] {
          attention_forward_varlen(Packed::t3(p.q, 5, Packed::Hq), Packed::t3(p.k, 4, Packed::Hkv),
                                   Packed::t3(p.v, 4, Packed::Hkv), p.cu(p.cu_q),
                                   {p.cu_k.data(), DType::i64, 2, {2, 2}, {2, 1}},
                                   Packed::t3(p.out, 5, Packed::Hq), {}, p.o);
        },
        ErrorCode::shape_mismatch, "attention_forward_varlen", {"cu_seqlens_k", "rank", "2"});
    EXPECT_TRUE(p.untouched());
  }
}

TEST(VariantErrors, VarlenShapesAndOptions) {
  Packed p;
  // q of rank 4.
  expect_error(
      [&] {
        attention_forward_varlen(TensorView::bthd(p.q.data(), 1, 5, Packed::Hq, Packed::D),
                                 Packed::t3(p.k, 4, Packed::Hkv), Packed::t3(p.v, 4, Packed::Hkv),
                                 p.cu(p.cu_q), p.cu(p.cu_k), Packed::t3(p.out, 5, Packed::Hq), {},
                                 p.o);
      },
      ErrorCode::shape_mismatch, "attention_forward_varlen", {"q", "rank", "3", "4"});
  // v with another total, k with another d_h, H_kv not dividing H_q.
  expect_error(
      [&] {
        attention_forward_varlen(Packed::t3(p.q, 5, Packed::Hq), Packed::t3(p.k, 4, Packed::Hkv),
                                 Packed::t3(p.v, 3, Packed::Hkv), p.cu(p.cu_q), p.cu(p.cu_k),
                                 Packed::t3(p.out, 5, Packed::Hq), {}, p.o);
      },
      ErrorCode::shape_mismatch, "attention_forward_varlen", {"v.shape[0]", "4", "3"});
  std::vector<float> k3(4 * 3 * Packed::D, 0.0f);
  expect_error(
      [&] {
        attention_forward_varlen(Packed::t3(p.q, 5, Packed::Hq), Packed::t3(k3, 4, 3),
                                 Packed::t3(k3, 4, 3), p.cu(p.cu_q), p.cu(p.cu_k),
                                 Packed::t3(p.out, 5, Packed::Hq), {}, p.o);
      },
      ErrorCode::shape_mismatch, "attention_forward_varlen", {"H_kv", "3", "H_q"});
  // lse must be [H_q, total_q].
  expect_error(
      [&] {
        attention_forward_varlen(Packed::t3(p.q, 5, Packed::Hq), Packed::t3(p.k, 4, Packed::Hkv),
                                 Packed::t3(p.v, 4, Packed::Hkv), p.cu(p.cu_q), p.cu(p.cu_k),
                                 Packed::t3(p.out, 5, Packed::Hq),
                                 {p.lse.data(), DType::f32, 2, {5, Packed::Hq}, {2, 1}}, p.o);
      },
      ErrorCode::shape_mismatch, "attention_forward_varlen", {"lse.shape[0]", "H_q", "2", "5"});
  EXPECT_TRUE(p.untouched());
  // mask and key_lengths are refused; a bad window too.
  std::vector<std::uint8_t> m(5 * 4, 1);
  std::vector<std::int32_t> lens{1};
  expect_varlen_error(
      [&](Packed& x) {
        x.o.mask = {m.data(), DType::boolean, 4, {1, 1, 5, 4}, {0, 0, 4, 1}};
      },
      ErrorCode::unsupported, {"options.mask"});
  expect_varlen_error(
      [&](Packed& x) {
        x.o.key_lengths = {lens.data(), DType::i32, 1, {1}, {1}};
      },
      ErrorCode::unsupported, {"options.key_lengths"});
  expect_varlen_error([](Packed& x) { x.o.window = 0; }, ErrorCode::invalid_argument,
                      {"options.window", "0"});
  // dsinks without sinks.
  Packed d;
  std::vector<float> ds(Packed::Hq, kSentinel);
  expect_error(
      [&] {
        d.backward({ds.data(), DType::f32, 1, {Packed::Hq}, {1}});
      },
      ErrorCode::invalid_argument, "attention_backward_varlen", {"dsinks"});
}

TEST(VariantErrors, WindowedCounts) {
  const auto br = CausalAlign::bottom_right;
  expect_error([&] { visible_pairs_windowed(4, 4, true, br, 0); }, ErrorCode::invalid_argument,
               "visible_pairs_windowed", {"window", "0"});
  expect_error([&] { visible_keys_windowed(0, 4, 4, true, br, -2); }, ErrorCode::invalid_argument,
               "visible_keys_windowed", {"window", "-2"});
  expect_error([&] { visible_keys_windowed(4, 4, 4, true, br, 2); }, ErrorCode::invalid_argument,
               "visible_keys_windowed", {"t", "4"});
  expect_error([&] { forward_flops_windowed(1, -1, 4, 1, 1, true, br, 2); },
               ErrorCode::invalid_argument, "forward_flops_windowed", {"T_q", "-1"});
  expect_error([&] { backward_flops_windowed(1, 4, 4, 1, 1, true, br, 0); },
               ErrorCode::invalid_argument, "backward_flops_windowed", {"window", "0"});
  // Overflow only when the windowed count itself exceeds int64.
  const std::int64_t T = std::int64_t{6} << 30;
  expect_error([&] { visible_pairs_windowed(T, T, false, br, INT64_MAX); }, ErrorCode::overflow,
               "visible_pairs_windowed", {"T_q", "window"});
  EXPECT_NO_THROW(visible_pairs_windowed(T, T, true, br, 4096));
}

// attention_weights' own arguments (its options share the checks above: expect_forward_error
// runs it too): the selection, the weights view, lse, q and k. Nothing is written on error.
TEST(VariantErrors, AttentionWeights) {
  const char* fn = "attention_weights";
  constexpr std::int64_t B = Problem::B, Tq = Problem::Tq, Tk = Problem::Tk, Hq = Problem::Hq;
  auto expect = [&](const std::function<void(Problem&)>& call, ErrorCode code,
                    std::initializer_list<std::string> words) {
    Problem p;
    expect_error([&] { call(p); }, code, fn, words);
    EXPECT_TRUE(p.untouched());
  };
  // Head indices outside [0, H_q), named with their position in select.heads.
  for (std::int64_t h : {-1, 4, 100}) {
    expect(
        [&](Problem& p) {
          WeightsSelection s;
          s.heads = {0, h};
          p.weights_call(s, p.weights_view(2, Tq));
        },
        ErrorCode::invalid_argument, {"select.heads[1]", std::to_string(h), "H_q", "4"});
  }
  // Row ranges: negative begin, end before begin, end past T_q.
  for (const auto& range : {std::pair<std::int64_t, std::int64_t>{-1, 3}, {3, 2}, {0, 6}}) {
    expect(
        [&](Problem& p) {
          WeightsSelection s;
          s.row_begin = range.first;
          s.row_end = range.second;
          p.weights_call(s, p.weights_view(Hq, 1));
        },
        ErrorCode::invalid_argument,
        {"select.row_begin", "select.row_end", "T_q", "5", std::to_string(range.first),
         std::to_string(range.second)});
  }
  // The weights' shape against B, the selection and T_k.
  expect([&](Problem& p) { p.weights_call({}, p.weights_view(Hq - 1, Tq)); },
         ErrorCode::shape_mismatch, {"weights", "heads", "4", "3"});
  expect(
      [&](Problem& p) {
        WeightsSelection s;
        s.heads = {2, 2, 0};
        p.weights_call(s, p.weights_view(2, Tq));
      },
      ErrorCode::shape_mismatch, {"weights", "select.heads.size()", "3", "2"});
  expect(
      [&](Problem& p) {
        WeightsSelection s;
        s.row_begin = 1;
        s.row_end = 4;
        p.weights_call(s, p.weights_view(Hq, 2));
      },
      ErrorCode::shape_mismatch, {"weights", "rows", "3", "2"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.shape[3] = Tk - 1;
        p.weights_call({}, w);
      },
      ErrorCode::shape_mismatch, {"weights", "T_k", "6", "5"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.shape[0] = B + 1;
        p.weights_call({}, w);
      },
      ErrorCode::shape_mismatch, {"weights", "B", "2", "3"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.rank = 3;
        p.weights_call({}, w);
      },
      ErrorCode::shape_mismatch, {"weights", "rank", "4", "3"});
  // Dtype, null pointer, strides, overflow, aliasing.
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.dtype = DType::bf16;
        p.weights_call({}, w);
      },
      ErrorCode::unsupported, {"weights", "bf16"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.data = nullptr;
        p.weights_call({}, w);
      },
      ErrorCode::null_pointer, {"weights"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.strides[2] = -1;
        p.weights_call({}, w);
      },
      ErrorCode::invalid_argument, {"weights.strides[2]", "-1"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.strides[1] = INT64_MAX / 2;
        p.weights_call({}, w);
      },
      ErrorCode::overflow, {"weights"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.strides[3] = 0;  // T_k > 1 keys on one element: the output overlaps itself
        p.weights_call({}, w);
      },
      ErrorCode::aliasing, {"weights"});
  expect(
      [&](Problem& p) {
        TensorView w = p.weights_view(Hq, Tq);
        w.data = p.lse.data();  // weights over the lse it reads
        p.weights_call({}, w);
      },
      ErrorCode::aliasing, {"weights", "lse"});
  // lse: shape and dtype; q and k: shapes against each other and one dtype.
  expect(
      [&](Problem& p) {
        attention_weights(ConstTensorView::bthd(p.q.data(), B, Tq, Hq, Problem::D),
                          ConstTensorView::bthd(p.k.data(), B, Tk, Problem::Hkv, Problem::D),
                          ConstTensorView::bht(p.lse.data(), B, Hq, Tq - 1), p.weights_view(Hq, Tq),
                          p.o);
      },
      ErrorCode::shape_mismatch, {"lse", "T_q", "5", "4"});
  expect(
      [&](Problem& p) {
        attention_weights(ConstTensorView::bthd(p.q.data(), B, Tq, Hq, Problem::D),
                          ConstTensorView::bthd(p.k.data(), B, Tk, 3, Problem::D),
                          ConstTensorView::bht(p.lse.data(), B, Hq, Tq), p.weights_view(Hq, Tq),
                          p.o);
      },
      ErrorCode::shape_mismatch, {"k.shape[2]", "H_kv", "3"});
  expect(
      [&](Problem& p) {
        ConstTensorView k = ConstTensorView::bthd(p.k.data(), B, Tk, Problem::Hkv, Problem::D);
        k.dtype = DType::f16;
        attention_weights(ConstTensorView::bthd(p.q.data(), B, Tq, Hq, Problem::D), k,
                          ConstTensorView::bht(p.lse.data(), B, Hq, Tq), p.weights_view(Hq, Tq),
                          p.o);
      },
      ErrorCode::invalid_argument, {"q", "k", "f32", "f16"});
  expect(
      [&](Problem& p) {
        attention_weights(ConstTensorView::bthd(p.q.data(), B, Tq, Hq, Problem::D),
                          ConstTensorView::bthd(static_cast<const float*>(nullptr), B, Tk,
                                                Problem::Hkv, Problem::D),
                          ConstTensorView::bht(p.lse.data(), B, Hq, Tq), p.weights_view(Hq, Tq),
                          p.o);
      },
      ErrorCode::null_pointer, {"k"});
  // An empty selection of rows is valid and writes nothing.
  {
    Problem p;
    WeightsSelection s;
    s.row_begin = 2;
    s.row_end = 2;
    EXPECT_NO_THROW(p.weights_call(s, p.weights_view(Hq, 0)));
    EXPECT_TRUE(p.untouched());
  }
}

}  // namespace
}  // namespace tokenmix::testing
