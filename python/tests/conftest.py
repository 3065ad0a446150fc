"""Shared helpers for the tokenmix Python tests.

Yardstick: PyTorch computing in float64 (torch.nn.functional.scaled_dot_product_attention, or the
same equations written with torch ops), so the reference's own rounding (~1e-16) is negligible
next to tokenmix's float32 rounding. Tolerances are stated where they are used, as
    max |ours − ref| ≤ atol + rtol · max |ref|.
"""

from __future__ import annotations

import os

# Every kernel scratch block is filled with 0xFF (NaN) before each use, so a kernel reading
# scratch it did not write in the same call fails a test instead of passing on stale values
# (src/kernels/scratch_arena.hpp). Set before tokenmix is imported; subprocesses inherit it.
os.environ["TOKENMIX_POISON_SCRATCH"] = "1"

import numpy as np
import pytest
import torch

# float32 results vs the float64 yardstick. Forward: a few float32 ulps of O(1) outputs
# accumulated over ≤ 256 keys. Gradients: sums over T of products, so a looser bound.
FWD_ATOL, FWD_RTOL = 2e-5, 1e-4
BWD_ATOL, BWD_RTOL = 1e-4, 2e-4


def max_err(ours, ref) -> float:
    ours = torch.as_tensor(np.asarray(ours) if isinstance(ours, np.ndarray) else ours).double()
    ref = torch.as_tensor(np.asarray(ref) if isinstance(ref, np.ndarray) else ref).double()
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return (ours - ref).abs().max().item() if ours.numel() else 0.0


def assert_close(ours, ref, atol: float, rtol: float, what: str = "") -> None:
    ref_t = torch.as_tensor(ref).double()
    bound = atol + rtol * (ref_t.abs().max().item() if ref_t.numel() else 0.0)
    err = max_err(ours, ref)
    assert err <= bound, f"{what}: max |ours - ref| = {err:.3e} > {bound:.3e}"


def causal_mask(T_q: int, T_k: int, align: str) -> torch.Tensor:
    """Boolean [T_q, T_k] mask, True = visible (SPEC 4.3)."""
    t = torch.arange(T_q).unsqueeze(1)
    u = torch.arange(T_k).unsqueeze(0)
    shift = (T_k - T_q) if align == "bottom_right" else 0
    return u <= t + shift


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield
