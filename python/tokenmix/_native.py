"""The PyTorch autograd node in C++ (``libtokenmix_torch.so``, python/src/torch_node.cpp).

The drop-in's common eager training call (no score variants, top-left causal or no mask,
gradients wanted) runs as one C++ operator, ``torch.ops.tokenmix_native.attention``, whose
autograd node saves its tensors and runs the backward in C++: a Python
``torch.autograd.Function`` costs tens of microseconds per call by itself (issue 18's per-call
target is PyTorch's time + 10 µs). Same kernels, same results, bit for bit.

The node is built with the package when the building interpreter can import torch, against that
torch (``_native_build.TORCH_VERSION``); it is loaded only under that same torch version.
:data:`status` says whether it is in use and, if not, why; without it the Python
``autograd.Function`` path (``tokenmix._torch_ops._EagerPlain``) serves the same calls.

Errors of the library come back from the operator as ``RuntimeError("tokenmix-native[<class>:
<code>] <message>")``; :data:`attention` turns them back into tokenmix's exception types.
"""

import os
import re
from typing import Callable, Optional

import torch

from . import _tokenmix as _C
from ._errors import ArgumentError, FileError, ResourceError, UnsupportedError

_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtokenmix_torch.so")
_MESSAGE = re.compile(r"tokenmix-native\[(\w+):(\w+)\] (.*)", re.S)
_TYPES = {"ArgumentError": ArgumentError, "UnsupportedError": UnsupportedError,
          "ResourceError": ResourceError, "FileError": FileError}


def _load() -> "tuple[Optional[Callable[..., torch.Tensor]], str]":
    try:
        from . import _native_build  # written by the build next to the library
    except ImportError:
        return None, ("not built: torch was not importable when the package was built (build "
                      "with `pip install --no-build-isolation .` in an environment with torch)")
    if _native_build.TORCH_VERSION != torch.__version__:
        return None, (f"not loaded: built for torch {_native_build.TORCH_VERSION}, running torch "
                      f"{torch.__version__} (rebuild tokenmix against this torch)")
    torch.ops.load_library(_LIBRARY)
    torch.ops.tokenmix_native.bind(_C._native_entry_points())
    return torch.ops.tokenmix_native.attention.default, "loaded"


#: ``torch.ops.tokenmix_native.attention.default``, or None when the node is not in use.
op: Optional[Callable[..., torch.Tensor]]
#: "loaded", or why the node is not in use.
status: str
op, status = _load()


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float],
          is_causal: bool) -> torch.Tensor:
    """out = op(q, k, v, scale, is_causal), the library's errors as tokenmix's exceptions."""
    try:
        return op(q, k, v, scale, is_causal)  # type: ignore[misc]
    except RuntimeError as e:
        _reraise(e)
        raise


#: _call when the node is in use (q [B, H_q, L, E], k/v [B, H_kv, S, E]; out [B, H_q, L, E],
#: differentiable w.r.t. q, k, v), else None.
attention: Optional[Callable[..., torch.Tensor]] = _call if op is not None else None


def _reraise(error: RuntimeError) -> None:
    """Raises the tokenmix exception a node error message names; returns for any other error."""
    m = _MESSAGE.search(str(error))
    exc_type = _TYPES.get(m.group(1)) if m is not None else None
    if m is None or exc_type is None:  # not the library's (a bug): as it came
        return
    exc = exc_type(m.group(3).strip())
    exc.code = m.group(2)
    raise exc from None
