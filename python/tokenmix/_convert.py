"""Array helpers shared by the tokenmix modules: accepting NumPy arrays and PyTorch tensors
without copies, allocating outputs from the library of an input, and the two layouts
``"bthd"`` ([B, T, H, d_h], the default) and ``"bhtd"`` ([B, H, T, d_h], PyTorch's SDPA layout),
which are views of each other (axes 1 and 2 swapped).

Attention outputs are allocated in the inputs' dtype (float32, float16 or ml_dtypes.bfloat16 /
torch.bfloat16), the log-sum-exp always in float32. Dtypes and strides are checked by the native
extension (python/src/convert.cpp), which names the
function and the argument in its errors.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

__all__ = [
    "LAYOUTS", "is_torch", "as_array", "as_output", "new_empty", "swap12", "check_layout", "view4",
    "contiguous", "is_c_contiguous", "opt_float", "opt_vector", "opt_mask4", "index_vector",
]

LAYOUTS = ("bthd", "bhtd")
# NumPy's float16 and ml_dtypes.bfloat16: the reduced-precision attention dtypes.
HALF_DTYPE_NAMES = ("float16", "bfloat16")


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def as_array(fn: str, name: str, x: Any) -> Any:
    """Checks that x is an array the extension can take; detaches torch tensors (no copy)."""
    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        return x.detach() if x.requires_grad else x
    raise TypeError(
        f"{fn}: {name} must be a numpy.ndarray or a torch.Tensor; got {type(x).__name__}"
    )


def as_output(fn: str, name: str, x: Any) -> Any:
    """Checks a caller-supplied output: an array, writable."""
    x = as_array(fn, name, x)
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only; outputs must be writable")
    return x


def new_empty(like: Any, shape: Tuple[int, ...], float32: bool = False) -> Any:
    """An array of `shape` from the library of `like` (torch or NumPy), in like's dtype when that
    is bfloat16 or float16 (an attention output: SPEC "Reduced precision") unless `float32`
    (the log-sum-exp, d(sinks)), else float32."""
    if is_torch(like):
        import torch

        half = (torch.bfloat16, torch.float16)
        dtype = like.dtype if not float32 and like.dtype in half else torch.float32
        return torch.empty(shape, dtype=dtype)
    dtype = getattr(like, "dtype", None)
    if float32 or dtype is None or dtype.itemsize != 2 or dtype.name not in HALF_DTYPE_NAMES:
        dtype = np.float32
    return np.empty(shape, dtype=dtype)


def swap12(x: Any) -> Any:
    """[B, H, T, D] <-> [B, T, H, D] as a view (no copy)."""
    if is_torch(x):
        return x.permute(0, 2, 1, 3)
    return x.transpose(0, 2, 1, 3)


def check_layout(fn: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be 'bthd' or 'bhtd'; got {layout!r}")


def view4(fn: str, name: str, x: Any, layout: str) -> Any:
    if x.ndim != 4:
        raise ValueError(
            f"{fn}: {name} must have 4 dimensions ([B, T, H, d_h], or [B, H, T, d_h] with "
            f"layout='bhtd'); got shape {tuple(x.shape)}"
        )
    return swap12(x) if layout == "bhtd" else x


def contiguous(x: Any) -> Any:
    if is_torch(x):
        return x.contiguous()
    return np.ascontiguousarray(x)


def is_c_contiguous(x: Any) -> bool:
    if is_torch(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


def opt_float(fn: str, name: str, x: Any) -> Any:
    """None, or x as a Python float (a real number: int, float, NumPy scalar, 0-d tensor);
    anything else (a bool, a string, an array of several elements) raises TypeError naming it."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or isinstance(x, str):
        raise TypeError(f"{fn}: {name} must be a real number or None; got {type(x).__name__}")
    try:
        return float(x)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{fn}: {name} must be a real number or None; got {type(x).__name__}"
        ) from e


def opt_vector(fn: str, name: str, x: Any) -> Any:
    """None, an array/tensor (passed as is: dtype and shape are checked by the extension), or a
    list/tuple of numbers (made a float32 NumPy array — a Python sequence has no dtype to keep)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.float32)
    return as_array(fn, name, x)


def index_vector(fn: str, name: str, x: Any) -> Any:
    """An int32/int64 array/tensor (passed as is), or a list/tuple of ints (made an int64 array)."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x, dtype=np.int64)
    return as_array(fn, name, x)


def opt_mask4(fn: str, name: str, x: Any) -> Any:
    """None, or a mask of rank ≤ 4 viewed as rank 4 by prepending size-1 axes (no copy; the
    library broadcasts every size-1 axis with stride 0)."""
    if x is None:
        return None
    x = as_array(fn, name, x)
    if x.ndim > 4:
        raise ValueError(
            f"{fn}: {name} must have at most 4 dimensions (broadcastable to [B, H_q, T_q, T_k]); "
            f"got shape {tuple(x.shape)}"
        )
    if x.ndim < 4:
        x = x[(None,) * (4 - x.ndim)]
    return x
