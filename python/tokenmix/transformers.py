"""tokenmix as an attention implementation of Hugging Face transformers (5.x).

::

    import tokenmix.transformers
    tokenmix.transformers.register()          # idempotent
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="tokenmix")
    # or: model.set_attn_implementation("tokenmix")

:func:`register` adds "tokenmix" to transformers' attention interface (``AttentionInterface``:
the function the attention layers call) *and* to its mask interface
(``masking_utils.AttentionMaskInterface``: the function that builds the masks the model passes
to the layers). Registering only the former would make transformers stop building masks
(padding and static caches would then be silently wrong). transformers is an optional
dependency: ``pip install tokenmix[transformers]``.

What the layers pass is mapped onto tokenmix's options (SPEC "Score variants used by real
models"):

* no mask: the mask function returns ``None`` only when the keys are exactly the positions up to
  the last query (dynamic cache or no cache, no padding, window not reached), so the causal mask
  is **bottom-right** aligned (chunked prefill and cached decoding: query i of L sees the S − L
  cached keys and its own prefix); the layer's ``sliding_window`` becomes ``window``;
* otherwise a boolean mask ``[B, 1, L, S]`` (transformers' own mask, with padding, sliding window
  and static-cache length in it), passed as ``attn_mask``: tokenmix detects a mask whose visible
  keys form one interval per row (causal + left or right padding + window) and runs it as key
  ranges at the unmasked speed; a float (additive) 4D mask passed by the caller is a bias;
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``), ``scaling``, grouped-query attention
  (H_q a multiple of H_kv, no repeat), sinks (gpt-oss ``s_aux=module.sinks``, with gradient).

Dtypes: float32, bfloat16 (transformers' default for most models) and float16 (SPEC "Reduced
precision"); the output has the query's dtype; bfloat16/float16 sinks and additive masks are
widened exactly to float32.

``output_attentions=True`` (passed to the model's forward) returns each layer's
attention weights, computed exactly from the forward's log-sum-exp
(:func:`tokenmix.attention_weights`: P = exp(S + M − L), SPEC 4.2–4.4; only the [B, H_q, L, S]
output is allocated), in the query's dtype, as eager attention's ``attn_weights`` (with sinks, the
keys' columns only); the model's other outputs are those of a call without it. The weights are
not differentiable (the output is, as always).

Attention dropout in training (``attention_dropout`` > 0: transformers passes it when the model
is in training mode) is applied exactly (docs/design.md D.1–D.4), with a Philox mask whose seed
comes from PyTorch's CPU generator (``torch.manual_seed`` repeats it); it is not eager
attention's mask, so single steps differ from eager's, not their statistics.

No silent fallback to PyTorch: dropout with a tokenmix :class:`Cache`, a position bias, a dtype other than those
three (or mixed), a non-CPU tensor and ``output_attentions`` on a tokenmix :class:`Cache` raise
:class:`tokenmix.UnsupportedError` naming what.

**Generation on tokenmix's own KV cache**: :class:`Cache` (``tokenmix/_hf_cache.py``) is a
transformers ``Cache`` whose K/V live in :class:`tokenmix.KVCache` tiles (SPEC 4.8), in f32, bf16,
f16, int8 or fp8_e4m3 whatever the model's dtype::

    cache = tokenmix.transformers.Cache(model.config, "int8")   # max_cache_len=…: fixed size
    out = model.generate(ids, attention_mask=mask, cache=cache)  # (or past_key_values=cache)

The attention function reads the tiles in place: the prefill of an empty layer runs the forward
kernels on the fresh K/V (what a dynamic cache computes with) and appends each sequence's real
tokens once; every later call appends and runs :func:`tokenmix.attention_decode` (no per-step
copy of the cache, no repack, no ``torch.cat``). Sliding-window layers (``layer_types``) get
rolling caches of O(W) memory; left-padded batches store no pads (per-sequence lengths) and every
later mask is checked against that; ``crop`` (assisted decoding), ``reorder_cache`` (beam search),
``batch_repeat_interleave``, ``batch_select_indices`` and ``reset`` act on the KVCache
(``KVCache.truncate`` / ``copy_sequences``); ``memory_bytes()`` reports its memory. With an f32
cache the greedy tokens equal those of transformers' DynamicCache. Another attention
implementation with this cache, right padding, a float mask, a layer type other than full or
sliding attention (chunked, linear, shared-KV) or gradients through the cache raise
:class:`tokenmix.UnsupportedError`.

``generate(cache_implementation=...)`` cannot name it: transformers 5.x checks
``cache_implementation`` against a fixed tuple (``generation/configuration_utils.py``,
``ALL_CACHE_IMPLEMENTATIONS``) and builds the cache in a fixed chain of cases
(``GenerationMixin._prepare_cache_for_generation``: DynamicCache, StaticCache, or QuantizedCache
with the backends quanto / hqq / fp8); there is no registry to add to short of patching those
internals, which this package does not do. Pass the cache object instead.
"""

from typing import Any, Optional, Tuple

import torch

from . import _tokenmix as _C
from . import _torch_ops as _ops
from ._attention import attention_weights
from .torch import _check_dropout

from ._hf_cache import Cache

__all__ = ["register", "attention_forward", "mask_function", "NAME", "Cache"]

NAME = "tokenmix"
_FN = "tokenmix.transformers.attention_forward"


def _unsupported(msg: str) -> Exception:
    err = _C.UnsupportedError(f"{_FN}: {msg}")
    err.code = "unsupported"
    return err


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      dropout: float = 0.0, scaling: Optional[float] = None,
                      is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' attention-function signature: query ``[B, H_q, L, E]``, key/value
    ``[B, H_kv, S, E]``; returns ``([B, L, H_q, E] contiguous, None)``, or with
    ``output_attentions`` the weights ``[B, H_q, L, S]`` instead of None."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        # float32, bfloat16 or float16, one dtype (SPEC "Reduced precision"); out in that dtype
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise _unsupported(f"{name} has dtype {t.dtype}; tokenmix computes in float32, "
                               "bfloat16 or float16")
        if t.dtype != query.dtype:
            raise _unsupported(f"{name} has dtype {t.dtype} but query has {query.dtype}; query, "
                               "key and value must have one dtype")
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only")
    # Attention dropout (training: transformers passes the config's attention_dropout only
    # then): docs/design.md D.1–D.4, a seed per call from PyTorch's CPU generator.
    dropout = _check_dropout(_FN, dropout)
    # (Passed to the model's forward; transformers refuses config.output_attentions for any
    # implementation but eager.)
    want_weights = bool(kwargs.get("output_attentions"))
    if kwargs.get("position_bias") is not None:
        raise _unsupported("position_bias (a learned relative-position bias) is not supported")
    if value.shape[-1] != query.shape[-1]:
        raise _unsupported(f"value head width {value.shape[-1]} differs from the query's "
                           f"{query.shape[-1]}")
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    if sinks is not None and sinks.dtype in (torch.bfloat16, torch.float16):
        sinks = sinks.float()  # a bf16 model's sinks: widened exactly, the gradient flows back
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.dim() != 1):
        raise _unsupported(f"sinks must be a float32 [H_q] tensor; got {sinks.dtype} "
                           f"{tuple(sinks.shape)}")
    if softcap is not None:
        softcap = float(softcap)
    if scaling is not None:
        scaling = float(scaling)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)

    layer = getattr(key, "_tokenmix_layer", None)
    if layer is not None:  # K/V live in a tokenmix Cache (tokenmix/_hf_cache.py)
        if not is_causal:
            raise _unsupported("a non-causal layer with a tokenmix Cache")
        if dropout:
            raise _unsupported(f"attention dropout {dropout} with a tokenmix Cache (its decode "
                               "kernels serve inference); call model.eval() or set the config's "
                               "attention_dropout to 0.0 to generate")
        if want_weights:
            raise _unsupported("output_attentions=True with a tokenmix Cache: its keys live in "
                               "the cache's tiles; generate with the default DynamicCache to get "
                               "the attention weights")
        if (sliding_window or 0) != layer.window:
            raise _unsupported(f"layer {layer.index} attends with sliding_window="
                               f"{sliding_window} but the Cache was built with window "
                               f"{layer.window or None} for it (from the config's layer types)")
        return layer.owner.attend(
            layer, query, attention_mask, scaling, softcap, sinks,
            lambda k, v: _uncached(query, k, v, attention_mask, scaling, True, sliding_window,
                                   softcap, sinks)), None
    if key.dim() == 4 and key.numel() > 1 and all(st == 0 for st in key.stride()):
        raise _unsupported("key is a zero-stride tensor: the tag of a tokenmix Cache that the "
                           "model transformed between cache.update and the attention function; "
                           "this model cannot use a tokenmix Cache")
    if want_weights:
        return _uncached(query, key, value, attention_mask, scaling, bool(is_causal),
                         sliding_window, softcap, sinks, weights=True, dropout=dropout)
    return _uncached(query, key, value, attention_mask, scaling, bool(is_causal), sliding_window,
                     softcap, sinks, dropout=dropout), None


def _uncached(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: Optional[torch.Tensor], scaling: Optional[float], is_causal: bool,
              sliding_window: Optional[int], softcap: Optional[float],
              sinks: Optional[torch.Tensor], weights: bool = False, dropout: float = 0.0) -> Any:
    """Attention over the given K/V; returns [B, L, H_q, E] (contiguous), or with ``weights``
    the pair (that, the attention weights [B, H_q, L, S] in the query's dtype: with dropout,
    the dropped weights the values were averaged with, as eager attention returns them)."""
    seed = _ops.dropout_seed() if dropout else None
    if attention_mask is None:
        window = None
        if sliding_window is not None:
            if not is_causal:
                raise _unsupported("a bidirectional sliding window (non-causal layer with "
                                   "sliding_window) is not supported")
            window = int(sliding_window)
        args = (query, key, value, None, None, sinks, scaling, bool(is_causal), True, window,
                softcap, dropout, seed)
    else:
        mask = attention_mask
        S = key.shape[-2]
        if mask.dim() != 4:
            raise _unsupported(f"attention_mask of rank {mask.dim()}; expected the 4D "
                               "[B, 1, L, S] mask of transformers' mask interface")
        if mask.shape[-1] > S:  # a mask sized for a longer cache (as eager, keep the first S)
            mask = mask[..., :S]
        if mask.dtype == query.dtype and mask.dtype in (torch.bfloat16, torch.float16):
            mask = mask.float()  # an additive mask in the model's dtype: widened exactly
        if mask.dtype != torch.bool and mask.dtype != torch.float32:
            raise _unsupported(f"attention_mask of dtype {mask.dtype}; expected bool, float32 "
                               "or the query's dtype")
        # The mask carries causality, padding, window and cache length: no causal flag.
        args = (query, key, value, mask, None, sinks, scaling, False, True, None, softcap,
                dropout, seed)
    if not weights:
        # out is [B, H_q, L, E] laid out as [B, L, H_q, E]: the transpose is contiguous, no copy.
        return _ops.attention(*args).transpose(1, 2)
    out, lse = _ops.attention_lse(*args)
    return out.transpose(1, 2), _weights(args, lse).to(query.dtype)


def _weights(args: Tuple[Any, ...], lse: torch.Tensor) -> torch.Tensor:
    """The attention weights P = exp(S + M − L) [B, H_q, L, S] float32 of one attention call
    (SPEC 4.2–4.4; tokenmix.attention_weights) from its arguments (as for _ops.attention) and
    its log-sum-exp: eager attention's ``attn_weights`` (with sinks, the keys' columns only)."""
    query, key, _, mask, _, sinks, scaling, causal, bottom_right, window, softcap = args[:11]
    dropout = _ops.dropout_kwargs(*args[11:])  # the forward's mask: P̃ = P ⊙ Z / (1 − p)
    with torch.no_grad():
        return attention_weights(
            query, key, lse, layout="bhtd", scale=scaling, causal=causal,
            align="bottom_right" if bottom_right else "top_left", threads=torch.get_num_threads(),
            window=window, softcap=softcap, sinks=sinks, mask=mask, **dropout)


def _tracing(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not _ops.plain_eager(x)


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                  kv_offset: int = 0, mask_function: Any = None,
                  attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
                  allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False,
                  **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' mask-interface signature. Returns None when the plain causal mask,
    bottom-right aligned, is exact (the keys are the positions [kv_offset, kv_offset + kv_length)
    and the queries the last q_length of them, no padding, window not reached); otherwise
    transformers' boolean [B, 1, L, S] mask (sdpa_mask)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    if allow_is_causal_skip and _bottom_right_causal(q_length, kv_length, q_offset, kv_offset,
                                                      attention_mask, local_size):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=False,
                     allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs)


def _bottom_right_causal(q_length: int, kv_length: int, q_offset: Any, kv_offset: int,
                         attention_mask: Optional[torch.Tensor], local_size: Optional[int]) -> bool:
    if _tracing(q_offset) or _tracing(attention_mask):
        return False  # reading them would break the graph: build the mask
    if local_size is not None and kv_length >= local_size:
        return False
    if isinstance(q_offset, torch.Tensor):
        q_offset = int(q_offset)
    if q_offset + q_length != kv_offset + kv_length:
        return False  # e.g. a static cache: keys beyond the queries
    if attention_mask is not None:
        keys = attention_mask[:, kv_offset:kv_offset + kv_length]
        if keys.shape[-1] != kv_length or not bool(keys.all()):
            return False
    return True


def register() -> None:
    """Registers "tokenmix" with transformers' AttentionInterface and AttentionMaskInterface
    (idempotent). Then ``attn_implementation="tokenmix"`` works in ``from_pretrained``,
    ``from_config`` and ``set_attn_implementation``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError("tokenmix.transformers.register() needs Hugging Face transformers: "
                          "pip install 'tokenmix[transformers]'") from e
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
