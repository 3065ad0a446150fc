// src/reference/reference.cpp — the float64 oracle, written to be read next to SPEC.md.
//
// Everything here is deliberately literal and slow:
//   * the scores S (4.2), the mask M (4.3) and the probabilities A (4.4) are materialised as
//     full T_q × T_k matrices for every (batch, head);
//   * the backward pass builds the explicit softmax Jacobian J = diag(a) − a aᵀ (4.6) of every
//     row and multiplies it with that row of dA — no fused identities;
//   * projections are plain triple loops.
// The fast library is checked against these functions; nothing here is tuned for speed.
#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace tokenmix::reference {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// max that is NaN if either argument is (std::max / std::max_element skip a NaN depending on
// its position). The oracle propagates NaN and ±∞ as IEEE arithmetic does (SPEC 4.3).
double max_nan(double a, double b) {
  return (a != a || b != b) ? a + b : std::max(a, b);
}
double max_of(const std::vector<double>& z) {
  double m = kNegInf;
  for (double x : z) m = max_nan(m, x);
  return m;
}

/// A dense row-major matrix of doubles, used for S, M, A, dA, dS of one (batch, head).
struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> data;
  Matrix(std::int64_t r, std::int64_t c, double fill = 0.0)
      : rows(r), cols(c), data(static_cast<std::size_t>(r * c), fill) {}
  double& operator()(std::int64_t i, std::int64_t j) {
    return data[static_cast<std::size_t>(i * cols + j)];
  }
  double operator()(std::int64_t i, std::int64_t j) const {
    return data[static_cast<std::size_t>(i * cols + j)];
  }
  double* row(std::int64_t i) { return data.data() + i * cols; }
  const double* row(std::int64_t i) const { return data.data() + i * cols; }
};

/// The T × d_h block of head h at batch b of a [B, T, H, d_h] tensor: Q_h, K_j or V_j of (4.1).
Matrix head_block(const Tensor64& x, std::int64_t b, std::int64_t h) {
  Matrix m(x.shape[1], x.shape[3]);
  for (std::int64_t t = 0; t < m.rows; ++t)
    for (std::int64_t e = 0; e < m.cols; ++e) m(t, e) = x.at(b, t, h, e);
  return m;
}

/// J = diag(a) − a aᵀ (4.6) written into a caller-owned n×n buffer (reused across rows).
void jacobian_into(const std::vector<double>& a, std::vector<double>& J) {
  const std::size_t n = a.size();
  J.assign(n * n, 0.0);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) J[i * n + j] = (i == j ? a[i] : 0.0) - a[i] * a[j];
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("tokenmix::reference: " + what);
}

/// Checks q [B,T_q,H_q,d_h], k and v [B,T_k,H_kv,d_h] and returns the group size g (4.8).
std::int64_t check_qkv(const Tensor64& q, const Tensor64& k, const Tensor64& v) {
  require(k.shape == v.shape, "k and v must have the same shape");
  require(q.shape[0] == k.shape[0], "q and k must have the same batch size");
  require(q.shape[3] == k.shape[3], "q and k must have the same head width d_h");
  require(k.shape[2] >= 1 && q.shape[2] % k.shape[2] == 0, "H_kv must divide H_q");
  return q.shape[2] / k.shape[2];
}

/// Checks the variant options against the problem's sizes.
void check_options(const Options& o, std::int64_t B, std::int64_t T_q, std::int64_t T_k,
                   std::int64_t H_q) {
  const auto n = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  require(!o.window || *o.window >= 1, "window must be >= 1");
  require(!o.softcap || *o.softcap > 0.0, "softcap must be > 0");
  require(o.alibi_slopes.empty() || o.alibi_slopes.size() == n(H_q), "alibi_slopes must be [H_q]");
  require(o.sinks.empty() || o.sinks.size() == n(H_q), "sinks must be [H_q]");
  require(o.key_lengths.empty() || o.key_lengths.size() == n(B), "key_lengths must be [B]");
  const std::size_t full = n(B * H_q * T_q * T_k);
  require(o.mask_bool.empty() || o.mask_bool.size() == full, "mask_bool must be [B,H_q,T_q,T_k]");
  require(o.mask_bias.empty() || o.mask_bias.size() == full, "mask_bias must be [B,H_q,T_q,T_k]");
  require(o.dropout_keep.empty() || o.dropout_keep.size() == full,
          "dropout_keep must be [B,H_q,T_q,T_k]");
  require(o.dropout_p >= 0.0 && o.dropout_p < 1.0, "dropout_p must be in [0, 1)");
}

double scale_of(const Options& o, std::int64_t d_h) {
  return o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(d_h));
}

/// Everything the forward pass materialises for one (b, h).
struct HeadForward {
  Matrix Z;                    ///< raw scaled scores z = s·Q_h K_jᵀ, (4.2)
  Matrix S;                    ///< scores entering the softmax: cap(z) + ALiBi + bias ("Variants")
  Matrix M;                    ///< mask, 0 or −∞, (4.3) with window, key length, boolean mask
  Matrix A;                    ///< probabilities, (4.4) (with a sink: its share is not in A)
  std::vector<double> lse;     ///< row log-sum-exp L_t, (4.4), the sink's e^σ included
  std::vector<double> a_sink;  ///< e^{σ_h − L_t} per row (the sink's probability); empty if off
};

/// Which (batch row, head) a head_forward call serves, for the per-(b, h) variant terms.
struct HeadIndex {
  std::int64_t b = 0, h = 0, H_q = 1;
};

/// Element (b, h, t, u) of a dense [B][H_q][T_q][T_k] mask.
template <class T>
T mask_at(const std::vector<T>& m, const HeadIndex& at, std::int64_t t, std::int64_t u,
          std::int64_t T_q, std::int64_t T_k) {
  return m[static_cast<std::size_t>(((at.b * at.H_q + at.h) * T_q + t) * T_k + u)];
}

/// Z_{b,h,t,u} / (1 − p) of (D.1): the factor A is multiplied by before it weighs the values
/// (1 without dropout).
double dropout_factor(const Options& o, const HeadIndex& at, std::int64_t t, std::int64_t u,
                      std::int64_t T_q, std::int64_t T_k) {
  if (o.dropout_keep.empty()) return 1.0;
  return mask_at(o.dropout_keep, at, t, u, T_q, T_k) != 0 ? 1.0 / (1.0 - o.dropout_p) : 0.0;
}

/// (4.2)–(4.4) for one head: Q_h [T_q × d_h] against K_j [T_k × d_h], with every score variant.
HeadForward head_forward(const Matrix& Qh, const Matrix& Kj, const Options& o,
                         const HeadIndex& at) {
  const std::int64_t T_q = Qh.rows, T_k = Kj.rows, d_h = Qh.cols;
  const double s = scale_of(o, d_h);
  HeadForward f{Matrix(T_q, T_k), Matrix(T_q, T_k), Matrix(T_q, T_k), Matrix(T_q, T_k), {}, {}};
  const std::size_t h = static_cast<std::size_t>(at.h);

  // (4.2)  z = s · Q_h K_jᵀ
  for (std::int64_t t = 0; t < T_q; ++t)
    for (std::int64_t u = 0; u < T_k; ++u) {
      const double* q_t = Qh.row(t);
      const double* k_u = Kj.row(u);
      double dot = 0.0;
      for (std::int64_t e = 0; e < d_h; ++e) dot += q_t[e] * k_u[e];
      f.Z(t, u) = s * dot;
    }

  // "Score variants": S = cap(z) + b_h(t, u) + bias
  for (std::int64_t t = 0; t < T_q; ++t)
    for (std::int64_t u = 0; u < T_k; ++u) {
      double x = f.Z(t, u);
      if (o.softcap) x = *o.softcap * std::tanh(x / *o.softcap);  // cap(z) = c·tanh(z / c)
      if (!o.alibi_slopes.empty()) {  // b_h(t, u) = −m_h · (p(t) − u)
        x += -o.alibi_slopes[h] * static_cast<double>(position(t, T_q, T_k, o) - u);
      }
      if (!o.mask_bias.empty()) x += mask_at(o.mask_bias, at, t, u, T_q, T_k);
      f.S(t, u) = x;
    }

  // (4.3)  M_{t,u} = 0 if key u is visible to query t, −∞ otherwise (causal, window, key
  // length of sequence b, boolean mask)
  for (std::int64_t t = 0; t < T_q; ++t)
    for (std::int64_t u = 0; u < T_k; ++u) {
      bool vis = visible(t, u, T_q, T_k, o);
      if (!o.key_lengths.empty()) vis = vis && u < o.key_lengths[static_cast<std::size_t>(at.b)];
      if (!o.mask_bool.empty()) vis = vis && mask_at(o.mask_bool, at, t, u, T_q, T_k) != 0;
      f.M(t, u) = vis ? 0.0 : kNegInf;
    }

  // (4.4)  A = softmax(S + M) row by row; L_t = log Σ_u exp(S_tu + M_tu). A sink σ_h is one
  // more entry of the row's softmax with no value vector: softmax over [S_t + M_t, σ_h].
  const bool sink = !o.sinks.empty();
  f.lse.resize(static_cast<std::size_t>(T_q));
  if (sink) f.a_sink.resize(static_cast<std::size_t>(T_q));
  std::vector<double> z(static_cast<std::size_t>(T_k + (sink ? 1 : 0)));
  for (std::int64_t t = 0; t < T_q; ++t) {
    // S + M, with M selecting: a masked entry is −∞ even where S is NaN (SPEC 4.3).
    for (std::int64_t u = 0; u < T_k; ++u)
      z[static_cast<std::size_t>(u)] = f.M(t, u) == 0.0 ? f.S(t, u) : kNegInf;
    if (sink) z[static_cast<std::size_t>(T_k)] = o.sinks[h];
    const std::vector<double> a = softmax(z);
    for (std::int64_t u = 0; u < T_k; ++u) f.A(t, u) = a[static_cast<std::size_t>(u)];
    if (sink) f.a_sink[static_cast<std::size_t>(t)] = a[static_cast<std::size_t>(T_k)];
    f.lse[static_cast<std::size_t>(t)] = logsumexp(z);
  }
  return f;
}

/// Row-major [rows × in] · [in × out] → [rows × out], plain loops ("U W" of 4.1 and 4.5).
std::vector<double> matmul(const std::vector<double>& x, const std::vector<double>& w,
                           std::int64_t rows, std::int64_t in, std::int64_t out) {
  std::vector<double> y(static_cast<std::size_t>(rows * out), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < out; ++c) {
      double acc = 0.0;
      for (std::int64_t i = 0; i < in; ++i)
        acc += x[static_cast<std::size_t>(r * in + i)] * w[static_cast<std::size_t>(i * out + c)];
      y[static_cast<std::size_t>(r * out + c)] = acc;
    }
  return y;
}

/// dY [rows × out] · Wᵀ, W [in × out] → [rows × in]  (gradient w.r.t. the input of Y = X W).
std::vector<double> matmul_wt(const std::vector<double>& dy, const std::vector<double>& w,
                              std::int64_t rows, std::int64_t in, std::int64_t out) {
  std::vector<double> dx(static_cast<std::size_t>(rows * in), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < in; ++i) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < out; ++c)
        acc += dy[static_cast<std::size_t>(r * out + c)] * w[static_cast<std::size_t>(i * out + c)];
      dx[static_cast<std::size_t>(r * in + i)] = acc;
    }
  return dx;
}

/// Xᵀ dY, X [rows × in], dY [rows × out] → [in × out]  (gradient w.r.t. W of Y = X W).
std::vector<double> matmul_xt(const std::vector<double>& x, const std::vector<double>& dy,
                              std::int64_t rows, std::int64_t in, std::int64_t out) {
  std::vector<double> dw(static_cast<std::size_t>(in * out), 0.0);
  for (std::int64_t i = 0; i < in; ++i)
    for (std::int64_t c = 0; c < out; ++c) {
      double acc = 0.0;
      for (std::int64_t r = 0; r < rows; ++r)
        acc += x[static_cast<std::size_t>(r * in + i)] * dy[static_cast<std::size_t>(r * out + c)];
      dw[static_cast<std::size_t>(i * out + c)] = acc;
    }
  return dw;
}

/// Wraps a flat [B, T, H·d_h] buffer as a Tensor64 [B, T, H, d_h] (same memory order).
Tensor64 as_heads(const std::vector<double>& flat, std::int64_t B, std::int64_t T, std::int64_t H,
                  std::int64_t d_h) {
  Tensor64 t({B, T, H, d_h});
  t.data = flat;
  return t;
}

void check_layer(const LayerWeights& w, const std::vector<double>& u, std::int64_t batch,
                 std::int64_t seq) {
  require(w.d_model > 0 && w.heads_q > 0 && w.heads_kv > 0 && w.head_dim > 0,
          "layer sizes must be positive");
  require(w.heads_q % w.heads_kv == 0, "H_kv must divide H_q");
  const std::int64_t d = w.d_model, wq = w.heads_q * w.head_dim, wkv = w.heads_kv * w.head_dim;
  require(static_cast<std::int64_t>(w.w_q.size()) == d * wq, "w_q must be [d, H_q·d_h]");
  require(static_cast<std::int64_t>(w.w_k.size()) == d * wkv, "w_k must be [d, H_kv·d_h]");
  require(static_cast<std::int64_t>(w.w_v.size()) == d * wkv, "w_v must be [d, H_kv·d_h]");
  require(static_cast<std::int64_t>(w.w_o.size()) == wq * d, "w_o must be [H_q·d_h, d]");
  require(static_cast<std::int64_t>(u.size()) == batch * seq * d, "u must be [B, T, d]");
}

/// What the layer's forward computes, kept for the backward pass.
struct LayerForward {
  Tensor64 q_raw, k_raw;  ///< U W_Q, U W_K before RoPE
  Tensor64 q, k, v;       ///< attention inputs (after RoPE)
  Tensor64 y;             ///< attention output [B, T, H_q, d_h], before W_O
  std::vector<double> out;
};

LayerForward layer_forward_full(const LayerWeights& w, const std::vector<double>& u, std::int64_t B,
                                std::int64_t T) {
  check_layer(w, u, B, T);
  const std::int64_t d = w.d_model, dh = w.head_dim, Hq = w.heads_q, Hkv = w.heads_kv;
  const std::int64_t rows = B * T;
  LayerForward f;
  // (4.1)  Q = U W_Q, K = U W_K, V = U W_V, reshaped into heads.
  f.q_raw = as_heads(matmul(u, w.w_q, rows, d, Hq * dh), B, T, Hq, dh);
  f.k_raw = as_heads(matmul(u, w.w_k, rows, d, Hkv * dh), B, T, Hkv, dh);
  f.v = as_heads(matmul(u, w.w_v, rows, d, Hkv * dh), B, T, Hkv, dh);
  // (4.1, RoPE)  rotate Q and K before any score is formed; token t sits at position t.
  if (w.use_rope) {
    f.q = rope(f.q_raw, w.pairing, w.rope_base, 0);
    f.k = rope(f.k_raw, w.pairing, w.rope_base, 0);
  } else {
    f.q = f.q_raw;
    f.k = f.k_raw;
  }
  // (4.2)–(4.5)  causal attention, bottom-right (T_q = T_k, so the plain lower triangle).
  Options o;
  o.scale = w.scale;
  f.y = attention_forward(f.q, f.k, f.v, o).out;
  // (4.5)  O = [Y_1 | … | Y_{H_q}] W_O
  f.out = matmul(f.y.data, w.w_o, rows, Hq * dh, d);
  return f;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tensor64

Tensor64::Tensor64(std::array<std::int64_t, 4> s) : shape(s) {
  for (auto n : s) require(n >= 0, "negative dimension");
  data.assign(static_cast<std::size_t>(size()), 0.0);
}

double& Tensor64::at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return data[static_cast<std::size_t>(((a * shape[1] + b) * shape[2] + c) * shape[3] + d)];
}
double Tensor64::at(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const {
  return data[static_cast<std::size_t>(((a * shape[1] + b) * shape[2] + c) * shape[3] + d)];
}

// ---------------------------------------------------------------------------------------------
// (4.3) the causal mask

std::int64_t position(std::int64_t t, std::int64_t T_q, std::int64_t T_k, const Options& o) {
  // Bottom-right: query t is at absolute position t + (T_k − T_q). Top-left: at position t.
  return o.align == Align::bottom_right ? t + (T_k - T_q) : t;
}

bool visible(std::int64_t t, std::int64_t u, std::int64_t T_q, std::int64_t T_k, const Options& o) {
  const std::int64_t p = position(t, T_q, T_k, o);
  if (o.causal && u > p) return false;               // (4.3)
  if (o.window && u <= p - *o.window) return false;  // sliding window: p(t) − W < u
  return true;
}

// ---------------------------------------------------------------------------------------------
// (4.4) softmax and log-sum-exp, (4.6) the Jacobian

std::vector<double> softmax(const std::vector<double>& z) {
  std::vector<double> a(z.size(), 0.0);
  if (z.empty()) return a;
  // Stable form: subtract the row maximum m before exp, so every exponent is ≤ 0.
  const double m = max_of(z);  // NaN if any entry is: then every a_i is NaN
  if (m == kNegInf) return a;  // every entry masked: no key visible → all zeros, never NaN
  double sum = 0.0;
  for (std::size_t i = 0; i < z.size(); ++i) {
    a[i] = std::exp(z[i] - m);  // exp(−∞) = 0 for masked entries
    sum += a[i];
  }
  for (double& x : a) x /= sum;  // sum ≥ 1 (the maximum contributes exp(0) = 1)
  return a;
}

double logsumexp(const std::vector<double>& z) {
  if (z.empty()) return kNegInf;
  const double m = max_of(z);
  if (m == kNegInf) return kNegInf;  // log of an empty sum
  double sum = 0.0;
  for (double x : z) sum += std::exp(x - m);
  return m + std::log(sum);  // L = m + log Σ exp(z − m)
}

std::vector<double> softmax_jacobian(const std::vector<double>& a) {
  // (4.6)  J = diag(a) − a aᵀ,  i.e. (4.7)  J_ij = a_i (δ_ij − a_j)
  std::vector<double> J;
  jacobian_into(a, J);
  return J;
}

// ---------------------------------------------------------------------------------------------
// Attention forward: (4.2)–(4.5) with GQA (4.8)

ForwardResult attention_forward(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                const Options& o) {
  const std::int64_t g = check_qkv(q, k, v);
  const std::int64_t B = q.shape[0], T_q = q.shape[1], H_q = q.shape[2], d_h = q.shape[3];
  const std::int64_t T_k = k.shape[1];
  check_options(o, B, T_q, T_k, H_q);
  ForwardResult r{Tensor64({B, T_q, H_q, d_h}), Tensor64({B, H_q, T_q, 1})};

  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H_q; ++h) {
      const std::int64_t j = h / g;  // (4.8)  j(h) = ⌊h / g⌋
      const Matrix Qh = head_block(q, b, h), Kj = head_block(k, b, j), Vj = head_block(v, b, j);
      const HeadForward f = head_forward(Qh, Kj, o, {b, h, H_q});
      // (4.5)  O_h = A_h V_j. A row that sees no key has A = 0, hence O = 0.
      for (std::int64_t t = 0; t < T_q; ++t) {
        std::vector<double> o_t(static_cast<std::size_t>(d_h), 0.0);  // O_h[t] = Σ_u A_tu V_u
        for (std::int64_t u = 0; u < T_k; ++u) {
          if (f.M(t, u) != 0.0) continue;  // a masked key takes no part (0 · NaN = NaN)
          // (D.1) with dropout: P̃_tu = A_tu Z_tu / (1 − p)
          const double a_tu = f.A(t, u) * dropout_factor(o, {b, h, H_q}, t, u, T_q, T_k);
          for (std::int64_t e = 0; e < d_h; ++e)
            o_t[static_cast<std::size_t>(e)] += a_tu * Vj.row(u)[e];
        }
        for (std::int64_t e = 0; e < d_h; ++e)
          r.out.at(b, t, h, e) = o_t[static_cast<std::size_t>(e)];
        r.lse.at(b, h, t, 0) = f.lse[static_cast<std::size_t>(t)];
      }
    }
  return r;
}

Tensor64 attention_weights(const Tensor64& q, const Tensor64& k, const Options& o) {
  const std::int64_t g = check_qkv(q, k, k);
  const std::int64_t B = q.shape[0], T_q = q.shape[1], H_q = q.shape[2], T_k = k.shape[1];
  check_options(o, B, T_q, T_k, H_q);
  Tensor64 a({B, H_q, T_q, T_k});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H_q; ++h) {
      // (4.2)–(4.4) for (b, h): A = softmax(S + M), j(h) = ⌊h / g⌋ (4.8)
      const HeadForward f =
          head_forward(head_block(q, b, h), head_block(k, b, h / g), o, {b, h, H_q});
      for (std::int64_t t = 0; t < T_q; ++t)
        for (std::int64_t u = 0; u < T_k; ++u)  // (D.1): the weights the values were averaged with
          a.at(b, h, t, u) = f.A(t, u) * dropout_factor(o, {b, h, H_q}, t, u, T_q, T_k);
    }
  return a;
}

// ---------------------------------------------------------------------------------------------
// Attention backward (SPEC "Backward pass"), with the explicit Jacobian of every row (4.6)

BackwardResult attention_backward(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                  const Tensor64& dout, const Options& o) {
  const std::int64_t g = check_qkv(q, k, v);
  require(dout.shape == q.shape, "dout must have the shape of q (and of out)");
  const std::int64_t B = q.shape[0], T_q = q.shape[1], H_q = q.shape[2], d_h = q.shape[3];
  const std::int64_t T_k = k.shape[1];
  check_options(o, B, T_q, T_k, H_q);
  const double s = scale_of(o, d_h);
  BackwardResult r{Tensor64(q.shape), Tensor64(k.shape), Tensor64(v.shape), {}};
  const bool sink = !o.sinks.empty();
  if (sink) r.dsinks.assign(static_cast<std::size_t>(H_q), 0.0);
  std::vector<double> J;  // one row's Jacobian, reused (up to (T_k + 1) × (T_k + 1))

  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H_q; ++h) {
      const std::int64_t j = h / g;  // (4.8)
      const Matrix Qh = head_block(q, b, h), Kj = head_block(k, b, j), Vj = head_block(v, b, j);
      const Matrix dOh = head_block(dout, b, h);
      const HeadForward f = head_forward(Qh, Kj, o, {b, h, H_q});

      // dV_j += A_hᵀ dO_h  (summed over the heads h of group j): (A_hᵀ dO_h)_u = Σ_t A_tu dO_t
      Matrix dVh(T_k, d_h);
      for (std::int64_t t = 0; t < T_q; ++t)
        for (std::int64_t u = 0; u < T_k; ++u) {
          if (f.M(t, u) != 0.0) continue;  // masked: no part, not a product with 0
          // dropout (D.4): dV = P̃ᵀ dO
          const double a_tu = f.A(t, u) * dropout_factor(o, {b, h, H_q}, t, u, T_q, T_k);
          for (std::int64_t e = 0; e < d_h; ++e) dVh.row(u)[e] += a_tu * dOh.row(t)[e];
        }
      for (std::int64_t u = 0; u < T_k; ++u)
        for (std::int64_t e = 0; e < d_h; ++e) r.dv.at(b, u, j, e) += dVh(u, e);

      // dA_h = dO_h V_jᵀ
      Matrix dA(T_q, T_k);
      for (std::int64_t t = 0; t < T_q; ++t)
        for (std::int64_t u = 0; u < T_k; ++u) {
          const double* do_t = dOh.row(t);
          const double* v_u = Vj.row(u);
          double acc = 0.0;
          for (std::int64_t e = 0; e < d_h; ++e) acc += do_t[e] * v_u[e];
          // dropout (D.4): dA = (dO Vᵀ) ⊙ Z / (1 − p), the chain rule through P̃ = A ⊙ Z / (1 − p)
          dA(t, u) = acc * dropout_factor(o, {b, h, H_q}, t, u, T_q, T_k);
        }

      // dS row t = Jᵀ · dA row t, with J = diag(a) − a aᵀ (4.6) of that row's softmax. Only the
      // visible keys (M = 0) take part in the softmax; masked entries carry zero gradient, so J
      // is formed over the visible keys of the row (its entries at masked keys would be 0 anyway).
      // A sink is one more softmax entry whose dA is 0 (it has no value vector); the Jacobian's
      // sink column gives dσ_h ("Variants": dσ_h = −Σ_t e^{σ_h − L_t} D_t).
      Matrix dS(T_q, T_k);
      for (std::int64_t t = 0; t < T_q; ++t) {
        std::vector<std::int64_t> keys;  // visible keys of row t
        for (std::int64_t u = 0; u < T_k; ++u)
          if (f.M(t, u) == 0.0) keys.push_back(u);
        const std::size_t n = keys.size(), ns = n + (sink ? 1 : 0);
        if (ns == 0) continue;  // no visible key and no sink: zero gradient for the whole row
        std::vector<double> a(ns), da(ns, 0.0), ds(ns, 0.0);
        for (std::size_t i = 0; i < n; ++i) {
          a[i] = f.A(t, keys[i]);
          da[i] = dA(t, keys[i]);
        }
        if (sink) a[n] = f.a_sink[static_cast<std::size_t>(t)];  // da[n] = 0
        jacobian_into(a, J);
        // ∂loss/∂z_c = Σ_i (∂loss/∂a_i)(∂a_i/∂z_c) = Σ_i dA_i J_ic  (accumulated row by row of J)
        for (std::size_t i = 0; i < ns; ++i) {
          const double* J_i = J.data() + i * ns;
          for (std::size_t c = 0; c < ns; ++c) ds[c] += da[i] * J_i[c];
        }
        for (std::size_t c = 0; c < n; ++c) dS(t, keys[c]) = ds[c];
        if (sink) r.dsinks[static_cast<std::size_t>(h)] += ds[n];
      }
      // Soft-capping: S = c·tanh(z / c) ⇒ ∂S/∂z = 1 − tanh²(z / c); dS becomes dz (the ALiBi and
      // bias terms do not depend on z).
      if (o.softcap) {
        for (std::int64_t t = 0; t < T_q; ++t)
          for (std::int64_t u = 0; u < T_k; ++u) {
            if (f.M(t, u) != 0.0) continue;
            const double th = std::tanh(f.Z(t, u) / *o.softcap);
            dS(t, u) *= 1.0 - th * th;
          }
      }

      // dQ_h = s · dS_h K_j
      for (std::int64_t t = 0; t < T_q; ++t) {
        std::vector<double> dq_t(static_cast<std::size_t>(d_h), 0.0);  // Σ_u dS_tu K_u
        for (std::int64_t u = 0; u < T_k; ++u) {
          if (f.M(t, u) != 0.0) continue;  // masked: no part
          const double ds_tu = dS(t, u);
          for (std::int64_t e = 0; e < d_h; ++e)
            dq_t[static_cast<std::size_t>(e)] += ds_tu * Kj.row(u)[e];
        }
        for (std::int64_t e = 0; e < d_h; ++e)
          r.dq.at(b, t, h, e) = s * dq_t[static_cast<std::size_t>(e)];
      }

      // dK_j += s · dS_hᵀ Q_h  (summed over the heads h of group j): (dS_hᵀ Q_h)_u = Σ_t dS_tu Q_t
      Matrix dKh(T_k, d_h);
      for (std::int64_t t = 0; t < T_q; ++t)
        for (std::int64_t u = 0; u < T_k; ++u) {
          if (f.M(t, u) != 0.0) continue;  // masked: no part
          const double ds_tu = dS(t, u);
          for (std::int64_t e = 0; e < d_h; ++e) dKh.row(u)[e] += ds_tu * Qh.row(t)[e];
        }
      for (std::int64_t u = 0; u < T_k; ++u)
        for (std::int64_t e = 0; e < d_h; ++e) r.dk.at(b, u, j, e) += s * dKh(u, e);
    }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Variable-length batches: each sequence an independent B = 1 problem

namespace {

void check_cu(const std::vector<std::int64_t>& cu, std::int64_t total, const char* name) {
  require(cu.size() >= 1 && cu.front() == 0, std::string(name) + " must start at 0");
  for (std::size_t i = 1; i < cu.size(); ++i)
    require(cu[i] >= cu[i - 1], std::string(name) + " must be non-decreasing");
  require(cu.back() == total, std::string(name) + " must end at the total length");
}

/// Rows [r0, r1) of a [1, total, H, d_h] tensor as a [1, r1 − r0, H, d_h] tensor.
Tensor64 rows_of(const Tensor64& x, std::int64_t r0, std::int64_t r1) {
  Tensor64 y({1, r1 - r0, x.shape[2], x.shape[3]});
  const std::int64_t row = x.shape[2] * x.shape[3];
  std::copy(x.data.begin() + r0 * row, x.data.begin() + r1 * row, y.data.begin());
  return y;
}

void put_rows(Tensor64& x, std::int64_t r0, const Tensor64& y) {
  std::copy(y.data.begin(), y.data.end(), x.data.begin() + r0 * x.shape[2] * x.shape[3]);
}

void check_varlen(const Tensor64& q, const Tensor64& k, const std::vector<std::int64_t>& cu_q,
                  const std::vector<std::int64_t>& cu_k, const Options& o) {
  require(q.shape[0] == 1 && k.shape[0] == 1, "varlen tensors are [1, total, H, d_h]");
  check_cu(cu_q, q.shape[1], "cu_q");
  check_cu(cu_k, k.shape[1], "cu_k");
  require(cu_q.size() == cu_k.size(), "cu_q and cu_k must have the same length");
  require(o.key_lengths.empty() && o.mask_bool.empty() && o.mask_bias.empty(),
          "varlen takes no key_lengths or masks");
}

}  // namespace

ForwardResult attention_forward_varlen(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                       const std::vector<std::int64_t>& cu_q,
                                       const std::vector<std::int64_t>& cu_k, const Options& o) {
  check_qkv(q, k, v);
  check_varlen(q, k, cu_q, cu_k, o);
  const std::int64_t H_q = q.shape[2];
  ForwardResult r{Tensor64(q.shape), Tensor64({1, H_q, q.shape[1], 1})};
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    const std::int64_t q0 = cu_q[i], q1 = cu_q[i + 1], k0 = cu_k[i], k1 = cu_k[i + 1];
    const ForwardResult part =
        attention_forward(rows_of(q, q0, q1), rows_of(k, k0, k1), rows_of(v, k0, k1), o);
    put_rows(r.out, q0, part.out);
    for (std::int64_t h = 0; h < H_q; ++h)
      for (std::int64_t t = 0; t < q1 - q0; ++t)
        r.lse.at(0, h, q0 + t, 0) = part.lse.at(0, h, t, 0);
  }
  return r;
}

BackwardResult attention_backward_varlen(const Tensor64& q, const Tensor64& k, const Tensor64& v,
                                         const Tensor64& dout,
                                         const std::vector<std::int64_t>& cu_q,
                                         const std::vector<std::int64_t>& cu_k, const Options& o) {
  check_qkv(q, k, v);
  check_varlen(q, k, cu_q, cu_k, o);
  require(dout.shape == q.shape, "dout must have the shape of q");
  BackwardResult r{Tensor64(q.shape), Tensor64(k.shape), Tensor64(v.shape), {}};
  if (!o.sinks.empty()) r.dsinks.assign(o.sinks.size(), 0.0);
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    const std::int64_t q0 = cu_q[i], q1 = cu_q[i + 1], k0 = cu_k[i], k1 = cu_k[i + 1];
    const BackwardResult part = attention_backward(rows_of(q, q0, q1), rows_of(k, k0, k1),
                                                   rows_of(v, k0, k1), rows_of(dout, q0, q1), o);
    put_rows(r.dq, q0, part.dq);
    put_rows(r.dk, k0, part.dk);
    put_rows(r.dv, k0, part.dv);
    for (std::size_t h = 0; h < r.dsinks.size(); ++h) r.dsinks[h] += part.dsinks[h];
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// RoPE (SPEC 4.1, "RoPE")

Tensor64 rope(const Tensor64& x, RopePairing pairing, double base, std::int64_t offset,
              bool inverse) {
  const std::int64_t B = x.shape[0], T = x.shape[1], H = x.shape[2], d_h = x.shape[3];
  require(d_h % 2 == 0, "RoPE needs an even head width d_h");
  Tensor64 y = x;
  const std::int64_t half = d_h / 2;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < half; ++i) {
          // θ_i = base^(−2i/d_h); angle φ = p·θ_i at absolute position p = offset + t.
          const double theta =
              std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(d_h));
          double phi = static_cast<double>(offset + t) * theta;
          if (inverse) phi = -phi;  // the inverse rotation, used on gradients
          // rotate-half pairs (x_i, x_{i+d_h/2}); interleaved pairs (x_{2i}, x_{2i+1})
          const std::int64_t i0 = pairing == RopePairing::rotate_half ? i : 2 * i;
          const std::int64_t i1 = pairing == RopePairing::rotate_half ? i + half : 2 * i + 1;
          const double x0 = x.at(b, t, h, i0), x1 = x.at(b, t, h, i1);
          // (x, y) ↦ (x cos φ − y sin φ, x sin φ + y cos φ)
          y.at(b, t, h, i0) = x0 * std::cos(phi) - x1 * std::sin(phi);
          y.at(b, t, h, i1) = x0 * std::sin(phi) + x1 * std::cos(phi);
        }
  return y;
}

// ---------------------------------------------------------------------------------------------
// SPEC "Merging partial results"

ForwardResult merge(const Tensor64& o1, const Tensor64& lse1, const Tensor64& o2,
                    const Tensor64& lse2) {
  require(o1.shape == o2.shape && lse1.shape == lse2.shape, "merge: shapes of the parts differ");
  const std::int64_t B = o1.shape[0], T = o1.shape[1], H = o1.shape[2], d_h = o1.shape[3];
  require(lse1.shape == (std::array<std::int64_t, 4>{B, H, T, 1}), "merge: lse must be [B,H,T,1]");
  ForwardResult r{Tensor64(o1.shape), Tensor64(lse1.shape)};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const double L1 = lse1.at(b, h, t, 0), L2 = lse2.at(b, h, t, 0);
        // L = log(e^{L¹} + e^{L²}), evaluated stably around m = max(L¹, L²).
        const double m = max_nan(L1, L2);  // a NaN L is not an empty part: the row is NaN
        if (m == kNegInf) {                // both parts empty: the union is empty too
          r.lse.at(b, h, t, 0) = kNegInf;
          continue;  // output row stays 0
        }
        const double L = m + std::log(std::exp(L1 - m) + std::exp(L2 - m));
        r.lse.at(b, h, t, 0) = L;
        // O = e^{L¹−L} O¹ + e^{L²−L} O²  (an empty part has weight e^{−∞} = 0)
        const double w1 = std::exp(L1 - L), w2 = std::exp(L2 - L);
        for (std::int64_t e = 0; e < d_h; ++e)
          r.out.at(b, t, h, e) = (L1 == kNegInf ? 0.0 : w1 * o1.at(b, t, h, e)) +
                                 (L2 == kNegInf ? 0.0 : w2 * o2.at(b, t, h, e));
      }
  return r;
}

// ---------------------------------------------------------------------------------------------
// The layer (4.1–4.5)

std::vector<double> layer_forward(const LayerWeights& w, const std::vector<double>& u,
                                  std::int64_t batch, std::int64_t seq) {
  return layer_forward_full(w, u, batch, seq).out;
}

LayerGrads layer_backward(const LayerWeights& w, const std::vector<double>& u, std::int64_t batch,
                          std::int64_t seq, const std::vector<double>& d_out) {
  const LayerForward f = layer_forward_full(w, u, batch, seq);
  const std::int64_t d = w.d_model, dh = w.head_dim, Hq = w.heads_q, Hkv = w.heads_kv;
  const std::int64_t rows = batch * seq;
  require(static_cast<std::int64_t>(d_out.size()) == rows * d, "d_out must be [B, T, d]");
  LayerGrads g;

  // O = Y W_O  ⇒  dW_O = Yᵀ dO,  dY = dO W_Oᵀ
  g.d_w_o = matmul_xt(f.y.data, d_out, rows, Hq * dh, d);
  const Tensor64 dy = as_heads(matmul_wt(d_out, w.w_o, rows, Hq * dh, d), batch, seq, Hq, dh);

  // Attention backward (SPEC "Backward pass") on the rotated Q, K.
  Options o;
  o.scale = w.scale;
  BackwardResult ab = attention_backward(f.q, f.k, f.v, dy, o);

  // RoPE is orthogonal: its backward is the inverse rotation applied to dQ and dK.
  if (w.use_rope) {
    ab.dq = rope(ab.dq, w.pairing, w.rope_base, 0, /*inverse=*/true);
    ab.dk = rope(ab.dk, w.pairing, w.rope_base, 0, /*inverse=*/true);
  }

  // Q = U W_Q (and K, V)  ⇒  dW_Q = Uᵀ dQ, …,  dU = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ
  g.d_w_q = matmul_xt(u, ab.dq.data, rows, d, Hq * dh);
  g.d_w_k = matmul_xt(u, ab.dk.data, rows, d, Hkv * dh);
  g.d_w_v = matmul_xt(u, ab.dv.data, rows, d, Hkv * dh);
  g.d_u = matmul_wt(ab.dq.data, w.w_q, rows, d, Hq * dh);
  const std::vector<double> du_k = matmul_wt(ab.dk.data, w.w_k, rows, d, Hkv * dh);
  const std::vector<double> du_v = matmul_wt(ab.dv.data, w.w_v, rows, d, Hkv * dh);
  for (std::size_t i = 0; i < g.d_u.size(); ++i) g.d_u[i] += du_k[i] + du_v[i];
  return g;
}

double e4m3_value(std::uint8_t bits) {
  const int e = (bits >> 3) & 0xf, m = bits & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return (bits & 0x80) != 0 ? -mag : mag;
}

double dequantize(KVQuant format, std::uint8_t stored, float delta) {
  const double q = format == KVQuant::int8 ? static_cast<double>(static_cast<std::int8_t>(stored))
                                           : e4m3_value(stored);
  return q * static_cast<double>(delta);
}

double quant_max(KVQuant format) {
  return format == KVQuant::int8 ? 127.0 : 448.0;
}

}  // namespace tokenmix::reference
