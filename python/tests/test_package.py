"""The package's surface: the public names (unchanged by splitting tokenmix/__init__.py into
modules), where its objects say they live, and the type stubs of the native extension kept in
step with what the extension defines."""

from __future__ import annotations

import ast
import pickle
import re
import types
from pathlib import Path

import numpy as np

import tokenmix
import tokenmix._tokenmix as _C

# Every public name of `tokenmix` before the split (its __all__ then), in one explicit list, plus
# those added since: ResourceError, backward_flops, cpu_cap, attention_forward_varlen,
# attention_backward_varlen, fp8_direct_widening, linear_decode_prefetch, decode_amx,
# thread_runtimes, attention_weights.
PUBLIC_NAMES = [
    "ArgumentError",
    "CausalSelfAttention",
    "FileError",
    "KVCache",
    "LayerGradients",
    "ResourceError",
    "UnsupportedError",
    "attention_backward",
    "attention_backward_varlen",
    "attention_decode",
    "attention_dropout_mask",
    "attention_forward",
    "attention_forward_varlen",
    "attention_weights",
    "available_isas",
    "backward_flops",
    "cpu_cap",
    "cpu_features",
    "decode_amx",
    "default_threads",
    "describe_kernel",
    "forward_flops",
    "fp8_direct_widening",
    "kv_cache_bytes",
    "linear_decode_prefetch",
    "logsumexp",
    "merge_partials",
    "resolve_isa",
    "rope_backward",
    "rope_forward",
    "softmax",
    "softmax_jacobian",
    "softmax_jacobian_vector_product",
    "thread_runtimes",
    "version",
    "visible_keys",
    "visible_pairs",
]
# Subpackages that appear in dir(tokenmix) once something imports them (other tests do).
# torch_node is imported by the native-module loader when torch is present.
SUBMODULES = {"torch", "bench", "distributed", "transformers", "torch_node", "plot"}
# Written in Python (the private modules); they present themselves as tokenmix.<name>.
PYTHON_DEFINED = [
    "CausalSelfAttention", "LayerGradients", "attention_backward", "attention_backward_varlen",
    "attention_decode", "attention_dropout_mask", "attention_forward", "attention_forward_varlen", "attention_weights", "backward_flops", "forward_flops", "logsumexp", "merge_partials",
    "resolve_isa", "rope_backward", "rope_forward", "softmax", "softmax_jacobian",
    "softmax_jacobian_vector_product", "thread_runtimes", "visible_keys", "visible_pairs",
]


def test_public_names_are_exactly_the_list():
    public = sorted(n for n in dir(tokenmix) if not n.startswith("_") and n not in SUBMODULES)
    assert public == PUBLIC_NAMES
    for name in SUBMODULES & set(dir(tokenmix)):
        assert isinstance(getattr(tokenmix, name), types.ModuleType), name
    assert sorted(tokenmix.__all__) == sorted(PUBLIC_NAMES + ["__version__"])
    namespace: dict = {}
    exec("from tokenmix import *", namespace)  # noqa: S102 — what `import *` gives
    assert set(namespace) - {"__builtins__"} == set(PUBLIC_NAMES) | {"__version__"}
    assert tokenmix.__version__ == tokenmix.version() and re.fullmatch(r"\d+\.\d+\.\d+",
                                                                        tokenmix.__version__)


def test_objects_present_themselves_as_tokenmix():
    for name in PYTHON_DEFINED:
        assert getattr(tokenmix, name).__module__ == "tokenmix", name
    # The native parts are the extension's, the errors tokenmix.<Name> as documented.
    assert tokenmix.KVCache is _C.KVCache and tokenmix.version is _C.version
    assert tokenmix.cpu_cap is _C.cpu_cap
    assert tokenmix.fp8_direct_widening is _C.fp8_direct_widening
    assert tokenmix.linear_decode_prefetch is _C.linear_decode_prefetch
    for err, base in ((tokenmix.ArgumentError, ValueError),
                      (tokenmix.UnsupportedError, NotImplementedError),
                      (tokenmix.FileError, OSError),
                      (tokenmix.ResourceError, MemoryError)):
        assert err is getattr(_C, err.__name__) and issubclass(err, base)
        assert f"{err.__module__}.{err.__name__}" == f"tokenmix.{err.__name__}"
    grads = tokenmix.LayerGradients(*(np.full(2, i, np.float32) for i in range(5)))
    again = pickle.loads(pickle.dumps(grads))
    assert type(again) is tokenmix.LayerGradients
    assert all(np.array_equal(a, b) for a, b in zip(again, grads))


def test_torch_and_bench_subpackages():
    import tokenmix.bench
    import tokenmix.torch

    assert tokenmix.torch.__all__ == ["scaled_dot_product_attention", "varlen_attention"]
    assert callable(tokenmix.torch.scaled_dot_product_attention)
    assert callable(tokenmix.torch.varlen_attention)
    assert callable(tokenmix.bench.main)
    # SPEC "Useful-work counts": the benchmark counts with the library (backward = 2.5 ×
    # forward), not with a constant of its own.
    assert not hasattr(tokenmix.bench, "BACKWARD_FLOP_FACTOR")
    assert tokenmix.bench.case_flops(2, 64, 3, 16, "fwd") == tokenmix.forward_flops(
        2, 64, 64, 3, 16, True, "top_left")
    assert tokenmix.bench.case_flops(2, 64, 3, 16, "fwd+bwd") == 3.5 * tokenmix.forward_flops(
        2, 64, 64, 3, 16, True, "top_left")


# --- the type stubs (_tokenmix.pyi) against the extension -------------------------------------


def _signature_names(doc: str) -> list:
    """Parameter names of nanobind's rendered signature 'f(a: int, b: Array = 0) -> None'."""
    inside = doc.splitlines()[0]
    inside = inside[inside.index("(") + 1 : inside.rindex(")")]
    names, depth, start = [], 0, 0
    for i, ch in enumerate(inside + ","):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            part = inside[start:i].strip()
            if part:
                names.append(re.split(r"[:=]", part, 1)[0].strip())
            start = i + 1
    return [n for n in names if n != "self"]


def _stub_names(fn: ast.FunctionDef) -> list:
    return [a.arg for a in fn.args.args if a.arg != "self"]


def test_type_stubs_match_the_extension():
    stub = ast.parse((Path(tokenmix.__file__).parent / "_tokenmix.pyi").read_text("utf-8"))
    stub_funcs = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    stub_classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    native = {n for n in dir(_C) if not n.startswith("_")}
    assert set(stub_funcs) | set(stub_classes) == native
    for name, node in stub_funcs.items():
        assert _stub_names(node) == _signature_names(getattr(_C, name).__doc__), name
    for name, node in stub_classes.items():
        cls = getattr(_C, name)
        members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        attrs = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        native_members = {n for n in vars(cls) if not n.startswith("_")} | (
            {"__init__"} if "__init__" in vars(cls) else set())
        if issubclass(cls, Exception):
            assert attrs == {"code"}, name
            continue
        assert set(members) | attrs == native_members, name
        for m, node_m in members.items():
            assert _stub_names(node_m) == _signature_names(getattr(cls, m).__doc__), (name, m)
        for a in attrs:
            assert isinstance(vars(cls)[a], property), (name, a)
