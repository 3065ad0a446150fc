"""Where the PyTorch autograd node comes from (tokenmix.torch_node): bundled with the package,
cached, or compiled at first use against the running torch, so that a plain ``pip install .``
(build isolation: no torch while the wheel builds) still gets the C++ node (issue 61, item 4).

Each case runs in a fresh interpreter (the node is chosen once, at ``import tokenmix.torch``),
with the bundled library hidden where the case is about the other origins, and its own cache
directory.
"""

import json
import os
import subprocess
import sys

import pytest

import tokenmix
from tokenmix import torch_node

# A fresh interpreter: hide the bundled node (or not), import tokenmix.torch, run one tiny
# forward+backward through the drop-in, print the node's status, the values and the warnings.
_PROBE = r"""
import json, sys, warnings
import tokenmix.torch_node as tn
if sys.argv[1] == "hide":
    tn.BUNDLED_LIBRARY = "/nonexistent/libtokenmix_torch.so"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, tokenmix.torch
    from tokenmix import _native
g = torch.Generator().manual_seed(7)
q = torch.randn(1, 4, 9, 16, generator=g, requires_grad=True)
k = torch.randn(1, 2, 9, 16, generator=g, requires_grad=True)
v = torch.randn(1, 2, 9, 16, generator=g, requires_grad=True)
out = tokenmix.torch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
out.square().sum().backward()
print(json.dumps({"status": _native.status, "in_use": _native.attention is not None,
                  "warnings": [str(w.message) for w in caught],
                  "values": [t.detach().flatten().tolist() for t in (out, q.grad, k.grad, v.grad)]}))
"""


def _probe(tmp_path, hide=True, **env):
    environment = dict(os.environ, TOKENMIX_CACHE_DIR=str(tmp_path / "cache"))
    environment.pop("TOKENMIX_AUTOGRAD_NODE", None)
    environment.update(env)
    result = subprocess.run([sys.executable, "-c", _PROBE, "hide" if hide else "keep"],
                            capture_output=True, text=True, env=environment, cwd=tmp_path,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_the_package_ships_the_node_sources():
    for name in ("torch_node.cpp", "native_entry.hpp", os.path.join("include", "tokenmix",
                                                                     "attention.hpp")):
        assert os.path.isfile(os.path.join(torch_node.SOURCE_DIR, name)), name


def test_the_cache_key_names_torch_abi_and_sources(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("TOKENMIX_CACHE_DIR", str(tmp_path))
    path = torch_node.cached_library()
    assert path.startswith(str(tmp_path / "torch-node"))
    assert f"abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in path
    assert os.path.basename(path) == "libtokenmix_torch.so"
    command = torch_node.compile_command("/tmp/x.so")
    assert command[-1].startswith("-Wl,-rpath,") and "torch_node.cpp" in " ".join(command)


def test_off_uses_the_python_path_with_the_same_values(tmp_path):
    off, _ = _probe(tmp_path, hide=False, TOKENMIX_AUTOGRAD_NODE="off")
    bundled, _ = _probe(tmp_path, hide=False)
    assert off["status"].startswith("off") and not off["in_use"]
    assert bundled["status"].startswith("loaded (bundled") and bundled["in_use"]
    assert off["values"] == bundled["values"]  # same kernels, bit for bit


def test_an_unknown_mode_is_an_argument_error(tmp_path, monkeypatch):
    environment = dict(os.environ, TOKENMIX_AUTOGRAD_NODE="sometimes")
    result = subprocess.run([sys.executable, "-c", "import tokenmix.torch"], capture_output=True,
                            text=True, env=environment, cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    assert "ArgumentError" in result.stderr and "TOKENMIX_AUTOGRAD_NODE" in result.stderr
    assert "'sometimes'" in result.stderr and "auto, prebuilt, off" in result.stderr
    monkeypatch.setenv("TOKENMIX_AUTOGRAD_NODE", "sometimes")
    with pytest.raises(tokenmix.ArgumentError, match="TOKENMIX_AUTOGRAD_NODE") as info:
        torch_node.mode()
    assert info.value.code == "invalid_argument"


def test_prebuilt_never_compiles(tmp_path):
    result, stderr = _probe(tmp_path, TOKENMIX_AUTOGRAD_NODE="prebuilt")
    assert not result["in_use"]
    assert "TOKENMIX_AUTOGRAD_NODE=prebuilt" in result["status"], result["status"]
    assert "compiling" not in stderr
    assert not (tmp_path / "cache" / "torch-node").exists() or not any(
        f.name.endswith(".so") for f in (tmp_path / "cache" / "torch-node").rglob("*"))


def test_a_failed_build_warns_names_its_log_and_keeps_the_values(tmp_path):
    failed, stderr = _probe(tmp_path, CXX="false")
    assert not failed["in_use"]
    assert failed["status"].startswith("not built:"), failed["status"]
    assert "compiling the autograd node failed (exit 1" in failed["status"]
    assert any("not in use" in w and "build.log" in w for w in failed["warnings"]), failed
    assert "compiling the PyTorch autograd node" in stderr
    logs = list((tmp_path / "cache" / "torch-node").rglob("build.log"))
    assert len(logs) == 1 and logs[0].read_text().startswith("false ")
    reference, _ = _probe(tmp_path, hide=False)
    assert failed["values"] == reference["values"]


@pytest.mark.slow  # compiles the node against torch's headers (a minute or two on 2 cores)
def test_first_use_builds_then_reuses_the_cached_node(tmp_path):
    # The compiler the package names ($CXX), with -O0 after the build's -O2 (the last -O wins):
    # what is checked is where the node comes from and what it computes, and the compile takes
    # half the time (D-ci-11).
    cxx = tmp_path / "cxx-O0"
    cxx.write_text('#!/bin/sh\nexec c++ "$@" -O0\n')
    cxx.chmod(0o755)
    built, stderr = _probe(tmp_path, CXX=str(cxx))
    assert built["status"].startswith("loaded (built:"), built["status"]
    assert "autograd node built in" in stderr
    cached, stderr = _probe(tmp_path)
    assert cached["status"].startswith("loaded (cached:"), cached["status"]
    assert "compiling" not in stderr
    bundled, _ = _probe(tmp_path, hide=False)
    assert built["values"] == cached["values"] == bundled["values"]
