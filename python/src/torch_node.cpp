// python/src/torch_node.cpp — libtokenmix_torch.so: tokenmix's plain attention as a C++ PyTorch
// operator with a C++ autograd node, for the drop-in's common eager call (no score variants,
// top-left alignment; tokenmix._native loads it, tokenmix._torch_ops calls it).
//
// Why: a Python torch.autograd.Function costs tens of microseconds per call on its own (apply,
// saving tensors, the engine calling back into Python for the backward) — more than the kernels
// of a tiny training step (issue 18: "at most PyTorch's time + 10 µs"). Here the forward, the
// saved tensors and the backward stay in C++; Python pays one operator call.
//
//   tokenmix_native::bind(int table) -> ()
//       the extension's NativeEntryPoints (native_entry.hpp): the library is called through it
//   tokenmix_native::attention(Tensor q, Tensor k, Tensor v, float? scale, bool is_causal)
//       -> Tensor
//       out [B, H_q, L, E] (a [B, L, H_q, E] tensor's transposed view, as the Python path) of
//       q [B, H_q, L, E], k/v [B, H_kv, S, E]: equations 4.2–4.5 with the causal mask (4.3)
//       top-left aligned; differentiable w.r.t. q, k, v (4.6–4.7: the library's backward, from
//       the log-sum-exp the forward saved).
//
// A backward that builds a graph itself (create_graph=True) runs the registered Python operator
// tokenmix::attention_backward instead, whose own autograd refuses double backward with
// tokenmix.UnsupportedError (as the Python path does). Errors of the library come back as
// "tokenmix-native[<class>:<code>] message" (a RuntimeError in Python), which tokenmix._native
// turns back into the tokenmix exception. Shapes, dtypes and devices are checked in Python
// before the call (tokenmix._torch_ops), and again by the library.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "native_entry.hpp"

namespace {

namespace tmx = tokenmix;
using tokenmix_py::NativeEntryPoints;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const NativeEntryPoints* g_entry = nullptr;

const NativeEntryPoints& entry() {
  if (g_entry == nullptr) {
    throw std::runtime_error(
        "tokenmix-native[RuntimeError:internal] tokenmix_native::attention called before "
        "tokenmix_native::bind (import tokenmix.torch, which binds it)");
  }
  return *g_entry;
}

void bind(std::int64_t table) {
  const auto* t = reinterpret_cast<const NativeEntryPoints*>(static_cast<std::uintptr_t>(table));
  if (t == nullptr || t->abi != NativeEntryPoints::kAbi || t->forward == nullptr ||
      t->backward == nullptr) {
    throw std::runtime_error(
        "tokenmix-native[RuntimeError:internal] tokenmix_native::bind: the table is not this "
        "build's NativeEntryPoints (ABI " +
        std::to_string(NativeEntryPoints::kAbi) + ")");
  }
  g_entry = t;
}

tmx::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return tmx::DType::f32;
    case at::kBFloat16:
      return tmx::DType::bf16;
    case at::kHalf:
      return tmx::DType::f16;
    default:
      throw std::runtime_error(std::string("tokenmix-native[ArgumentError:invalid_argument] ") +
                               "attention_forward: tensors must be float32, bfloat16 or "
                               "float16; got " +
                               std::string(c10::toString(t.scalar_type())));
  }
}

// A [B, H, T, E] tensor as the library's [B, T, H, E] view (strides and all, no copy).
tmx::TensorView bthd(const at::Tensor& t) {
  return {t.data_ptr(),
          dtype_of(t),
          4,
          {t.size(0), t.size(2), t.size(1), t.size(3)},
          {t.stride(0), t.stride(2), t.stride(1), t.stride(3)}};
}

// lse [B, H, T] float32.
tmx::TensorView bht(const at::Tensor& t) {
  return {t.data_ptr(),
          tmx::DType::f32,
          3,
          {t.size(0), t.size(1), t.size(2), 1},
          {t.stride(0), t.stride(1), t.stride(2), 0}};
}

tmx::AttentionOptions options(std::optional<double> scale, bool causal) {
  tmx::AttentionOptions o;
  o.scale = scale;
  o.causal = causal;
  o.align = tmx::CausalAlign::top_left;  // torch's is_causal
  o.threads = at::get_num_threads();     // results do not depend on it
  return o;
}

void check(bool ok, const std::string& error) {
  if (!ok) throw std::runtime_error(error);
}

class PlainAttention : public torch::autograd::Function<PlainAttention> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, std::optional<double> scale, bool is_causal) {
    const std::int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
    at::Tensor out = at::empty({B, L, H, E}, q.options());  // q's dtype (SPEC "Reduced precision")
    at::Tensor lse = at::empty({B, H, L}, q.options().dtype(at::kFloat));
    const tmx::AttentionOptions o = options(scale, is_causal);
    std::string error;
    // out is [B, L, H, E] itself: its strides as they are.
    const tmx::TensorView ov = {out.data_ptr(),
                                dtype_of(q),
                                4,
                                {B, L, H, E},
                                {out.stride(0), out.stride(1), out.stride(2), out.stride(3)}};
    check(entry().forward(bthd(q), bthd(k), bthd(v), ov, bht(lse), o, &error), error);
    at::Tensor result = out.transpose(1, 2);
    ctx->save_for_backward({q, k, v, result, lse});
    ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
    ctx->saved_data["is_causal"] = is_causal;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const c10::IValue scale_value = ctx->saved_data["scale"];
    const std::optional<double> scale =
        scale_value.isNone() ? std::nullopt : std::optional<double>(scale_value.toDouble());
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    at::Tensor dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), {}};
    if (dout.scalar_type() != q.scalar_type()) dout = dout.to(q.scalar_type());
    if (at::GradMode::is_enabled()) {
      // create_graph=True: the registered Python operator, whose autograd refuses a second
      // derivative with tokenmix.UnsupportedError when (and only when) one is asked for.
      static const c10::OperatorHandle op =
          c10::Dispatcher::singleton().findSchemaOrThrow("tokenmix::attention_backward", "");
      torch::jit::Stack stack{dout,
                              q,
                              k,
                              v,
                              out,
                              lse,
                              c10::IValue(),
                              c10::IValue(),
                              c10::IValue(),
                              scale_value,
                              is_causal,
                              false,
                              c10::IValue(),
                              c10::IValue()};
      // The schema's later arguments (dropout_p, dropout_seed, ...) at their defaults: a boxed
      // call must push every argument.
      const auto& arguments = op.schema().arguments();
      for (std::size_t i = stack.size(); i < arguments.size(); ++i) {
        TORCH_CHECK(arguments[i].default_value().has_value(),
                    "tokenmix::attention_backward: ", "argument ", arguments[i].name(),
                    " has no default");
        stack.push_back(*arguments[i].default_value());
      }
      op.callBoxed(&stack);
      return {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor(), at::Tensor(),
              at::Tensor()};
    }
    // Gradients with the strides of q, k, v (a gradient flowing back through a transposed view
    // needs no copy).
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    std::string error;
    check(entry().backward(bthd(q), bthd(k), bthd(v), bthd(out), bht(lse), bthd(dout), bthd(dq),
                           bthd(dk), bthd(dv), options(scale, is_causal), &error),
          error);
    return {dq, dk, dv, at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     std::optional<double> scale, bool is_causal) {
  const std::pair<const char*, const at::Tensor*> args[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (const auto& [name, t] : args) {
    if (t->dim() != 4 || t->layout() != at::kStrided || !t->device().is_cpu()) {
      throw std::runtime_error(std::string("tokenmix-native[ArgumentError:shape_mismatch] ") +
                               "attention_forward: " + name +
                               " must be a strided rank-4 CPU tensor [B, H, T, E]; got rank " +
                               std::to_string(t->dim()));
    }
  }
  return PlainAttention::apply(q, k, v, scale, is_causal);
}

}  // namespace

TORCH_LIBRARY(tokenmix_native, m) {
  m.def("bind(int table) -> ()", &bind);
  m.def("attention(Tensor q, Tensor k, Tensor v, float? scale, bool is_causal) -> Tensor",
        &attention);
}
