// tests/cli/npy_tool.cpp — helper of the CLI tests (tests/cli/tests.cmake): writes input .npy
// files for `tokenmix run --q ...`, checks the files the CLI wrote against the float64 oracle,
// and writes malformed files for the error tests.
//
//   npy_tool make DIR B T_q T_k H_q H_kv D SEED
//       DIR/q.npy k.npy v.npy do.npy (float32, N(0,1)), DIR/q64.npy (q as float64, same values)
//   npy_tool verify DIR OUT_PREFIX [--scale S] [--no-causal] [--top-left] [--grad]
//                   [--window W] [--softcap C] [--alibi] [--sinks V[,V...]]
//                   [--dropout P [--dropout-seed S]]
//       reads DIR/{q,k,v,do}.npy and DIR/OUT_PREFIX{o,lse[,dq,dk,dv[,dsinks]]}.npy, compares
//       with the oracle (with the score variants given: --alibi the standard slopes
//       2^(−8(h+1)/H_q), --sinks one value for every head or one per head; dsinks is checked
//       with --grad and --sinks); exit 0 if max|x−r|/max|r| is within bounds, 1 otherwise
//   npy_tool malformed DIR
//       DIR/bad_magic.npy, truncated.npy, rank3.npy (valid, but rank 3), int32.npy ('<i4'), and
//       valid files without data whose other sizes are huge: dh0_huge.npy (d_h = 0), h0_huge.npy
//       (H = 0), b0_huge.npy (B = 0, T·H·d_h > 2^63)
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "io/npy.hpp"
#include "kernels/dropout.hpp"
#include "reference/reference.hpp"

namespace {

using tokenmix::io::NpyArray;
using tokenmix::reference::Tensor64;

std::vector<float> normal(std::size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

/// A version 1.0 .npy file with the given header dict and raw data bytes.
std::vector<unsigned char> npy(const std::string& dict, const void* data, std::size_t size) {
  std::string header = dict;
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  const std::string prefix = std::string("\x93NUMPY\x01\x00", 8) +
                             static_cast<char>(header.size() & 0xff) +
                             static_cast<char>(header.size() >> 8) + header;
  std::vector<unsigned char> out(prefix.size() + size);
  std::memcpy(out.data(), prefix.data(), prefix.size());
  if (size > 0) std::memcpy(out.data() + prefix.size(), data, size);
  return out;
}

Tensor64 to64(const NpyArray& a) {
  std::array<std::int64_t, 4> shape{1, 1, 1, 1};
  for (std::size_t i = 0; i < a.shape.size() && i < 4; ++i) shape[i] = a.shape[i];
  Tensor64 t(shape);
  for (std::size_t i = 0; i < a.data.size(); ++i) t.data[i] = a.data[i];
  return t;
}

double rel_err(const NpyArray& x, const std::vector<double>& r) {
  if (x.data.size() != r.size()) return INFINITY;
  double diff = 0.0, ref = 0.0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (std::isinf(r[i]) && static_cast<double>(x.data[i]) == r[i]) continue;
    const double dlt = std::fabs(x.data[i] - r[i]);
    diff = std::isnan(dlt) ? INFINITY : std::max(diff, dlt);
    if (std::isfinite(r[i])) ref = std::max(ref, std::fabs(r[i]));
  }
  return diff == 0.0 ? 0.0 : diff / std::max(ref, 1e-30);
}

int make(int argc, char** argv) {
  if (argc != 10) throw std::runtime_error("usage: make DIR B T_q T_k H_q H_kv D SEED");
  const std::string dir = argv[2];
  const std::int64_t B = std::stoll(argv[3]), Tq = std::stoll(argv[4]), Tk = std::stoll(argv[5]),
                     Hq = std::stoll(argv[6]), Hkv = std::stoll(argv[7]), D = std::stoll(argv[8]);
  std::mt19937_64 rng(std::stoull(argv[9]));
  const std::vector<std::int64_t> qs = {B, Tq, Hq, D}, ks = {B, Tk, Hkv, D};
  const auto q = normal(static_cast<std::size_t>(B * Tq * Hq * D), rng);
  tokenmix::io::write_npy(dir + "/q.npy", qs, q);
  tokenmix::io::write_npy(dir + "/k.npy", ks,
                          normal(static_cast<std::size_t>(B * Tk * Hkv * D), rng));
  tokenmix::io::write_npy(dir + "/v.npy", ks,
                          normal(static_cast<std::size_t>(B * Tk * Hkv * D), rng));
  tokenmix::io::write_npy(dir + "/do.npy", qs, normal(q.size(), rng));
  const std::vector<double> q64(q.begin(), q.end());
  write_bytes(dir + "/q64.npy", npy("{'descr': '<f8', 'fortran_order': False, 'shape': (" +
                                        std::to_string(B) + ", " + std::to_string(Tq) + ", " +
                                        std::to_string(Hq) + ", " + std::to_string(D) + "), }",
                                    q64.data(), q64.size() * sizeof(double)));
  return 0;
}

int verify(int argc, char** argv) {
  if (argc < 4) throw std::runtime_error("usage: verify DIR OUT_PREFIX [options]");
  const std::string dir = argv[2], prefix = dir + "/" + argv[3];
  tokenmix::reference::Options o;
  bool grad = false, alibi = false;
  std::vector<double> sinks;
  double dropout = 0.0;
  std::uint64_t dropout_seed = 0;
  for (int i = 4; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--scale" && i + 1 < argc) {
      o.scale = std::stod(argv[++i]);
    } else if (a == "--window" && i + 1 < argc) {
      o.window = std::stoll(argv[++i]);
    } else if (a == "--softcap" && i + 1 < argc) {
      o.softcap = std::stod(argv[++i]);
    } else if (a == "--alibi") {
      alibi = true;
    } else if (a == "--sinks" && i + 1 < argc) {
      std::string list = argv[++i];
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        sinks.push_back(std::stod(list.substr(pos, comma - pos)));
        pos = comma + 1;
      }
    } else if (a == "--dropout" && i + 1 < argc) {
      dropout = std::stod(argv[++i]);
    } else if (a == "--dropout-seed" && i + 1 < argc) {
      dropout_seed = std::stoull(argv[++i]);
    } else if (a == "--no-causal") {
      o.causal = false;
    } else if (a == "--top-left") {
      o.align = tokenmix::reference::Align::top_left;
    } else if (a == "--grad") {
      grad = true;
    } else {
      throw std::runtime_error("unknown option " + a);
    }
  }
  const NpyArray q = tokenmix::io::read_npy(dir + "/q.npy"),
                 k = tokenmix::io::read_npy(dir + "/k.npy"),
                 v = tokenmix::io::read_npy(dir + "/v.npy");
  const std::int64_t H_q = q.shape.at(2);
  for (std::int64_t h = 0; h < H_q; ++h) {
    // As the CLI: float32 values of the slopes and sinks.
    if (alibi) o.alibi_slopes.push_back(static_cast<float>(std::exp2(-8.0 * (h + 1) / H_q)));
    if (!sinks.empty())
      o.sinks.push_back(static_cast<float>(sinks.size() == 1 ? sinks[0] : sinks.at(h)));
  }
  if (dropout > 0.0) {  // the mask the CLI's call drew (offset 0): D.2–D.3 with the generator
    const std::int64_t B = q.shape.at(0), T_q = q.shape.at(1), T_k = k.shape.at(1);
    tokenmix::kernels::Dropout z;
    z.active = true;
    z.threshold = static_cast<std::uint32_t>(std::floor(dropout * 65536.0));  // ⌊p·2^16⌋
    z.key0 = static_cast<std::uint32_t>(dropout_seed);
    z.key1 = static_cast<std::uint32_t>(dropout_seed >> 32);
    z.hq = H_q;
    o.dropout_p = dropout;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H_q; ++h)
        for (std::int64_t t = 0; t < T_q; ++t)
          for (std::int64_t u = 0; u < T_k; ++u) o.dropout_keep.push_back(z.keep(b, h, t, u));
  }
  const auto f = tokenmix::reference::attention_forward(to64(q), to64(k), to64(v), o);
  const NpyArray out = tokenmix::io::read_npy(prefix + "o.npy");
  const NpyArray lse = tokenmix::io::read_npy(prefix + "lse.npy");
  bool ok = out.shape == q.shape &&
            lse.shape == std::vector<std::int64_t>{q.shape[0], q.shape[2], q.shape[1]};
  if (!ok)
    std::printf("wrong output shapes: o %s, lse %s\n", out.shape_string().c_str(),
                lse.shape_string().c_str());
  const double e_out = rel_err(out, f.out.data), e_lse = rel_err(lse, f.lse.data);
  std::printf("O   rel err %.2e\nL   rel err %.2e\n", e_out, e_lse);
  ok = ok && e_out <= 2e-5 && e_lse <= 2e-5;
  if (grad) {
    const NpyArray dout = tokenmix::io::read_npy(dir + "/do.npy");
    const auto b =
        tokenmix::reference::attention_backward(to64(q), to64(k), to64(v), to64(dout), o);
    const NpyArray dq = tokenmix::io::read_npy(prefix + "dq.npy");
    const NpyArray dk = tokenmix::io::read_npy(prefix + "dk.npy");
    const NpyArray dv = tokenmix::io::read_npy(prefix + "dv.npy");
    ok = ok && dq.shape == q.shape && dk.shape == k.shape && dv.shape == v.shape;
    const double e_dq = rel_err(dq, b.dq.data), e_dk = rel_err(dk, b.dk.data),
                 e_dv = rel_err(dv, b.dv.data);
    std::printf("dQ  rel err %.2e\ndK  rel err %.2e\ndV  rel err %.2e\n", e_dq, e_dk, e_dv);
    ok = ok && e_dq <= 5e-5 && e_dk <= 5e-5 && e_dv <= 5e-5;
    if (!o.sinks.empty()) {
      const NpyArray ds = tokenmix::io::read_npy(prefix + "dsinks.npy");
      ok = ok && ds.shape == std::vector<std::int64_t>{H_q};
      const double e_ds = rel_err(ds, b.dsinks);
      std::printf("dsinks rel err %.2e\n", e_ds);
      ok = ok && e_ds <= 5e-5;
    }
  }
  std::printf("%s\n", ok ? "verify: OK" : "verify: MISMATCH");
  return ok ? 0 : 1;
}

int malformed(int argc, char** argv) {
  if (argc != 3) throw std::runtime_error("usage: malformed DIR");
  const std::string dir = argv[2];
  const std::vector<float> data(2 * 3 * 4 * 8, 0.5f);
  auto good = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 4, 8), }", data.data(),
                  data.size() * sizeof(float));
  auto bad = good;
  bad[1] = 'X';
  write_bytes(dir + "/bad_magic.npy", bad);
  write_bytes(dir + "/truncated.npy", std::vector<unsigned char>(good.begin(), good.end() - 10));
  tokenmix::io::write_npy(dir + "/rank3.npy", std::vector<std::int64_t>{2, 3, 32},
                          std::vector<float>(2 * 3 * 32, 1.0f));
  const std::vector<std::int32_t> ints(2 * 3 * 4 * 8, 1);
  write_bytes(dir + "/int32.npy",
              npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3, 4, 8), }", ints.data(),
                  ints.size() * sizeof(std::int32_t)));
  const auto empty = [&](const char* name, const char* shape) {
    write_bytes(
        dir + "/" + name,
        npy(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }",
            nullptr, 0));
  };
  empty("dh0_huge.npy", "(1048576, 1048576, 1048576, 0)");  // B·T·H = 2^60
  empty("h0_huge.npy", "(1048576, 1048576, 0, 1048576)");
  empty("b0_huge.npy", "(0, 1073741824, 1073741824, 1073741824)");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "make") return make(argc, argv);
    if (cmd == "verify") return verify(argc, argv);
    if (cmd == "malformed") return malformed(argc, argv);
    std::fprintf(stderr, "usage: npy_tool make|verify|malformed ...\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "npy_tool: %s\n", e.what());
    return 2;
  }
}
