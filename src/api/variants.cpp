// src/api/variants.cpp — score variants: validate AttentionOptions' variant fields, normalise
// them into kernels::ScoreVariants, and compute the sinks' gradient (variants.hpp).
#include "api/variants.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "kernels/kernel_skeleton.hpp"
#include "kernels/kv_element.hpp"
#include "tokenmix/error.hpp"
#include "util/validate.hpp"

namespace tokenmix::detail {
namespace {

std::string str(std::int64_t x) {
  return std::to_string(x);
}

std::string num(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

// Rank and dtype of an auxiliary (non-f32 or mixed-dtype) view, then its extent.
void check_aux(const char* fn, const ConstTensorView& v, const char* name, int rank,
               std::initializer_list<DType> dtypes, const char* expected) {
  if (v.rank != rank) {
    fail(ErrorCode::shape_mismatch, fn,
         std::string(name) + " must have rank " + str(rank) + "; got rank " + str(v.rank));
  }
  if (std::find(dtypes.begin(), dtypes.end(), v.dtype) == dtypes.end()) {
    throw UnsupportedError(std::string(fn) + ": " + name + " has dtype " + to_string(v.dtype) +
                           "; expected " + expected);
  }
  check_view_extent(v, fn, name);
}

// A rank-1 [n] f32 vector (ALiBi slopes, sinks) copied contiguous. Values are data: NaN and ±∞
// propagate as IEEE arithmetic says (SPEC 4.3), so they are not rejected.
std::vector<float> per_head(const char* fn, const ConstTensorView& v, const char* name,
                            std::int64_t hq) {
  check_view(v, 1, fn, name);
  check_dim(v, 0, hq, fn, name, "H_q", "q.shape[2]");
  std::vector<float> out(static_cast<std::size_t>(hq));
  const auto* p = static_cast<const float*>(v.data);
  for (std::int64_t h = 0; h < hq; ++h) out[static_cast<std::size_t>(h)] = p[h * v.stride(0)];
  return out;
}

// Element i of a rank-1 i32 or i64 view.
std::int64_t int_at(const ConstTensorView& v, std::int64_t i) {
  if (v.dtype == DType::i32) return static_cast<const std::int32_t*>(v.data)[i * v.stride(0)];
  return static_cast<const std::int64_t*>(v.data)[i * v.stride(0)];
}

// Boolean mask → row intervals. Each row (b, h, t) of the mask's own (non-broadcast) dimensions
// gets the hull [first true, last true + 1) of its true keys (empty for an all-false row);
// returns true when every row's true keys are exactly that interval (no hole).
bool mask_intervals(const ConstTensorView& m, std::int64_t tk, int threads, VariantData& data) {
  const std::int64_t d0 = m.dim(0), d1 = m.dim(1), d2 = m.dim(2), nu = m.dim(3);
  const std::int64_t rows = d0 * d1 * d2;
  data.row_begin.assign(static_cast<std::size_t>(rows), 0);
  data.row_end.assign(static_cast<std::size_t>(rows), 0);
  const auto* base = static_cast<const std::uint8_t*>(m.data);
  int holes = 0;
#pragma omp parallel for schedule(static) num_threads(kernels::team_size(threads, rows)) \
    reduction(|                                                                          \
              : holes)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d1 * d2);
    const std::uint8_t* row = base + i0 * m.stride(0) + i1 * m.stride(1) + i2 * m.stride(2);
    std::int64_t first = -1, last = -1, count = 0;
    for (std::int64_t u = 0; u < nu; ++u) {
      if (row[u * m.stride(3)] != 0) {
        if (first < 0) first = u;
        last = u;
        ++count;
      }
    }
    std::int64_t begin = 0, end = 0;
    if (first >= 0) {
      if (last - first + 1 != count) holes = 1;
      begin = first;
      end = nu == 1 ? tk : last + 1;  // a key dimension of size 1 broadcasts over all T_k keys
    }
    data.row_begin[static_cast<std::size_t>(r)] = begin;
    data.row_end[static_cast<std::size_t>(r)] = end;
  }
  return holes == 0;
}

void add_name(std::string& names, const char* name) {
  if (!names.empty()) names += ", ";
  names += name;
}

}  // namespace

float checked_scale(const char* fn, const AttentionOptions& o, std::int64_t dh) {
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(dh)));
  if (!std::isfinite(scale)) {
    fail(ErrorCode::invalid_argument, fn,
         "options.scale must be finite; got " + std::to_string(scale));
  }
  if (!std::isfinite(static_cast<float>(scale))) {
    fail(ErrorCode::invalid_argument, fn,
         "options.scale must be representable as float32; got " + std::to_string(scale));
  }
  if (o.threads < 0) {
    fail(ErrorCode::invalid_argument, fn,
         "options.threads must be >= 0 (0 = all); got " + std::to_string(o.threads));
  }
  check_align(fn, "options.align", o.align);
  return static_cast<float>(scale);
}

kernels::Dropout checked_dropout(const char* fn, const AttentionOptions::Dropout& d,
                                 std::int64_t batch, std::int64_t hq, std::int64_t tq,
                                 std::int64_t tk) {
  if (!(d.p >= 0.0 && d.p < 1.0)) {  // (also rejects NaN)
    fail(ErrorCode::invalid_argument, fn,
         "options.dropout.p must be in [0, 1) (the probability of dropping a weight); got " +
             num(d.p));
  }
  constexpr std::int64_t k32 = std::int64_t{1} << 32;
  if (d.offset >= static_cast<std::uint64_t>(k32)) {
    fail(ErrorCode::invalid_argument, fn,
         "options.dropout.offset must be < 2^32 (the Philox counter's last word, D.3); got " +
             std::to_string(d.offset));
  }
  // The counter words ⌊u/4⌋, t and b·H_q + h of (D.3) must not wrap, or two weights would share
  // their random number.
  const std::pair<const char*, bool> words[] = {
      {"T_k / 8", (tk + 7) / 8 > k32},
      {"T_q", tq > k32},
      {"B * H_q", batch > k32 / std::max<std::int64_t>(hq, 1)}};
  for (const auto& [name, over] : words) {
    if (over) {
      fail(ErrorCode::overflow, fn,
           std::string("dropout's Philox counter word ") + name +
               " must be <= 2^32 (D.3); got B = " + str(batch) + ", H_q = " + str(hq) +
               ", T_q = " + str(tq) + ", T_k = " + str(tk));
    }
  }
  kernels::Dropout z;
  z.active = d.p > 0.0;
  // θ = ⌊p · 2^16⌋ (D.2): exact in double (p < 1, so θ < 2^16).
  z.threshold = static_cast<std::uint32_t>(std::floor(d.p * 65536.0));
  z.scale = static_cast<float>(1.0 / (1.0 - d.p));
  z.key0 = static_cast<std::uint32_t>(d.seed);
  z.key1 = static_cast<std::uint32_t>(d.seed >> 32);
  z.offset = static_cast<std::uint32_t>(d.offset);
  z.hq = hq;
  return z;
}

bool uses_variants(const AttentionOptions& o) {
  return o.window || o.softcap || !o.alibi_slopes.empty() || !o.sinks.empty() || !o.mask.empty() ||
         !o.key_lengths.empty() || o.dropout.p != 0.0;
}

void prepare_variants(const char* fn, const AttentionOptions& o, kernels::AttentionProblem& p,
                      VariantData& data) {
  kernels::ScoreVariants& var = p.var;
  var = {};
  data.names.clear();

  if (o.window) {
    if (*o.window < 1) {
      fail(ErrorCode::invalid_argument, fn,
           "options.window must be >= 1 (the last W positions up to p(t)); got " + str(*o.window));
    }
    // A window longer than any sequence is no restriction; 2^62 keeps p(t) − W + 1 and
    // u + W in int64 (|p(t)|, u < 2^61: every tensor's byte extent fits in int64).
    var.window = std::min<std::int64_t>(*o.window, std::int64_t{1} << 62);
    add_name(data.names, "window");
  }

  if (o.softcap) {
    const double c = *o.softcap;
    if (!std::isfinite(c) || !(c > 0.0)) {
      fail(ErrorCode::invalid_argument, fn,
           "options.softcap must be finite and > 0 (cap(z) = c*tanh(z/c)); got " + num(c));
    }
    const float cf = static_cast<float>(c);
    if (!std::isfinite(cf) || !(cf > 0.0f)) {
      fail(ErrorCode::invalid_argument, fn,
           "options.softcap must be a finite float32 > 0; got " + num(c) + ", which rounds to " +
               num(cf) + " in float32");
    }
    var.softcap = cf;
    add_name(data.names, "softcap");
  }

  if (o.dropout.p != 0.0) {
    var.dropout = checked_dropout(fn, o.dropout, p.batch, p.hq, p.tq, p.tk);
    add_name(data.names, "dropout");
  }

  if (!o.alibi_slopes.empty()) {
    data.alibi = per_head(fn, o.alibi_slopes, "options.alibi_slopes", p.hq);
    var.alibi = data.alibi.data();
    add_name(data.names, "alibi_slopes");
  }

  if (!o.sinks.empty()) {
    data.sinks = per_head(fn, o.sinks, "options.sinks", p.hq);
    var.sinks = data.sinks.data();
    add_name(data.names, "sinks");
  }

  if (!o.key_lengths.empty()) {
    const ConstTensorView& kl = o.key_lengths;
    check_aux(fn, kl, "options.key_lengths", 1, {DType::i32, DType::i64}, "i32 or i64");
    check_dim(kl, 0, p.batch, fn, "options.key_lengths", "B", "q.shape[0]");
    data.key_lengths.resize(static_cast<std::size_t>(p.batch));
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t len = int_at(kl, b);
      if (len < 0 || len > p.tk) {
        fail(ErrorCode::invalid_argument, fn,
             "options.key_lengths[" + str(b) + "] = " + str(len) +
                 " is outside [0, T_k = " + str(p.tk) + "]");
      }
      data.key_lengths[static_cast<std::size_t>(b)] = len;
    }
    var.key_lengths = data.key_lengths.data();
    add_name(data.names, "key_lengths");
  }

  if (!o.mask.empty()) {
    const ConstTensorView& m = o.mask;
    constexpr const char* name = "options.mask";
    check_aux(fn, m, name, 4, {DType::boolean, DType::f32},
              "bool (true = may attend) or f32 (an additive bias)");
    const std::int64_t full[4] = {p.batch, p.hq, p.tq, p.tk};
    const char* axis[4] = {"B", "H_q", "T_q", "T_k"};
    const char* from[4] = {"q.shape[0]", "q.shape[2]", "q.shape[1]", "k.shape[1]"};
    for (int i = 0; i < 4; ++i) {
      if (m.dim(i) != full[i] && m.dim(i) != 1) {
        fail(ErrorCode::shape_mismatch, fn,
             std::string(name) + ".shape[" + str(i) + "] (" + axis[i] + ") must be 1 or " +
                 from[i] + " = " + str(full[i]) + " (broadcast to [B, H_q, T_q, T_k]); got " +
                 str(m.dim(i)) + " (" + name + " shape " + shape_string(m) + ")");
      }
    }
    // A size-1 dimension broadcasts: stride 0 whatever the caller's stride.
    const auto bstride = [&](int i) { return m.dim(i) == 1 ? std::int64_t{0} : m.stride(i); };
    bool all_intervals = false;
    if (m.dtype == DType::boolean) {
      all_intervals = mask_intervals(m, p.tk, p.threads, data);
      const std::int64_t d1 = m.dim(1), d2 = m.dim(2);
      var.row_begin = data.row_begin.data();
      var.row_end = data.row_end.data();
      var.r0 = m.dim(0) > 1 ? d1 * d2 : 0;
      var.r1 = d1 > 1 ? d2 : 0;
      var.r2 = d2 > 1 ? 1 : 0;
    }
    if (!all_intervals) {
      var.mask_kind =
          m.dtype == DType::boolean ? kernels::MaskKind::boolean : kernels::MaskKind::bias;
      var.mask = m.data;
      var.m0 = bstride(0);
      var.m1 = bstride(1);
      var.m2 = bstride(2);
      var.m3 = bstride(3);
    }
    add_name(data.names, "mask");
  }
}

ConstTensorView mask_if_f32(const AttentionOptions& o) {
  return o.mask.dtype == DType::f32 ? o.mask : ConstTensorView{};
}

void check_bool_mask_disjoint(const char* fn, const AttentionOptions& o,
                              std::initializer_list<NamedView> outputs) {
  const ConstTensorView& m = o.mask;
  if (m.empty() || m.dtype != DType::boolean) return;
  // [first, last] byte of a view (validated: offsets fit in int64); false when it has no element.
  const auto bytes = [](const ConstTensorView& v, std::uintptr_t& lo, std::uintptr_t& hi) {
    if (v.data == nullptr) return false;
    std::int64_t last = 0;
    for (int i = 0; i < v.rank; ++i) {
      if (v.dim(i) == 0) return false;
      last += (v.dim(i) - 1) * v.stride(i);
    }
    const auto size = static_cast<std::int64_t>(size_of(v.dtype));
    lo = reinterpret_cast<std::uintptr_t>(v.data);
    hi = lo + static_cast<std::uintptr_t>(last * size + size - 1);
    return true;
  };
  std::uintptr_t mlo = 0, mhi = 0;
  if (!bytes(m, mlo, mhi)) return;
  for (const auto& [name, v] : outputs) {
    std::uintptr_t lo = 0, hi = 0;
    if (bytes(v, lo, hi) && lo <= mhi && mlo <= hi) {
      fail(ErrorCode::aliasing, fn,
           std::string("output ") + name +
               " overlaps input options.mask in memory; outputs must not share memory with "
               "inputs");
    }
  }
}

void check_dsinks(const char* fn, const AttentionOptions& o, const ConstTensorView& dsinks,
                  std::int64_t hq) {
  if (dsinks.empty()) return;
  if (o.sinks.empty()) {
    fail(ErrorCode::invalid_argument, fn,
         "dsinks was given but options.sinks is empty; pass dsinks only together with sinks");
  }
  check_view(dsinks, 1, fn, "dsinks");
  check_dim(dsinks, 0, hq, fn, "dsinks", "H_q", "q.shape[2]");
}

void sinks_gradient(const kernels::AttentionProblem& p, DType dtype, const kernels::In& out,
                    const kernels::In& dout, const kernels::In& lse, const TensorView& dsinks) {
  auto* ds = static_cast<float*>(dsinks.data);
  const std::int64_t hq = p.hq;
  // One head per iteration, its sum in a fixed order: the result does not depend on threads.
#pragma omp parallel for schedule(static) num_threads(kernels::team_size(p.threads, hq))
  for (std::int64_t h = 0; h < hq; ++h) {
    const double sigma = p.var.sinks[h];
    double acc = 0.0;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t t = 0; t < p.tq; ++t) {
        // Element offsets of the rows (the views' pointers are only addresses for bf16/f16).
        const std::int64_t o_t = b * out.s0 + t * out.s1 + h * out.s2;
        const std::int64_t do_t = b * dout.s0 + t * dout.s1 + h * dout.s2;
        double d_t = 0.0;  // D_t = ⟨dO_t, O_t⟩
        for (std::int64_t i = 0; i < p.dh; ++i) {
          d_t += static_cast<double>(kernels::load_element(dtype, dout.data, do_t + i * dout.s3)) *
                 static_cast<double>(kernels::load_element(dtype, out.data, o_t + i * out.s3));
        }
        const double l_t = lse.data[b * lse.s0 + h * lse.s1 + t * lse.s2];
        // e^{σ_h − L_t}, the sink's share of row t; 0 for σ_h = −∞ (no sink: e^{−∞ − L} = 0,
        // also when L = −∞, where the difference would be NaN).
        const double share =
            sigma == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(sigma - l_t);
        acc -= share * d_t;  // dσ_h = −Σ_{b,t} e^{σ_h − L_t} D_t
      }
    ds[h * dsinks.stride(0)] = static_cast<float>(acc);
  }
}

}  // namespace tokenmix::detail
