"""The Python module on an AVX2-only CPU (scripts/test-avx2-cpu.sh runs this under
``qemu-x86_64 -cpu max``, and natively on a host without AVX-512): the installed wheel imports,
picks the avx2 path by itself, and computes one forward + backward through
``tokenmix.torch.scaled_dot_product_attention`` (GQA, causal, SPEC 4.1–4.8) and one decode step
on a KV cache, each against float64 PyTorch. Not a pytest module (its name has no ``test_``
prefix): a script, exit status 0 when every check holds.
"""

import sys

import numpy as np
import torch

import tokenmix
import tokenmix.torch as tmt


def reference(q, k, v, causal):
    """float64 softmax(s·QKᵀ + M)V (4.2–4.5), GQA by repeating K/V heads (4.8); [B, H, T, d_h]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:  # bottom-right aligned (4.3)
        tq, tk = s.shape[-2], s.shape[-1]
        visible = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def relative_error(x, ref):
    return float((x.double() - ref).abs().max() / ref.abs().max())


def main() -> int:
    isa = tokenmix.resolve_isa("auto")
    print(f"tokenmix {tokenmix.__version__}: automatic path {isa}")
    failures = []
    if isa != "avx2":
        failures.append(f"the automatic path is {isa}, expected avx2 on this CPU")

    # Forward + backward through the drop-in: B 2, H_q 4, H_kv 2, T 67 (a tile + 3), d_h 24.
    gen = torch.Generator().manual_seed(5)
    shape_q, shape_kv = (2, 4, 67, 24), (2, 2, 67, 24)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float32, requires_grad=True)
               for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, generator=gen)
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, causal=True)
    ref.backward(dout.double())
    errors = {"out": relative_error(out.detach(), ref.detach()),
              "dq": relative_error(q.grad, q64.grad), "dk": relative_error(k.grad, k64.grad),
              "dv": relative_error(v.grad, v64.grad)}
    print("forward + backward:", ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    failures += [f"{n} error {e:.1e} > 1e-4" for n, e in errors.items() if not e <= 1e-4]

    # One decode step (T_new 1) on an f32 and an int8 cache holding 70 positions.
    rng = np.random.default_rng(6)
    keys = rng.standard_normal((2, 70, 2, 32), dtype=np.float32)
    values = rng.standard_normal((2, 70, 2, 32), dtype=np.float32)
    query = rng.standard_normal((2, 1, 4, 32), dtype=np.float32)
    ref = reference(*(torch.from_numpy(a).double().transpose(1, 2) for a in (query, keys, values)),
                    causal=True).transpose(1, 2)
    for dtype, bound in (("f32", 1e-5), ("int8", 5e-2)):
        cache = tokenmix.KVCache(1, 2, 2, 32, 128, dtype=dtype)
        cache.append(0, keys, values)
        got = tokenmix.attention_decode(query, cache, 0)
        err = relative_error(torch.from_numpy(got), ref)
        print(f"decode, {dtype} cache: error {err:.1e}")
        if not err <= bound:
            failures.append(f"decode on the {dtype} cache: error {err:.1e} > {bound}")

    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
