// python/src/attention.cpp — attention forward/backward (SPEC 4.2–4.5, "Backward pass"), their
// score variants and varlen form (SPEC "Score variants used by real models") and the useful-work
// counts ("Useful-work counts"): pairs(t), P, forward and backward FLOPs. q, k, v, out, dout,
// dq, dk, dv are float32, bfloat16 or float16, one dtype per call (SPEC "Reduced precision");
// lse, sinks, dsinks and ALiBi slopes stay float32.
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "native_entry.hpp"

namespace tokenmix_py {

using namespace nb::literals;

namespace {

using Dims = std::array<std::int64_t, 4>;

// A view of a live PyTorch CPU tensor given by data_ptr(), a dtype code (tokenmix::DType: 0 f32,
// 1 bf16, 2 f16), its shape and strides in PyTorch's [B, H, T, E] order: the [B, T, H, E] view
// swaps axes 1 and 2 (no copy, no transpose object).
tmx::TensorView torch_view(const char* fn, const char* name, std::uintptr_t ptr, int dtype,
                           const Dims& shape, const Dims& strides) {
  if (dtype < 0 || dtype > 2) {
    throw tmx::ArgumentError(tmx::ErrorCode::invalid_argument,
                             std::string(fn) + ": " + name +
                                 " must be float32, bfloat16 or "
                                 "float16 (dtype code 0, 1 or 2); got code " +
                                 std::to_string(dtype));
  }
  return {reinterpret_cast<void*>(ptr),
          static_cast<tmx::DType>(dtype),
          4,
          {shape[0], shape[2], shape[1], shape[3]},
          {strides[0], strides[2], strides[1], strides[3]}};
}

// lse [B, H, T] float32 at `ptr` with strides `s`.
tmx::TensorView lse_view(std::uintptr_t ptr, const Dims& shape,
                         const std::array<std::int64_t, 3>& s) {
  return {reinterpret_cast<void*>(ptr),
          tmx::DType::f32,
          3,
          {shape[0], shape[1], shape[2], 1},
          {s[0], s[1], s[2], 0}};
}

tmx::AttentionOptions torch_options(std::optional<double> scale, bool causal, bool bottom_right,
                                    int threads) {
  tmx::AttentionOptions o;
  o.scale = scale;
  o.causal = causal;
  o.align = bottom_right ? tmx::CausalAlign::bottom_right : tmx::CausalAlign::top_left;
  o.threads = threads;
  return o;
}

// The message the native node raises for an exception of the library (native_entry.hpp).
std::string native_error(const char* kind, tmx::ErrorCode code, const char* what) {
  return std::string("tokenmix-native[") + kind + ":" + tmx::to_string(code) + "] " + what;
}

template <class Call>
bool native_call(Call&& call, std::string* error) noexcept {
  try {
    call();
    return true;
  } catch (const tmx::UnsupportedError& e) {
    *error = native_error("UnsupportedError", e.code(), e.what());
  } catch (const tmx::ResourceError& e) {
    *error = native_error("ResourceError", e.code(), e.what());
  } catch (const tmx::FileError& e) {
    *error = native_error("FileError", e.code(), e.what());
  } catch (const tmx::Error& e) {
    *error = native_error("ArgumentError", e.code(), e.what());
  } catch (const std::bad_alloc&) {
    *error = native_error("ResourceError", tmx::ErrorCode::out_of_memory, "out of memory");
  } catch (const std::exception& e) {  // not the library's: a bug, reported as such
    *error = std::string("tokenmix-native[RuntimeError:internal] ") + e.what();
  }
  return false;
}

}  // namespace

const NativeEntryPoints& native_entry_points() {
  static const NativeEntryPoints table = [] {
    NativeEntryPoints t;
    t.forward = [](tmx::ConstTensorView q, tmx::ConstTensorView k, tmx::ConstTensorView v,
                   tmx::TensorView out, tmx::TensorView lse, const tmx::AttentionOptions& o,
                   std::string* error) noexcept {
      return native_call([&] { tmx::attention_forward(q, k, v, out, lse, o); }, error);
    };
    t.backward = [](tmx::ConstTensorView q, tmx::ConstTensorView k, tmx::ConstTensorView v,
                    tmx::ConstTensorView out, tmx::ConstTensorView lse, tmx::ConstTensorView dout,
                    tmx::TensorView dq, tmx::TensorView dk, tmx::TensorView dv,
                    const tmx::AttentionOptions& o, std::string* error) noexcept {
      return native_call(
          [&] { tmx::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o, {}); }, error);
    };
    return t;
  }();
  return table;
}

void bind_attention(nb::module_& m) {
  // The address of native_entry_points(), for the PyTorch autograd node (tokenmix._native).
  m.def("_native_entry_points",
        [] { return reinterpret_cast<std::uintptr_t>(&native_entry_points()); });

  // The score variants (window, softcap, ALiBi, sinks, mask, key_lengths; SPEC "Score variants
  // used by real models") are keyword arguments with None = off, so older callers still work.
  m.def(
      "attention_forward",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg out, std::optional<ArrayArg> lse,
         std::optional<double> scale, bool causal, const std::string& align, IntArg threads,
         const std::string& isa, std::optional<IntArg> window, std::optional<double> softcap,
         std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks,
         std::optional<ArrayArg> mask, std::optional<ArrayArg> key_lengths, double dropout_p,
         IntArg dropout_seed, IntArg dropout_offset) {
        constexpr const char* fn = "attention_forward";
        auto o = attention_options(fn, scale, causal, align, threads, isa);
        add_variants(o, fn, {window, softcap, alibi_slopes, sinks, mask, key_lengths});
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto qv = in_float(q, fn, "q", 4), kv = in_float(k, fn, "k", 4);
        auto vv = in_float(v, fn, "v", 4);
        auto ov = out_float(out, fn, "out", 4);
        check_same_dtype(fn,
                         {{"q", qv.dtype}, {"k", kv.dtype}, {"v", vv.dtype}, {"out", ov.dtype}});
        auto lv = out3_opt(lse, fn, "lse");
        nb::gil_scoped_release release;
        tmx::attention_forward(qv, kv, vv, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a.none(), "scale"_a.none(), "causal"_a, "align"_a,
      "threads"_a, "isa"_a, "window"_a.none() = nb::none(), "softcap"_a.none() = nb::none(),
      "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
      "mask"_a.none() = nb::none(), "key_lengths"_a.none() = nb::none(), "dropout_p"_a = 0.0,
      "dropout_seed"_a = 0, "dropout_offset"_a = 0);

  m.def(
      "attention_backward",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg out, ArrayArg lse, ArrayArg dout, ArrayArg dq,
         ArrayArg dk, ArrayArg dv, std::optional<double> scale, bool causal,
         const std::string& align, IntArg threads, const std::string& isa,
         std::optional<IntArg> window, std::optional<double> softcap,
         std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks,
         std::optional<ArrayArg> mask, std::optional<ArrayArg> key_lengths,
         std::optional<ArrayArg> dsinks, double dropout_p, IntArg dropout_seed,
         IntArg dropout_offset) {
        constexpr const char* fn = "attention_backward";
        auto o = attention_options(fn, scale, causal, align, threads, isa);
        add_variants(o, fn, {window, softcap, alibi_slopes, sinks, mask, key_lengths});
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto qv = in_float(q, fn, "q", 4), kv = in_float(k, fn, "k", 4);
        auto vv = in_float(v, fn, "v", 4), ov = in_float(out, fn, "out", 4);
        auto lv = in3(lse, fn, "lse"), dov = in_float(dout, fn, "dout", 4);
        auto dqv = out_float(dq, fn, "dq", 4), dkv = out_float(dk, fn, "dk", 4);
        auto dvv = out_float(dv, fn, "dv", 4);
        check_same_dtype(fn, {{"q", qv.dtype},
                              {"k", kv.dtype},
                              {"v", vv.dtype},
                              {"out", ov.dtype},
                              {"dout", dov.dtype},
                              {"dq", dqv.dtype},
                              {"dk", dkv.dtype},
                              {"dv", dvv.dtype}});
        auto dsv = out_typed_opt(dsinks, fn, "dsinks", 1, {tmx::DType::f32});
        nb::gil_scoped_release release;
        tmx::attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, o, dsv);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "dq"_a, "dk"_a, "dv"_a, "scale"_a.none(),
      "causal"_a, "align"_a, "threads"_a, "isa"_a, "window"_a.none() = nb::none(),
      "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
      "sinks"_a.none() = nb::none(), "mask"_a.none() = nb::none(),
      "key_lengths"_a.none() = nb::none(), "dsinks"_a.none() = nb::none(), "dropout_p"_a = 0.0,
      "dropout_seed"_a = 0, "dropout_offset"_a = 0);

  // Attention weights on request (SPEC 4.2–4.4): q [B, T_q, H_q, d_h], k [B, T_k, H_kv, d_h]
  // in one dtype, lse [B, H_q, T_q] float32, weights [B, heads, rows, T_k] float32; heads: the
  // query heads in output order (None = all), rows [row_begin, row_end) (row_end None = T_q).
  m.def(
      "attention_weights",
      [](ArrayArg q, ArrayArg k, ArrayArg lse, ArrayArg weights,
         std::optional<std::vector<std::int64_t>> heads, IntArg row_begin,
         std::optional<IntArg> row_end, std::optional<double> scale, bool causal,
         const std::string& align, IntArg threads, const std::string& isa,
         std::optional<IntArg> window, std::optional<double> softcap,
         std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks,
         std::optional<ArrayArg> mask, std::optional<ArrayArg> key_lengths, double dropout_p,
         IntArg dropout_seed, IntArg dropout_offset) {
        constexpr const char* fn = "attention_weights";
        auto o = attention_options(fn, scale, causal, align, threads, isa);
        add_variants(o, fn, {window, softcap, alibi_slopes, sinks, mask, key_lengths});
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto qv = in_float(q, fn, "q", 4), kv = in_float(k, fn, "k", 4);
        check_same_dtype(fn, {{"q", qv.dtype}, {"k", kv.dtype}});
        auto lv = in3(lse, fn, "lse");
        auto wv = out4(weights, fn, "weights");
        tmx::WeightsSelection select;
        if (heads) select.heads = *heads;
        select.row_begin = int64_arg(row_begin, fn, "row_begin");
        if (row_end) select.row_end = int64_arg(*row_end, fn, "row_end");
        nb::gil_scoped_release release;
        tmx::attention_weights(qv, kv, lv, wv, o, select);
      },
      "q"_a, "k"_a, "lse"_a, "weights"_a, "heads"_a.none(), "row_begin"_a, "row_end"_a.none(),
      "scale"_a.none(), "causal"_a, "align"_a, "threads"_a, "isa"_a, "window"_a.none() = nb::none(),
      "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
      "sinks"_a.none() = nb::none(), "mask"_a.none() = nb::none(),
      "key_lengths"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0);

  // The plain eager calls of tokenmix._torch_ops without score variants (generation makes
  // thousands a second): every tensor as (data_ptr(), dtype code, shape, stride()) of a live CPU
  // tensor the caller holds, q/k/v/dout/dq/dk/dv (and the backward's out) in PyTorch's
  // [B, H, T, E] order, the forward's out as its [B, T, H, E] tensor, lse [B, H, T] float32
  // (lse_ptr 0: none); strides always the tensors' own stride(). Internal (underscore): the
  // pointers are trusted, so only tokenmix._torch_ops calls these, after checking the tensors are
  // strided CPU tensors; the library validates shapes, dtypes and overlaps as for
  // attention_forward/attention_backward. The saving over those is the Python side: no NumPy views,
  // no transposed tensors.
  m.def("_attention_forward_ptr",
        [](std::uintptr_t q, int q_dt, const Dims& q_shape, const Dims& q_strides, std::uintptr_t k,
           int k_dt, const Dims& k_shape, const Dims& k_strides, std::uintptr_t v, int v_dt,
           const Dims& v_shape, const Dims& v_strides, std::uintptr_t out, const Dims& out_strides,
           std::uintptr_t lse, const std::array<std::int64_t, 3>& lse_strides,
           std::optional<double> scale, bool causal, bool bottom_right, int threads) {
          constexpr const char* fn = "attention_forward";
          const auto qv = torch_view(fn, "q", q, q_dt, q_shape, q_strides);
          const auto kv = torch_view(fn, "k", k, k_dt, k_shape, k_strides);
          const auto vv = torch_view(fn, "v", v, v_dt, v_shape, v_strides);
          // out is [B, T, H, E] itself (the tensor the caller allocated): its strides as they are.
          const auto ov =
              torch_view(fn, "out", out, q_dt, q_shape,
                         {out_strides[0], out_strides[2], out_strides[1], out_strides[3]});
          const auto lv = lse == 0 ? tmx::TensorView{} : lse_view(lse, q_shape, lse_strides);
          const auto o = torch_options(scale, causal, bottom_right, threads);
          nb::gil_scoped_release release;
          tmx::attention_forward(qv, kv, vv, ov, lv, o);
        });
  m.def("_attention_backward_ptr",
        [](std::uintptr_t q, int dt, const Dims& q_shape, const Dims& q_strides, std::uintptr_t k,
           const Dims& k_shape, const Dims& k_strides, std::uintptr_t v, const Dims& v_shape,
           const Dims& v_strides, std::uintptr_t out, const Dims& out_strides, std::uintptr_t lse,
           const std::array<std::int64_t, 3>& lse_strides, std::uintptr_t dout,
           const Dims& dout_strides, std::uintptr_t dq, const Dims& dq_strides, std::uintptr_t dk,
           const Dims& dk_strides, std::uintptr_t dv, const Dims& dv_strides,
           std::optional<double> scale, bool causal, bool bottom_right, int threads) {
          constexpr const char* fn = "attention_backward";
          const auto qv = torch_view(fn, "q", q, dt, q_shape, q_strides);
          const auto kv = torch_view(fn, "k", k, dt, k_shape, k_strides);
          const auto vv = torch_view(fn, "v", v, dt, v_shape, v_strides);
          const auto ov = torch_view(fn, "out", out, dt, q_shape, out_strides);
          const auto lv = lse_view(lse, q_shape, lse_strides);
          const auto dov = torch_view(fn, "dout", dout, dt, q_shape, dout_strides);
          const auto dqv = torch_view(fn, "dq", dq, dt, q_shape, dq_strides);
          const auto dkv = torch_view(fn, "dk", dk, dt, k_shape, dk_strides);
          const auto dvv = torch_view(fn, "dv", dv, dt, k_shape, dv_strides);
          const auto o = torch_options(scale, causal, bottom_right, threads);
          nb::gil_scoped_release release;
          tmx::attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, o, tmx::TensorView{});
        });

  // Varlen (packed) batches: q [total_q, H_q, d_h], k/v [total_k, H_kv, d_h], cu_seqlens rank 1
  // int32/int64, lse [H_q, total_q]. No mask or key_lengths (the offsets are the padding).
  m.def(
      "attention_forward_varlen",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg cu_seqlens_q, ArrayArg cu_seqlens_k,
         ArrayArg out, std::optional<ArrayArg> lse, std::optional<double> scale, bool causal,
         const std::string& align, IntArg threads, const std::string& isa,
         std::optional<IntArg> window, std::optional<double> softcap,
         std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks, double dropout_p,
         IntArg dropout_seed, IntArg dropout_offset) {
        constexpr const char* fn = "attention_forward_varlen";
        using D = tmx::DType;
        auto o = attention_options(fn, scale, causal, align, threads, isa);
        add_variants(o, fn, {window, softcap, alibi_slopes, sinks, std::nullopt, std::nullopt});
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto qv = in_float(q, fn, "q", 3), kv = in_float(k, fn, "k", 3);
        auto vv = in_float(v, fn, "v", 3);
        auto cq = in_typed(cu_seqlens_q, fn, "cu_seqlens_q", 1, {D::i32, D::i64});
        auto ck = in_typed(cu_seqlens_k, fn, "cu_seqlens_k", 1, {D::i32, D::i64});
        auto ov = out_float(out, fn, "out", 3);
        check_same_dtype(fn,
                         {{"q", qv.dtype}, {"k", kv.dtype}, {"v", vv.dtype}, {"out", ov.dtype}});
        auto lv = out_typed_opt(lse, fn, "lse", 2, {D::f32});
        nb::gil_scoped_release release;
        tmx::attention_forward_varlen(qv, kv, vv, cq, ck, ov, lv, o);
      },
      "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "out"_a, "lse"_a.none(),
      "scale"_a.none(), "causal"_a, "align"_a, "threads"_a, "isa"_a, "window"_a.none() = nb::none(),
      "softcap"_a.none() = nb::none(), "alibi_slopes"_a.none() = nb::none(),
      "sinks"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0);

  m.def(
      "attention_backward_varlen",
      [](ArrayArg q, ArrayArg k, ArrayArg v, ArrayArg out, ArrayArg lse, ArrayArg dout,
         ArrayArg cu_seqlens_q, ArrayArg cu_seqlens_k, ArrayArg dq, ArrayArg dk, ArrayArg dv,
         std::optional<double> scale, bool causal, const std::string& align, IntArg threads,
         const std::string& isa, std::optional<IntArg> window, std::optional<double> softcap,
         std::optional<ArrayArg> alibi_slopes, std::optional<ArrayArg> sinks,
         std::optional<ArrayArg> dsinks, double dropout_p, IntArg dropout_seed,
         IntArg dropout_offset) {
        constexpr const char* fn = "attention_backward_varlen";
        using D = tmx::DType;
        auto o = attention_options(fn, scale, causal, align, threads, isa);
        add_variants(o, fn, {window, softcap, alibi_slopes, sinks, std::nullopt, std::nullopt});
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto qv = in_float(q, fn, "q", 3), kv = in_float(k, fn, "k", 3);
        auto vv = in_float(v, fn, "v", 3), ov = in_float(out, fn, "out", 3);
        auto dov = in_float(dout, fn, "dout", 3);
        auto lv = in_typed(lse, fn, "lse", 2, {D::f32});
        auto cq = in_typed(cu_seqlens_q, fn, "cu_seqlens_q", 1, {D::i32, D::i64});
        auto ck = in_typed(cu_seqlens_k, fn, "cu_seqlens_k", 1, {D::i32, D::i64});
        auto dqv = out_float(dq, fn, "dq", 3), dkv = out_float(dk, fn, "dk", 3);
        auto dvv = out_float(dv, fn, "dv", 3);
        check_same_dtype(fn, {{"q", qv.dtype},
                              {"k", kv.dtype},
                              {"v", vv.dtype},
                              {"out", ov.dtype},
                              {"dout", dov.dtype},
                              {"dq", dqv.dtype},
                              {"dk", dkv.dtype},
                              {"dv", dvv.dtype}});
        auto dsv = out_typed_opt(dsinks, fn, "dsinks", 1, {D::f32});
        nb::gil_scoped_release release;
        tmx::attention_backward_varlen(qv, kv, vv, ov, lv, dov, cq, ck, dqv, dkv, dvv, o, dsv);
      },
      "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a, "dout"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "dq"_a,
      "dk"_a, "dv"_a, "scale"_a.none(), "causal"_a, "align"_a, "threads"_a, "isa"_a,
      "window"_a.none() = nb::none(), "softcap"_a.none() = nb::none(),
      "alibi_slopes"_a.none() = nb::none(), "sinks"_a.none() = nb::none(),
      "dsinks"_a.none() = nb::none(), "dropout_p"_a = 0.0, "dropout_seed"_a = 0,
      "dropout_offset"_a = 0);

  // The dropout keep mask Z (docs/design.md D.2–D.3): keep [B, H_q, T_q, T_k] bool, written.
  m.def(
      "attention_dropout_mask",
      [](ArrayArg keep, double dropout_p, IntArg dropout_seed, IntArg dropout_offset,
         IntArg threads) {
        constexpr const char* fn = "attention_dropout_mask";
        tmx::AttentionOptions o;
        o.threads = thread_count(threads, fn);
        add_dropout(o, fn, dropout_p, dropout_seed, dropout_offset);
        auto kv = out_typed_opt(keep, fn, "keep", 4, {tmx::DType::boolean});
        nb::gil_scoped_release release;
        tmx::attention_dropout_mask(kv, o);
      },
      "keep"_a, "dropout_p"_a, "dropout_seed"_a, "dropout_offset"_a, "threads"_a = 0);

  // The counts take their sizes as any Python integer (int64_arg: beyond int64 →
  // ArgumentError(overflow), not an integer → TypeError, never nanobind's "incompatible function
  // arguments") and throw tokenmix::ArgumentError (invalid_argument for a t outside [0, T_q) or
  // a negative size, overflow for P > 2^63 − 1), which the translator raises as
  // tokenmix.ArgumentError; a bad align names the function as well.
  m.def(
      "visible_keys",
      [](IntArg t, IntArg T_q, IntArg T_k, bool causal, const std::string& align) {
        constexpr const char* fn = "visible_keys";
        return tmx::visible_keys(int64_arg(t, fn, "t"), int64_arg(T_q, fn, "T_q"),
                                 int64_arg(T_k, fn, "T_k"), causal, parse_align(fn, align));
      },
      "t"_a, "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def(
      "visible_pairs",
      [](IntArg T_q, IntArg T_k, bool causal, const std::string& align) {
        constexpr const char* fn = "visible_pairs";
        return tmx::visible_pairs(int64_arg(T_q, fn, "T_q"), int64_arg(T_k, fn, "T_k"), causal,
                                  parse_align(fn, align));
      },
      "T_q"_a, "T_k"_a, "causal"_a, "align"_a);
  m.def(
      "forward_flops",
      [](IntArg B, IntArg T_q, IntArg T_k, IntArg H_q, IntArg d_h, bool causal,
         const std::string& align) {
        constexpr const char* fn = "forward_flops";
        return tmx::forward_flops(int64_arg(B, fn, "B"), int64_arg(T_q, fn, "T_q"),
                                  int64_arg(T_k, fn, "T_k"), int64_arg(H_q, fn, "H_q"),
                                  int64_arg(d_h, fn, "d_h"), causal, parse_align(fn, align));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a);
  m.def(
      "backward_flops",
      [](IntArg B, IntArg T_q, IntArg T_k, IntArg H_q, IntArg d_h, bool causal,
         const std::string& align) {
        constexpr const char* fn = "backward_flops";
        return tmx::backward_flops(int64_arg(B, fn, "B"), int64_arg(T_q, fn, "T_q"),
                                   int64_arg(T_k, fn, "T_k"), int64_arg(H_q, fn, "H_q"),
                                   int64_arg(d_h, fn, "d_h"), causal, parse_align(fn, align));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a);

  // The same counts with a sliding window W (SPEC "Score variants": window): only keys
  // p(t) − W < u count; W < 1 → ArgumentError naming window.
  m.def(
      "visible_keys_windowed",
      [](IntArg t, IntArg T_q, IntArg T_k, bool causal, const std::string& align, IntArg window) {
        constexpr const char* fn = "visible_keys";
        return tmx::visible_keys_windowed(int64_arg(t, fn, "t"), int64_arg(T_q, fn, "T_q"),
                                          int64_arg(T_k, fn, "T_k"), causal, parse_align(fn, align),
                                          int64_arg(window, fn, "window"));
      },
      "t"_a, "T_q"_a, "T_k"_a, "causal"_a, "align"_a, "window"_a);
  m.def(
      "visible_pairs_windowed",
      [](IntArg T_q, IntArg T_k, bool causal, const std::string& align, IntArg window) {
        constexpr const char* fn = "visible_pairs";
        return tmx::visible_pairs_windowed(int64_arg(T_q, fn, "T_q"), int64_arg(T_k, fn, "T_k"),
                                           causal, parse_align(fn, align),
                                           int64_arg(window, fn, "window"));
      },
      "T_q"_a, "T_k"_a, "causal"_a, "align"_a, "window"_a);
  m.def(
      "forward_flops_windowed",
      [](IntArg B, IntArg T_q, IntArg T_k, IntArg H_q, IntArg d_h, bool causal,
         const std::string& align, IntArg window) {
        constexpr const char* fn = "forward_flops";
        return tmx::forward_flops_windowed(int64_arg(B, fn, "B"), int64_arg(T_q, fn, "T_q"),
                                           int64_arg(T_k, fn, "T_k"), int64_arg(H_q, fn, "H_q"),
                                           int64_arg(d_h, fn, "d_h"), causal,
                                           parse_align(fn, align), int64_arg(window, fn, "window"));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a, "window"_a);
  m.def(
      "backward_flops_windowed",
      [](IntArg B, IntArg T_q, IntArg T_k, IntArg H_q, IntArg d_h, bool causal,
         const std::string& align, IntArg window) {
        constexpr const char* fn = "backward_flops";
        return tmx::backward_flops_windowed(
            int64_arg(B, fn, "B"), int64_arg(T_q, fn, "T_q"), int64_arg(T_k, fn, "T_k"),
            int64_arg(H_q, fn, "H_q"), int64_arg(d_h, fn, "d_h"), causal, parse_align(fn, align),
            int64_arg(window, fn, "window"));
      },
      "B"_a, "T_q"_a, "T_k"_a, "H_q"_a, "d_h"_a, "causal"_a, "align"_a, "window"_a);
}

}  // namespace tokenmix_py
