// tools/cli/run_npy.cpp — `tokenmix run --q q.npy --k k.npy --v v.npy --out o.npy ...`
//
// Reads q [B, T_q, H_q, d_h], k and v [B, T_k, H_kv, d_h] (and dO [B, T_q, H_q, d_h] for the
// backward pass), runs attention_forward (and attention_backward), writes O, and if asked the
// row log-sum-exp [B, H_q, T_q] and dQ, dK, dV. Every input is read and validated and all the
// computing is done before the first output is written; if writing one output fails, the outputs
// already written by this run are removed, so an error leaves nothing behind. No progress lines:
// an error is exactly one line on stderr, and the summary goes to stdout.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "common.hpp"
#include "io/npy.hpp"
#include "run.hpp"

namespace tokenmix::cli {
namespace {

[[noreturn]] void shape_error(const std::string& message) {
  throw ArgumentError(ErrorCode::shape_mismatch, message);
}

io::NpyArray read_input(const char* option, const std::string& path) {
  io::NpyArray a = io::read_npy(path);
  if (a.shape.size() != 4)
    shape_error(std::string(option) + " '" + path + "' has shape " + a.shape_string() + " (rank " +
                std::to_string(a.shape.size()) + "); expected rank 4 [B, T, H, d_h]");
  return a;
}

std::string describe(const char* option, const std::string& path, const io::NpyArray& a) {
  return std::string(option) + " '" + path + "' " + a.shape_string();
}

ConstTensorView view_of(const io::NpyArray& a) {
  return ConstTensorView::bthd(a.data.data(), a.shape[0], a.shape[1], a.shape[2], a.shape[3]);
}

struct Output {
  const char* option;
  std::string path;
  std::vector<std::int64_t> shape;
  const std::vector<float>* data;
};

/// Writes every output; on failure removes those this run already wrote, then rethrows.
void write_outputs(const std::vector<Output>& outputs) {
  std::vector<std::string> written;
  try {
    for (const Output& o : outputs) {
      io::write_npy(o.path, o.shape, *o.data);
      written.push_back(o.path);
    }
  } catch (...) {
    for (const auto& p : written) std::remove(p.c_str());
    throw;
  }
}

}  // namespace

int run_npy(const NpyRunOptions& o) {
  const bool backward = !o.dout.empty();

  // Outputs must name distinct files (else one would silently overwrite another).
  std::vector<std::pair<const char*, std::string>> out_paths = {{"--out", o.out}};
  if (!o.lse.empty()) out_paths.emplace_back("--lse", o.lse);
  if (backward) {
    out_paths.emplace_back("--dq", o.dq);
    out_paths.emplace_back("--dk", o.dk);
    out_paths.emplace_back("--dv", o.dv);
  }
  for (std::size_t i = 0; i < out_paths.size(); ++i)
    for (std::size_t j = 0; j < i; ++j) {
      std::error_code e1, e2;
      const auto a = std::filesystem::weakly_canonical(out_paths[i].second, e1);
      const auto b = std::filesystem::weakly_canonical(out_paths[j].second, e2);
      if (out_paths[i].second == out_paths[j].second || (!e1 && !e2 && a == b))
        throw ArgumentError(ErrorCode::aliasing, std::string(out_paths[j].first) + " and " +
                                                     out_paths[i].first + " name the same file '" +
                                                     out_paths[i].second + "'");
    }

  const io::NpyArray q = read_input("--q", o.q);
  const io::NpyArray k = read_input("--k", o.k);
  const io::NpyArray v = read_input("--v", o.v);
  io::NpyArray dout;
  if (backward) dout = read_input("--dout", o.dout);

  // Shape agreement, stated in terms of the files (the library checks again, in its own terms).
  const std::int64_t B = q.shape[0], T_q = q.shape[1], H_q = q.shape[2], d_h = q.shape[3];
  const std::int64_t T_k = k.shape[1], H_kv = k.shape[2];
  if (v.shape != k.shape)
    shape_error(describe("--v", o.v, v) + " must have the shape of " + describe("--k", o.k, k));
  if (k.shape[0] != B || k.shape[3] != d_h)
    shape_error(describe("--k", o.k, k) + " must match " + describe("--q", o.q, q) +
                " in B (axis 0) and d_h (axis 3)");
  if (H_kv == 0 || H_q % H_kv != 0)
    shape_error(describe("--k", o.k, k) + ": H_kv = " + std::to_string(H_kv) +
                " must divide H_q = " + std::to_string(H_q) + " of " + describe("--q", o.q, q));
  if (backward && dout.shape != q.shape)
    shape_error(describe("--dout", o.dout, dout) + " must have the shape of " +
                describe("--q", o.q, q));

  std::vector<float> out(q.data.size()), lse(static_cast<std::size_t>(B * H_q * T_q));
  const TensorView out_v = TensorView::bthd(out.data(), B, T_q, H_q, d_h);
  const TensorView lse_v = TensorView::bht(lse.data(), B, H_q, T_q);
  const double flops = forward_flops(B, T_q, T_k, H_q, d_h, o.attention.causal, o.attention.align);

  Stopwatch fwd_clock;
  attention_forward(view_of(q), view_of(k), view_of(v), out_v, lse_v, o.attention);
  const double fwd_s = fwd_clock.seconds();

  std::vector<float> dq, dk, dv;
  double bwd_s = 0.0;
  if (backward) {
    dq.resize(q.data.size());
    dk.resize(k.data.size());
    dv.resize(v.data.size());
    Stopwatch bwd_clock;
    attention_backward(view_of(q), view_of(k), view_of(v), out_v, lse_v, view_of(dout),
                       TensorView::bthd(dq.data(), B, T_q, H_q, d_h),
                       TensorView::bthd(dk.data(), B, T_k, H_kv, d_h),
                       TensorView::bthd(dv.data(), B, T_k, H_kv, d_h), o.attention);
    bwd_s = bwd_clock.seconds();
  }

  std::vector<Output> outputs = {{"--out", o.out, q.shape, &out}};
  if (!o.lse.empty()) outputs.push_back({"--lse", o.lse, {B, H_q, T_q}, &lse});
  if (backward) {
    outputs.push_back({"--dq", o.dq, q.shape, &dq});
    outputs.push_back({"--dk", o.dk, k.shape, &dk});
    outputs.push_back({"--dv", o.dv, v.shape, &dv});
  }
  write_outputs(outputs);

  std::cout << "attention B=" << B << " T_q=" << T_q << " T_k=" << T_k << " H_q=" << H_q
            << " H_kv=" << H_kv << " d_h=" << d_h
            << (o.attention.causal ? ", causal " : ", no mask")
            << (o.attention.causal
                    ? (o.attention.align == CausalAlign::top_left ? "top-left" : "bottom-right")
                    : "")
            << ", kernel path " << to_string(resolve_isa(o.attention.isa)) << "\n";
  std::cout << "forward:  " << fmt(fwd_s * 1e3, "%.3f") << " ms, "
            << fmt(flops / std::max(fwd_s, 1e-9) * 1e-9, "%.2f") << " GFLOP/s ("
            << fmt(flops * 1e-9, "%.4f") << " GFLOP useful)\n";
  if (backward)
    std::cout << "backward: " << fmt(bwd_s * 1e3, "%.3f") << " ms, "
              << fmt(2.5 * flops / std::max(bwd_s, 1e-9) * 1e-9, "%.2f") << " GFLOP/s ("
              << fmt(2.5 * flops * 1e-9, "%.4f") << " GFLOP useful)\n";
  for (const Output& out_file : outputs)
    std::cout << "wrote " << out_file.option << " " << out_file.path << " "
              << io::shape_to_string(out_file.shape) << "\n";
  return kExitOk;
}

}  // namespace tokenmix::cli
