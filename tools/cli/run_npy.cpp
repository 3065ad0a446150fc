// tools/cli/run_npy.cpp — `tokenmix run --q q.npy --k k.npy --v v.npy --out o.npy ...`
//
// Reads q [B, T_q, H_q, d_h], k and v [B, T_k, H_kv, d_h] (and dO [B, T_q, H_q, d_h] for the
// backward pass), runs attention_forward (and attention_backward), writes O, and if asked the
// row log-sum-exp [B, H_q, T_q] and dQ, dK, dV (and d(sinks) [H_q]). The score variants
// (--window, --softcap, --alibi, --sinks) apply to both passes; the useful FLOPs count only the
// pairs the causal mask and the window leave visible. Every input is read and validated and all the
// computing is done before the first output is written. Each output is first written to a
// temporary file of its own (created exclusively) in the destination's folder; only when all of
// them have been written are they renamed over the destinations. So a failed run leaves every
// existing file as it was and removes only the temporary files it created itself. Outputs must
// name distinct files, none of them an input (compared as normalised absolute paths, symbolic
// links resolved, and by file identity where the files exist). No progress lines: an error is
// exactly one line on stderr, and the summary goes to stdout.
#include <stdlib.h>  // mkstemp
#include <unistd.h>  // close

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <iostream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "common.hpp"
#include "io/npy.hpp"
#include "run.hpp"

namespace tokenmix::cli {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void shape_error(const std::string& message) {
  throw ArgumentError(ErrorCode::shape_mismatch, message);
}

std::string describe(const char* option, const std::string& path,
                     const std::vector<std::int64_t>& shape) {
  return std::string(option) + " '" + path + "' " + io::shape_to_string(shape);
}

/// Product of `dims`, 0 if one is 0; ArgumentError(overflow) naming `what` if it overflows int64.
std::int64_t checked_product(std::initializer_list<std::int64_t> dims, const std::string& what) {
  for (std::int64_t d : dims)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (std::int64_t d : dims)
    if (__builtin_mul_overflow(n, d, &n))
      throw ArgumentError(ErrorCode::overflow, what + " overflows 64-bit arithmetic");
  return n;
}

/// Reads a rank-4 [B, T, H, d_h] input whose H and d_h are >= 1 and whose strides (suffix
/// products) fit in int64: an empty file may declare huge sizes (a dimension of 0).
io::NpyArray read_input(const char* option, const std::string& path, const char* head_name) {
  io::NpyArray a = io::read_npy(path);
  if (a.shape.size() != 4)
    shape_error(std::string(option) + " '" + path + "' has shape " + a.shape_string() + " (rank " +
                std::to_string(a.shape.size()) + "); expected rank 4 [B, T, H, d_h]");
  const std::string what = describe(option, path, a.shape);
  if (a.shape[3] < 1)
    throw ArgumentError(ErrorCode::invalid_argument,
                        what + ": d_h must be >= 1 (axis 3); got " + std::to_string(a.shape[3]));
  if (a.shape[2] < 1)
    throw ArgumentError(
        ErrorCode::invalid_argument,
        what + ": " + head_name + " must be >= 1 (axis 2); got " + std::to_string(a.shape[2]));
  checked_product({a.shape[1], a.shape[2], a.shape[3]}, what + ": T * H * d_h");
  return a;
}

ConstTensorView view_of(const io::NpyArray& a) {
  return ConstTensorView::bthd(a.data.data(), a.shape[0], a.shape[1], a.shape[2], a.shape[3]);
}

/// The file a path names, for comparing paths: absolute, symbolic links of the existing part
/// resolved, "." and ".." removed (so "o.npy", "./o.npy" and "sub/../o.npy" agree even before
/// o.npy exists).
fs::path file_key(const std::string& path) {
  std::error_code ec;
  fs::path abs = fs::absolute(path, ec);
  if (ec) abs = fs::path(path);
  fs::path key = fs::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal() : key;
}

bool same_file(const std::string& a, const std::string& b) {
  if (a == b || file_key(a) == file_key(b)) return true;
  std::error_code ec;
  return fs::equivalent(a, b, ec) && !ec;  // e.g. two hard links of one existing file
}

struct Output {
  const char* option;
  std::string path;
  std::vector<std::int64_t> shape;
  const std::vector<float>* data;
};

/// A temporary file of this run: created (exclusively) by it, so it may remove it.
struct TempFile {
  std::string path;
  bool exists = false;
};

/// Creates an empty, new, uniquely named file next to `path`.
TempFile make_temp_next_to(const char* option, const std::string& path) {
  const fs::path dest(path);
  const fs::path dir = dest.has_parent_path() ? dest.parent_path() : fs::path(".");
  std::string pattern = (dir / ("." + dest.filename().string() + ".tokenmix-XXXXXX")).string();
  const int fd = ::mkstemp(pattern.data());
  if (fd < 0) {
    const int err = errno;
    throw FileError(ErrorCode::io_error,
                    std::string(option) + " '" + path +
                        "': cannot create a file in its folder: " + std::strerror(err));
  }
  ::close(fd);
  return {pattern, true};
}

/// Writes every output to its temporary file, then renames them all over the destinations. On
/// failure, removes the temporary files (and only those) and rethrows. A failed write changes no
/// destination; only a failing rename (the destinations were checked beforehand, so that needs
/// e.g. a file system changed meanwhile) leaves the outputs renamed before it in place.
void write_outputs(const std::vector<Output>& outputs) {
  std::vector<TempFile> temps;
  temps.reserve(outputs.size());
  auto remove_temps = [&] {
    for (TempFile& t : temps)
      if (t.exists) std::remove(t.path.c_str()), t.exists = false;
  };
  try {
    for (const Output& o : outputs) {
      temps.push_back(make_temp_next_to(o.option, o.path));
      io::write_npy(temps.back().path, o.shape, *o.data);
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      std::error_code ec;
      fs::rename(temps[i].path, outputs[i].path, ec);
      if (ec)
        throw FileError(ErrorCode::io_error, std::string(outputs[i].option) + " '" +
                                                 outputs[i].path +
                                                 "': cannot write it: " + ec.message());
      temps[i].exists = false;
    }
  } catch (...) {
    remove_temps();
    throw;
  }
}

}  // namespace

int run_npy(const NpyRunOptions& o) {
  const bool backward = !o.dout.empty();

  // Outputs must name distinct files (else one would silently overwrite another), none of them
  // an input (the run would replace, or on failure lose, the user's data).
  std::vector<std::pair<const char*, std::string>> out_paths = {{"--out", o.out}};
  if (!o.lse.empty()) out_paths.emplace_back("--lse", o.lse);
  if (backward) {
    out_paths.emplace_back("--dq", o.dq);
    out_paths.emplace_back("--dk", o.dk);
    out_paths.emplace_back("--dv", o.dv);
    if (!o.dsinks.empty()) out_paths.emplace_back("--dsinks", o.dsinks);
  }
  std::vector<std::pair<const char*, std::string>> in_paths = {
      {"--q", o.q}, {"--k", o.k}, {"--v", o.v}};
  if (backward) in_paths.emplace_back("--dout", o.dout);
  for (std::size_t i = 0; i < out_paths.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j)
      if (same_file(out_paths[i].second, out_paths[j].second))
        throw ArgumentError(ErrorCode::aliasing,
                            std::string(out_paths[j].first) + " and " + out_paths[i].first +
                                " name the same file ('" + out_paths[j].second + "' and '" +
                                out_paths[i].second + "'); each output needs its own file");
    std::error_code ec;
    if (fs::is_directory(out_paths[i].second, ec))
      throw FileError(ErrorCode::io_error, std::string(out_paths[i].first) + " '" +
                                               out_paths[i].second +
                                               "' is a directory; expected a file path");
    for (const auto& [option, path] : in_paths)
      if (same_file(out_paths[i].second, path))
        throw ArgumentError(ErrorCode::aliasing, std::string(out_paths[i].first) + " '" +
                                                     out_paths[i].second +
                                                     "' names the input file of " + option + " '" +
                                                     path + "'; outputs must not overwrite inputs");
  }

  const io::NpyArray q = read_input("--q", o.q, "H_q");
  const io::NpyArray k = read_input("--k", o.k, "H_kv");
  const io::NpyArray v = read_input("--v", o.v, "H_kv");
  io::NpyArray dout;
  if (backward) dout = read_input("--dout", o.dout, "H_q");

  // Shape agreement, stated in terms of the files (the library checks again, in its own terms).
  const std::int64_t B = q.shape[0], T_q = q.shape[1], H_q = q.shape[2], d_h = q.shape[3];
  const std::int64_t T_k = k.shape[1], H_kv = k.shape[2];
  if (v.shape != k.shape)
    shape_error(describe("--v", o.v, v.shape) + " must have the shape of " +
                describe("--k", o.k, k.shape));
  if (k.shape[0] != B || k.shape[3] != d_h)
    shape_error(describe("--k", o.k, k.shape) + " must match " + describe("--q", o.q, q.shape) +
                " in B (axis 0) and d_h (axis 3)");
  if (H_q % H_kv != 0)
    shape_error(describe("--k", o.k, k.shape) + ": H_kv = " + std::to_string(H_kv) +
                " must divide H_q = " + std::to_string(H_q) + " of " +
                describe("--q", o.q, q.shape));
  if (backward && dout.shape != q.shape)
    shape_error(describe("--dout", o.dout, dout.shape) + " must have the shape of " +
                describe("--q", o.q, q.shape));

  // The variants for H_q heads (--sinks: 1 or H_q values), viewed by the options.
  const std::vector<float> alibi = o.variants.alibi_slopes(H_q),
                           sinks = o.variants.sink_values(H_q);
  AttentionOptions options = o.attention;
  o.variants.apply(options, alibi, sinks);

  const std::int64_t n_lse =
      checked_product({B, H_q, T_q}, describe("--q", o.q, q.shape) + ": B * H_q * T_q");
  std::vector<float> out(q.data.size()), lse(static_cast<std::size_t>(n_lse));
  const TensorView out_v = TensorView::bthd(out.data(), B, T_q, H_q, d_h);
  const TensorView lse_v = TensorView::bht(lse.data(), B, H_q, T_q);
  const testkit::AttentionShape shape{
      B, T_q, T_k, H_q, H_kv, d_h, o.attention.causal, o.attention.align};
  const double flops = bench::windowed_forward_flops(shape, o.variants.window);
  const double bwd_flops = 2.5 * flops;  // SPEC "Useful-work counts"

  Stopwatch fwd_clock;
  attention_forward(view_of(q), view_of(k), view_of(v), out_v, lse_v, options);
  const double fwd_s = fwd_clock.seconds();

  std::vector<float> dq, dk, dv, dsinks;
  double bwd_s = 0.0;
  if (backward) {
    dq.resize(q.data.size());
    dk.resize(k.data.size());
    dv.resize(v.data.size());
    dsinks.resize(sinks.size());
    TensorView dsinks_v;
    if (!dsinks.empty()) dsinks_v = {dsinks.data(), DType::f32, 1, {H_q, 1, 1, 1}, {1, 0, 0, 0}};
    Stopwatch bwd_clock;
    attention_backward(view_of(q), view_of(k), view_of(v), out_v, lse_v, view_of(dout),
                       TensorView::bthd(dq.data(), B, T_q, H_q, d_h),
                       TensorView::bthd(dk.data(), B, T_k, H_kv, d_h),
                       TensorView::bthd(dv.data(), B, T_k, H_kv, d_h), options, dsinks_v);
    bwd_s = bwd_clock.seconds();
  }

  std::vector<Output> outputs = {{"--out", o.out, q.shape, &out}};
  if (!o.lse.empty()) outputs.push_back({"--lse", o.lse, {B, H_q, T_q}, &lse});
  if (backward) {
    outputs.push_back({"--dq", o.dq, q.shape, &dq});
    outputs.push_back({"--dk", o.dk, k.shape, &dk});
    outputs.push_back({"--dv", o.dv, v.shape, &dv});
    if (!o.dsinks.empty()) outputs.push_back({"--dsinks", o.dsinks, {H_q}, &dsinks});
  }
  write_outputs(outputs);

  std::cout << "attention B=" << B << " T_q=" << T_q << " T_k=" << T_k << " H_q=" << H_q
            << " H_kv=" << H_kv << " d_h=" << d_h
            << (o.attention.causal ? ", causal " : ", no mask")
            << (o.attention.causal ? to_string(o.attention.align) : "")
            << (o.variants.any() ? ", " + o.variants.describe() : std::string()) << ", kernel path "
            << to_string(resolve_isa(o.attention.isa)) << "\n";
  std::cout << "forward:  " << fmt(fwd_s * 1e3, "%.3f") << " ms, "
            << fmt(flops / std::max(fwd_s, 1e-9) * 1e-9, "%.2f") << " GFLOP/s ("
            << fmt(flops * 1e-9, "%.4f") << " GFLOP useful)\n";
  if (backward)
    std::cout << "backward: " << fmt(bwd_s * 1e3, "%.3f") << " ms, "
              << fmt(bwd_flops / std::max(bwd_s, 1e-9) * 1e-9, "%.2f") << " GFLOP/s ("
              << fmt(bwd_flops * 1e-9, "%.4f") << " GFLOP useful)\n";
  for (const Output& out_file : outputs)
    std::cout << "wrote " << out_file.option << " " << out_file.path << " "
              << io::shape_to_string(out_file.shape) << "\n";
  return kExitOk;
}

}  // namespace tokenmix::cli
