// python/src/attention.cpp — attention forward/backward (SPEC 4.2–4.5, "Backward pass") and the
// useful-work counts ("Useful-work counts"): pairs(t), P, forward and backward FLOPs.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <string>

#include "bindings.hpp"

namespace tokenmix_py {

using namespace nb::literals;

void bind_attention(nb::module_& m) {
  m.def(
      "attention_forward",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg out, std::optional<ArrayArg> lse,
         std::optional<double> scale, bool causal, const std::string& align, IntArg threads,
         const std::string& isa) {
        constexpr const char* fn = "attention_forward";
        const auto o = attention_options(fn, scale, causal, align, threads, isa);
        auto qv = in4(q, fn, "q"), kv = in4(k, fn, "k"), vv = in4(v, fn, "v");
        auto ov = out4(out, fn, "out");
        auto lv = out3_opt(lse, fn, "lse");
        nb::gil_scoped_release release;
        tmx::attention_forward(qv, kv, vv, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "causal"_a, "align"_a,
      "threads"_a, "isa"_a);

  m.def(
      "attention_backward",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg out, ArrayArg lse, ArrayArg dout, ArrayArg dq,
         ArrayArg dk, ArrayArg dv, std::optional<double> scale, bool causal,
         const std::string& align, IntArg threads, const std::string& isa) {
        constexpr const char* fn = "attention_backward";
        const auto o = attention_options(fn, scale, causal, align, threads, isa);
        auto qv = in4(q, fn, "q"), kv = in4(k, fn, "k"), vv = in4(v, fn, "v");
        auto ov = in4(out, fn, "out"), lv = in3(lse, fn, "lse"), dov = in4(dout, fn, "dout");
        auto dqv = out4(dq, fn, "dq"), dkv = out4(dk, fn, "dk"), dvv = out4(dv, fn, "dv");
        nb::gil_scoped_release release;
        tmx::attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a, "scale"_a.none(),
      "causal"_a, "align"_a, "threads"_a, "isa"_a);

  // The counts throw tokenmix::ArgumentError (invalid_argument for a t outside [0, T_q) or a
  // negative size, overflow for P > 2^63 − 1), which the translator raises as
  // tokenmix.ArgumentError; a bad align names the function as well.
  m.def(
      "visible_keys",
      [](std::int64_t t, std::int64_t T_q, std::int64_t T_k, bool causal,
         const std::string& align) {
        return tmx::visible_keys(t, T_q, T_k, causal, parse_align("visible_keys", align));
      },
      "t"_a, "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def(
      "visible_pairs",
      [](std::int64_t T_q, std::int64_t T_k, bool causal, const std::string& align) {
        return tmx::visible_pairs(T_q, T_k, causal, parse_align("visible_pairs", align));
      },
      "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def(
      "forward_flops",
      [](std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q, std::int64_t d_h,
         bool causal, const std::string& align) {
        return tmx::forward_flops(B, T_q, T_k, H_q, d_h, causal,
                                  parse_align("forward_flops", align));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a);
  m.def(
      "backward_flops",
      [](std::int64_t B, std::int64_t T_q, std::int64_t T_k, std::int64_t H_q, std::int64_t d_h,
         bool causal, const std::string& align) {
        return tmx::backward_flops(B, T_q, T_k, H_q, d_h, causal,
                                   parse_align("backward_flops", align));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a);
}

}  // namespace tokenmix_py
