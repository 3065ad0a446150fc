"""One thread pool with PyTorch (issue 61, item 3): tokenmix's teams and PyTorch's intra-op
threads run on the same OpenMP runtime whichever package is imported first, so they do not take
turns on the cores, and ``torch.set_num_threads`` sets tokenmix's default thread count too
(docs/performance.md, D-torch-8). Each order runs in a fresh interpreter."""

import json
import subprocess
import sys

import pytest

import tokenmix

_PROBE = r"""
import json, sys
first, second = sys.argv[1:3]
__import__(first); __import__(second)
import torch, tokenmix, tokenmix.torch
q = torch.randn(1, 2, 70, 16)
tokenmix.torch.scaled_dot_product_attention(q, q, q, is_causal=True)  # tokenmix's team
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # PyTorch's
counts = {}
for n in (1, 2, 3):
    torch.set_num_threads(n)
    counts[n] = tokenmix.default_threads()
print(json.dumps({"runtimes": tokenmix.thread_runtimes(), "threads": counts}))
"""


@pytest.mark.parametrize("order", [("torch", "tokenmix"), ("tokenmix", "torch")])
def test_one_openmp_runtime_serves_torch_and_tokenmix(order):
    result = subprocess.run([sys.executable, "-c", _PROBE, *order], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(seen["runtimes"]["openmp"]) == 1, seen["runtimes"]
    assert seen["threads"] == {"1": 1, "2": 2, "3": 3}


def test_thread_runtimes_lists_this_process_libraries():
    found = tokenmix.thread_runtimes()
    assert set(found) == {"openmp", "openblas"}
    assert any("gomp" in path or "omp" in path for path in found["openmp"])  # the extension's
    assert all(path.startswith("/") for paths in found.values() for path in paths)
