"""The PyTorch autograd node in C++ (``libtokenmix_torch.so``, python/src/torch_node.cpp).

The drop-in's common eager training call (no score variants, top-left causal or no mask,
gradients wanted) runs as one C++ operator, ``torch.ops.tokenmix_native.attention``, whose
autograd node saves its tensors and runs the backward in C++: a Python
``torch.autograd.Function`` costs tens of microseconds per call by itself (issue 18's per-call
target is PyTorch's time + 10 µs). Same kernels, same results, bit for bit.

The node is compiled against the torch it serves: bundled with the package when the build could
import torch, else built once per torch version at first use and cached (:mod:`tokenmix.torch_node`
says where from, and how ``TOKENMIX_AUTOGRAD_NODE`` chooses). :data:`status` says whether it is in
use and, if not, why; without it the Python ``autograd.Function`` path
(``tokenmix._torch_ops._EagerPlain``) serves the same calls.

Errors of the library come back from the operator as ``RuntimeError("tokenmix-native[<class>:
<code>] <message>")``; :data:`attention` turns them back into tokenmix's exception types.
"""

import re
import warnings
from typing import Callable, Optional

import torch

from . import _tokenmix as _C
from . import torch_node
from ._errors import ArgumentError, FileError, ResourceError, UnsupportedError

_MESSAGE = re.compile(r"tokenmix-native\[(\w+):(\w+)\] (.*)", re.S)
_TYPES = {"ArgumentError": ArgumentError, "UnsupportedError": UnsupportedError,
          "ResourceError": ResourceError, "FileError": FileError}


def _load() -> "tuple[Optional[Callable[..., torch.Tensor]], str]":
    mode = torch_node.mode()
    if mode == "off":
        return None, "off: TOKENMIX_AUTOGRAD_NODE=off (the Python autograd path)"
    try:
        library, origin = torch_node.find(allow_build=(mode == "auto"))
    except ResourceError as e:  # no compiler, or it failed: the Python path, and say why
        warnings.warn(f"tokenmix: the PyTorch autograd node is not in use ({e}); the Python "
                      f"autograd path computes the same values, tens of microseconds slower "
                      f"per call", RuntimeWarning, stacklevel=3)
        return None, f"not built: {e}"
    if library is None:
        return None, origin
    torch.ops.load_library(library)
    torch.ops.tokenmix_native.bind(_C._native_entry_points())
    return torch.ops.tokenmix_native.attention.default, f"loaded ({origin}: {library})"


#: ``torch.ops.tokenmix_native.attention.default``, or None when the node is not in use.
op: Optional[Callable[..., torch.Tensor]]
#: "loaded (<origin>: <path>)", origin bundled, cached or built; or why the node is not in use.
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
