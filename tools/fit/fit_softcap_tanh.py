"""Fits the coefficients of the SIMD kernels' soft-capping tanh (src/kernels/simd/tanh-inl.h).

tanh(x) ~ x * P(t) / Q(t), t = x^2 in [0, B^2], P and Q of degree 4, P(0) = Q(0) = 1: a
relative-error minimax fit of tanh(x)/x (Lawson-reweighted linearised least squares, float64),
then the coefficients are rounded to float32 one at a time, highest degree first, refitting the
others after each. Prints them as C++ hex-float literals. Needs numpy only:
    python tools/fit/fit_softcap_tanh.py [B=9.1]
The accuracy of the fp32 evaluation is measured by tests/unit/test_softcap_tanh.cpp.
"""
import sys

import numpy as np

DEG_P, DEG_Q = 4, 4


def main():
    bound = float(sys.argv[1]) if len(sys.argv) > 1 else 9.1  # the kernel clamps to fp32(B)
    tmax = bound * bound
    k = np.arange(40000)
    t = tmax * (1 - np.cos(np.pi * (k + 0.5) / len(k))) / 2
    t = np.unique(np.concatenate([t, np.linspace(0, tmax, 20000),
                                  np.geomspace(1e-8, tmax, 5000), [0.0]]))
    x = np.sqrt(t)
    f = np.where(t > 0, np.tanh(x) / np.where(x > 0, x, 1), 1.0)
    s = t / tmax  # fit in s = t / tmax (conditioning); coefficient i of t is c_i / tmax^i

    def fit(fixed_p, fixed_q, iters=300):
        best, w, q_prev = None, np.ones_like(s), np.ones_like(s)
        for _ in range(iters):
            cols, rhs = [], f.copy()
            for i in range(DEG_P + 1):
                if i in fixed_p:
                    rhs -= fixed_p[i] * s**i
                else:
                    cols.append(('p', i, s**i))
            for j in range(1, DEG_Q + 1):
                if j in fixed_q:
                    rhs += f * fixed_q[j] * s**j
                else:
                    cols.append(('q', j, -f * s**j))
            a = np.stack([c[2] for c in cols], 1)
            scale = np.sqrt(w) / (f * q_prev)  # relative error, linearised around Q_prev
            sol, *_ = np.linalg.lstsq(a * scale[:, None], rhs * scale, rcond=None)
            p = [fixed_p.get(i, 0.0) for i in range(DEG_P + 1)]
            q = [1.0] + [fixed_q.get(j, 0.0) for j in range(1, DEG_Q + 1)]
            for (kind, i, _), v in zip(cols, sol):
                (p if kind == 'p' else q)[i] = v
            pv, qv = np.polyval(p[::-1], s), np.polyval(q[::-1], s)
            err = (pv / qv - f) / f
            e = np.abs(err).max()
            if best is None or e < best[0]:
                best = (e, p, q)
            q_prev = qv
            w = w * (np.abs(err) / e) ** 0.5 + 1e-300  # Lawson: weight the worst points up
            w /= w.sum()
        return best

    fixed_p, fixed_q = {0: 1.0}, {}
    for kind, i in [('q', 4), ('p', 4), ('q', 3), ('p', 3), ('q', 2), ('p', 2), ('q', 1),
                    ('p', 1)]:
        _, p, q = fit(fixed_p, fixed_q)
        v32 = float(np.float32((p if kind == 'p' else q)[i] / tmax**i))
        (fixed_p if kind == 'p' else fixed_q)[i] = v32 * tmax**i
    pc = [float(np.float32(fixed_p[i] / tmax**i)) for i in range(DEG_P + 1)]
    qc = [1.0] + [float(np.float32(fixed_q[j] / tmax**j)) for j in range(1, DEG_Q + 1)]
    err = np.abs((np.polyval(pc[::-1], t) / np.polyval(qc[::-1], t) - f) / f).max()
    print(f'bound {bound!r}; relative error of the rounded rational {err:.3e}')
    print('P:', ', '.join(v.hex() for v in pc))
    print('Q:', ', '.join(v.hex() for v in qc))


if __name__ == '__main__':
    main()
