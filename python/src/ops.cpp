// python/src/ops.cpp — the smaller operations: RoPE (SPEC 4.1), softmax, log-sum-exp and the
// softmax Jacobian (4.4, 4.6–4.7), and merging partial results ("Merging partial results").
#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"

namespace tokenmix_py {

using namespace nb::literals;

void bind_ops(nb::module_& m) {
  // --- RoPE (4.1) ------------------------------------------------------------------------------
  m.def(
      "rope_forward",
      [](ArrayArg x, const std::string& pairing, double base, std::int64_t offset) {
        const auto o = rope_options(pairing, base, offset);
        auto xv = out4(x, "rope_forward", "x");
        nb::gil_scoped_release release;
        tmx::rope_forward(xv, o);
      },
      "x"_a, "pairing"_a, "base"_a, "position_offset"_a);
  m.def(
      "rope_backward",
      [](ArrayArg dx, const std::string& pairing, double base, std::int64_t offset) {
        const auto o = rope_options(pairing, base, offset);
        auto xv = out4(dx, "rope_backward", "dx");
        nb::gil_scoped_release release;
        tmx::rope_backward(xv, o);
      },
      "dx"_a, "pairing"_a, "base"_a, "position_offset"_a);

  // --- softmax and its Jacobian (4.4, 4.6–4.7) -----------------------------------------------
  m.def(
      "logsumexp",
      [](ArrayArg z) {
        auto s = in_span(z, "logsumexp", "z", 1);
        nb::gil_scoped_release release;
        return tmx::logsumexp(s.data);
      },
      "z"_a);
  m.def(
      "softmax_rows",
      [](ArrayArg z, ArrayArg a) {
        constexpr const char* fn = "softmax_rows";
        auto zs = in_span(z, fn, "z", 2);
        auto as = out_span(a, fn, "a", 2);
        if (as.shape[0] != zs.shape[0] || as.shape[1] != zs.shape[1]) {
          value_error(std::string(fn) + ": a must have the shape of z " +
                      shape_string(zs.shape.data(), 2) + "; got " +
                      shape_string(as.shape.data(), 2));
        }
        nb::gil_scoped_release release;
        tmx::softmax_rows(zs.data, as.data, zs.shape[0], zs.shape[1]);
      },
      "z"_a, "a"_a);
  m.def(
      "softmax_jacobian",
      [](ArrayArg a, ArrayArg jacobian) {
        auto as = in_span(a, "softmax_jacobian", "a", 1);
        auto js = out_span(jacobian, "softmax_jacobian", "jacobian", 2);
        nb::gil_scoped_release release;
        tmx::softmax_jacobian(as.data, js.data);
      },
      "a"_a, "jacobian"_a);
  m.def(
      "softmax_jacobian_vector_product",
      [](ArrayArg a, ArrayArg g, ArrayArg out) {
        constexpr const char* fn = "softmax_jacobian_vector_product";
        auto as = in_span(a, fn, "a", 1);
        auto gs = in_span(g, fn, "g", 1);
        auto os = out_span(out, fn, "out", 1);
        nb::gil_scoped_release release;
        tmx::softmax_jacobian_vector_product(as.data, gs.data, os.data);
      },
      "a"_a, "g"_a, "out"_a);

  // --- merging partial results: L = log(e^L1 + e^L2), O = e^(L1−L) O1 + e^(L2−L) O2 ----------
  m.def(
      "merge_partials",
      [](ArrayArg o1, ArrayArg lse1, ArrayArg o2, ArrayArg lse2, ArrayArg out, ArrayArg lse_out) {
        constexpr const char* fn = "merge_partials";
        auto a = in4(o1, fn, "o1"), la = in3(lse1, fn, "lse1");
        auto b = in4(o2, fn, "o2"), lb = in3(lse2, fn, "lse2");
        auto ov = out4(out, fn, "out");
        auto lv = out3(lse_out, fn, "lse_out");
        nb::gil_scoped_release release;
        tmx::merge_partials(a, la, b, lb, ov, lv);
      },
      "o1"_a, "lse1"_a, "o2"_a, "lse2"_a, "out"_a, "lse_out"_a);
}

}  // namespace tokenmix_py
