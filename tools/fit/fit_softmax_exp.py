"""Fits the polynomial of the SIMD kernels' softmax exp (src/kernels/simd/exp-inl.h).

e^r ~ P(r) = 1 + r + c2 r^2 + ... + c6 r^6 on r in [-ln 2 / 2, ln 2 / 2] (the reduced argument
after x = n ln 2 + r): a relative-error minimax fit (Lawson-reweighted least squares, float64)
with P(0) = 1 and P'(0) = 1 fixed, then the coefficients are rounded to float32 one at a time,
highest degree first, refitting the others after each. Prints them as C++ hex-float literals and
the relative error of the rounded polynomial evaluated exactly and in fp32 Horner form (each FMA
rounded once). Needs numpy only:
    python tools/fit/fit_softmax_exp.py
The accuracy of the kernels' fp32 evaluation is measured by tests/unit/test_softmax_exp.cpp.
"""
import numpy as np

DEG = 6


def main():
    half = np.log(2.0) / 2
    k = np.arange(20000)
    r = np.unique(np.concatenate([half * np.cos(np.pi * (k + 0.5) / len(k)),
                                  np.linspace(-half, half, 20001)]))
    f = np.exp(r)

    def fit(fixed, iters=200):
        best, w = None, np.ones_like(r)
        for _ in range(iters):
            cols, rhs = [], f.copy()
            for i in range(DEG + 1):
                if i in fixed:
                    rhs -= fixed[i] * r**i
                else:
                    cols.append((i, r**i))
            a = np.stack([c[1] for c in cols], 1)
            scale = np.sqrt(w) / f  # relative error
            sol, *_ = np.linalg.lstsq(a * scale[:, None], rhs * scale, rcond=None)
            c = [fixed.get(i, 0.0) for i in range(DEG + 1)]
            for (i, _), v in zip(cols, sol):
                c[i] = v
            err = (np.polyval(c[::-1], r) - f) / f
            e = np.abs(err).max()
            if best is None or e < best[0]:
                best = (e, c)
            w = w * (np.abs(err) / e) ** 0.5 + 1e-300  # Lawson: weight the worst points up
            w /= w.sum()
        return best

    fixed = {0: 1.0, 1: 1.0}
    for i in range(DEG, 1, -1):
        _, c = fit(fixed)
        fixed[i] = float(np.float32(c[i]))
    c = [fixed[i] for i in range(DEG + 1)]
    exact = np.abs((np.polyval(c[::-1], r) - f) / f).max()
    r32 = r.astype(np.float32).astype(np.float64)
    p = np.full_like(r32, c[DEG])
    for i in range(DEG - 1, -1, -1):  # fp32 Horner: each FMA rounded once
        p = (p * r32 + c[i]).astype(np.float32).astype(np.float64)
    horner = np.abs((p - np.exp(r32)) / np.exp(r32)).max()
    print(f'relative error of the rounded polynomial {exact:.3e}, in fp32 Horner form {horner:.3e}')
    print('c0..c6:', ', '.join(v.hex() for v in c))


if __name__ == '__main__':
    main()
