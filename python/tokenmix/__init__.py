"""tokenmix — exact causal self-attention, fast on CPUs (NumPy and PyTorch bindings).

The mathematics is SPEC.md's (equation numbers 4.1–4.8). Every function here works on NumPy
arrays and on PyTorch CPU tensors, **without copying**: arrays are handed to the C++ library
through DLPack / the buffer protocol together with their strides, so both the default layout
``[B, T, H, d_h]`` ("bthd") and PyTorch's SDPA layout ``[B, H, T, d_h]`` ("bhtd", pass
``layout="bhtd"``) and any other strided view (slices, transposes) are used in place. Outputs
are allocated with the library of the first input (NumPy in, NumPy out; torch in, torch out)
unless you pass your own (``out=...``), which is then written in place.

Shapes (logical, for ``layout="bthd"``; with ``"bhtd"`` axes 1 and 2 are swapped):

====== ========================== =============================================
name   shape                      meaning
====== ========================== =============================================
q      [B, T_q, H_q, d_h]         queries
k, v   [B, T_k, H_kv, d_h]        keys, values; H_kv divides H_q (GQA, 4.8)
out    [B, T_q, H_q, d_h]         O_h = softmax(s·Q_h K_jᵀ + M) V_j (4.2–4.5)
lse    [B, H_q, T_q]              row log-sum-exp L_t (4.4); always [B, H, T]
====== ========================== =============================================

Dtype policy: native-endian float32 is computed; the attention functions (forward, backward,
varlen, decode) also take bfloat16 (``ml_dtypes.bfloat16`` arrays, ``torch.bfloat16``) and
float16 (``numpy.float16``, ``torch.float16``) for q, k, v, out, dout, dq, dk, dv — all of one
call in one dtype, outputs allocated in it, lse always float32; products accumulate in float32
and the results are rounded once (SPEC "Reduced precision"). Any other dtype (float64, a
big-endian ``'>f4'``, ...) or a mix raises ``TypeError`` naming the argument — no silent
conversion (it would be a hidden copy and a silent precision change). Errors from the C++ library raise
:class:`ArgumentError` (a ``ValueError``), :class:`UnsupportedError` (a
``NotImplementedError``) or :class:`ResourceError` (a ``MemoryError``: kernel scratch that
cannot be allocated) with the library's message and an attribute ``code``
(``"shape_mismatch"``, ``"aliasing"``, ``"out_of_memory"``, ...); so do a NumPy view whose byte
stride is not a multiple of its element size, a ``threads`` outside [0, 2**31 − 1] and an
``align`` other than ``"bottom_right"``/``"top_left"`` (ArgumentError, ``"invalid_argument"``).
The GIL is released while the library computes.

Score variants (SPEC "Score variants used by real models"): the attention entry points take
``window=``, ``softcap=``, ``alibi_slopes=``, ``sinks=`` (the backward then also returns
d(sinks)), ``mask=`` (bool or float32, broadcastable to [B, H_q, T_q, T_k], any strides) and
``key_lengths=``; ``attention_forward_varlen``/``attention_backward_varlen`` take packed
variable-length batches ([total, H, d_h] with ``cu_seqlens``); ``attention_decode`` and
``KVCache(window=W)`` (a rolling cache) serve sliding-window layers.

For a differentiable, drop-in replacement of ``torch.nn.functional.scaled_dot_product_attention``
(with ``attn_mask``, the variants as keyword-only extras, and ``varlen_attention``) see
:mod:`tokenmix.torch`; for a side-by-side benchmark run ``python -m tokenmix.bench``.

Modules (all re-exported here; import from ``tokenmix``): ``_attention`` (forward, backward,
useful-work counts), ``_ops`` (merge, RoPE, softmax), ``_kv_cache`` (KVCache, decode), ``_layer``
(CausalSelfAttention), ``_runtime`` (version, ISAs, CPU), ``_errors``, ``_convert`` (array
helpers) and the native extension ``_tokenmix`` (python/src).
"""

from ._attention import (
    attention_backward,
    attention_backward_varlen,
    attention_dropout_mask,
    attention_forward,
    attention_forward_varlen,
    attention_weights,
    backward_flops,
    forward_flops,
    visible_keys,
    visible_pairs,
)
from ._errors import ArgumentError, FileError, ResourceError, UnsupportedError
from ._kv_cache import KVCache, attention_decode, kv_cache_bytes
from ._layer import CausalSelfAttention, LayerGradients
from ._ops import (
    logsumexp,
    merge_partials,
    rope_backward,
    rope_forward,
    softmax,
    softmax_jacobian,
    softmax_jacobian_vector_product,
)
from ._runtime import (
    available_isas,
    cpu_cap,
    fp8_direct_widening,
    linear_decode_prefetch,
    decode_amx,
    cpu_features,
    default_threads,
    describe_kernel,
    resolve_isa,
    thread_runtimes,
    version,
)

__all__ = [
    "ArgumentError",
    "UnsupportedError",
    "FileError",
    "ResourceError",
    "attention_forward",
    "attention_backward",
    "attention_forward_varlen",
    "attention_backward_varlen",
    "attention_weights",
    "attention_dropout_mask",
    "merge_partials",
    "rope_forward",
    "rope_backward",
    "logsumexp",
    "softmax",
    "softmax_jacobian",
    "softmax_jacobian_vector_product",
    "visible_keys",
    "visible_pairs",
    "forward_flops",
    "backward_flops",
    "kv_cache_bytes",
    "KVCache",
    "attention_decode",
    "CausalSelfAttention",
    "LayerGradients",
    "version",
    "cpu_features",
    "cpu_cap",
    "fp8_direct_widening",
    "linear_decode_prefetch",
    "decode_amx",
    "available_isas",
    "resolve_isa",
    "default_threads",
    "thread_runtimes",
    "describe_kernel",
    "__version__",
]

__version__: str = version()


def _present_as_tokenmix() -> None:
    """The functions and classes written in the private modules present themselves as
    ``tokenmix.<name>`` (help(), repr, pickling), as before the package was split."""
    for name in __all__:
        obj = globals()[name]
        module = getattr(obj, "__module__", "")
        if module.startswith(__name__ + "._") and module != __name__ + "._tokenmix":
            obj.__module__ = __name__


_present_as_tokenmix()
del _present_as_tokenmix
