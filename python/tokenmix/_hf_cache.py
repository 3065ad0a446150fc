"""A Hugging Face transformers ``Cache`` backed by :class:`tokenmix.KVCache` (SPEC 4.8).

Exposed as :class:`tokenmix.transformers.Cache`; see that module for the user-facing summary.

How it works. transformers' attention layers call ``cache.update(k, v, layer_idx)`` and hand what
it returns to the attention function. This cache's ``update`` keeps the new K/V aside and returns
a *tag*: a zero-stride view shaped like the keys a dynamic cache would return (so the masks
transformers builds have the usual sizes), filled with NaN and carrying the layer's bookkeeping.
``tokenmix.transformers.attention_forward`` recognises the tag and runs, for that layer:

* prefill (the layer holds nothing yet): attention over the new K/V exactly as without a cache
  (the same call the dynamic cache gets), then one append of each sequence's real tokens;
* otherwise: append, then :func:`tokenmix.attention_decode` on the cache's tiles (bottom-right
  causal, SPEC 4.3; the layer's window, soft-cap and sinks) — no copy of the cached K/V, no
  repack, no ``torch.cat``.

Padding. Pad tokens are not stored: sequence b keeps its real tokens only, so a decode query sees
exactly the keys the dynamic cache's mask leaves visible. transformers counts positions with the
pads (``get_seq_length`` is the padded length, as for its own caches); the pad count of each
sequence is read off the prefill's mask (left padding only: a real token sees itself, a pad
nothing). Every later mask is checked against the one this cache implies (pads, causality,
window) and a mismatch raises :class:`tokenmix.UnsupportedError`: nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import _tokenmix as _C

_DTYPES = ("f32", "bf16", "f16", "int8", "fp8_e4m3")
_FN = "tokenmix.transformers.Cache"
_BIG = 1 << 40  # a rolling cache's capacity bounds the total length only (storage is O(W))


def _unsupported(msg: str) -> Exception:
    err = _C.UnsupportedError(f"{_FN}: {msg}")
    err.code = "unsupported"
    return err


def _argument(msg: str) -> Exception:
    err = _C.ArgumentError(f"{_FN}: {msg}")
    err.code = "invalid_argument"
    return err


try:  # transformers is optional (pip install 'tokenmix[transformers]')
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin as _HFLayer
    from transformers.cache_utils import get_layer_types_and_kwargs as _layer_types
except ImportError:  # pragma: no cover - the extra is installed in CI
    _HFCache = _HFLayer = _layer_types = None


if _HFCache is None:  # pragma: no cover

    class Cache:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("tokenmix.transformers.Cache needs Hugging Face transformers: "
                              "pip install 'tokenmix[transformers]'")

else:

    class _Layer(_HFLayer):
        """One model layer's view of its group's KVCache: bookkeeping only, no tensors."""

        is_compileable = False
        is_croppable = True

        def __init__(self, owner: "Cache", index: int, window: int, heads_kv: int,
                     head_dim: int) -> None:
            super().__init__()
            self.owner, self.index, self.window = owner, index, window
            self.heads_kv, self.head_dim = heads_kv, head_dim
            self.is_sliding = window > 0
            self.sliding_window = window if window > 0 else None
            self.local = 0  # layer index inside its group's KVCache
            self.seen = 0  # positions transformers has given this layer, pads included
            self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

        def __repr__(self) -> str:
            kind = f"sliding window {self.window}" if self.window else "full"
            return f"tokenmix.transformers.Cache layer {self.index} ({kind}, {self.seen} seen)"

        def lazy_initialization(self, key_states: torch.Tensor,
                                value_states: torch.Tensor) -> None:
            self.owner._initialize(key_states)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
            return self.owner.update(key_states, value_states, self.index)

        def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
            """(kv_length, kv_offset) as transformers' dynamic layers give them: all positions
            for a full layer, the last W − 1 plus the new ones for a sliding layer."""
            if self.window:
                return min(self.seen, self.window - 1) + query_length, \
                    max(self.seen - self.window + 1, 0)
            return self.seen + query_length, 0

        def get_seq_length(self) -> int:
            return self.seen

        def get_max_length(self) -> int:
            return self.window if self.window else (self.owner.max_cache_len or -1)

        # Batch-wide operations act on the group's KVCache: the owner does them once per group.
        def reset(self) -> None:
            self.seen, self.pending = 0, None

        def crop(self, tokens_to_remove: int) -> None:
            raise _unsupported("crop a tokenmix Cache as a whole (Cache.crop), not one layer")

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            raise _unsupported("reorder a tokenmix Cache as a whole (Cache.reorder_cache)")

    class Cache(_HFCache):  # type: ignore[no-redef]
        """A transformers ``Cache`` whose K/V live in :class:`tokenmix.KVCache` tiles.

        Args:
            config: the model's config (``model.config``); its layer types choose full or
                rolling (sliding-window) storage per layer.
            dtype: element type of the stored K/V: ``"f32"``, ``"bf16"``, ``"f16"``, ``"int8"``
                or ``"fp8_e4m3"`` (SPEC "Reduced precision"); independent of the model's dtype.
            max_cache_len: most positions (pads included) a sequence may reach. Given: one
                contiguous block per sequence, allocated once (like ``StaticCache``). None: a
                paged cache that grows (doubling) as sequences lengthen.
            block_tokens: block size of the paged (growing) cache, a multiple of 64.
            threads: threads of the decode kernel (0 = all).

        The batch size and the device are taken from the first ``update``. Use with
        ``attn_implementation="tokenmix"`` (any other raises ``UnsupportedError`` on the first
        ``update``): ``model.generate(ids, past_key_values=Cache(model.config, "int8"))``.
        """

        def __init__(self, config: Any, dtype: str = "f32", *,
                     max_cache_len: Optional[int] = None, block_tokens: int = 256,
                     threads: int = 0) -> None:
            if dtype not in _DTYPES:
                raise _argument(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
            if max_cache_len is not None and int(max_cache_len) < 1:
                raise _argument(f"max_cache_len must be >= 1 or None; got {max_cache_len}")
            if int(block_tokens) < 64 or int(block_tokens) % 64:
                raise _argument(f"block_tokens must be a positive multiple of 64; got "
                                f"{block_tokens}")
            text = config.get_text_config(decoder=True)
            types, kwargs = _layer_types(text)
            heads = text.num_attention_heads
            heads_kv = getattr(text, "num_key_value_heads", None) or heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
            layers: List[_Layer] = []
            for i, (kind, kw) in enumerate(zip(types, kwargs)):
                if kind == "full_attention":
                    window = 0
                elif kind == "sliding_attention" and kw.get("sliding_window"):
                    window = int(kw["sliding_window"])
                else:
                    raise _unsupported(
                        f"layer {i} has type {kind!r}; a tokenmix Cache holds full_attention and "
                        "sliding_attention layers only (use transformers' DynamicCache)")
                layers.append(_Layer(self, i, window, heads_kv, head_dim))
            super().__init__(layers=layers)
            self.config = config
            self.dtype = dtype
            self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
            self.block_tokens = int(block_tokens)
            self.threads = int(threads)
            # One KVCache per window (0 = the full layers): layers of a group share its storage.
            self.groups: Dict[int, List[int]] = {}
            for layer in layers:
                members = self.groups.setdefault(layer.window, [])
                layer.local = len(members)
                members.append(layer.index)
            self.caches: Dict[int, Any] = {}  # window -> _C.KVCache, made on the first update
            self.pads: Optional[List[int]] = None  # pad tokens of each sequence (left padding)
            self._pads_tensor: Optional[torch.Tensor] = None
            self._mask_ok: Optional[Tuple[torch.Tensor, int, int]] = None
            self.batch = 0

        @classmethod
        def from_dynamic(cls, dynamic: Any, config: Any, dtype: str = "f32",
                         **kwargs: Any) -> "Cache":
            """A tokenmix Cache holding what a transformers DynamicCache holds (unpadded
            sequences: a dynamic cache does not record padding), in `dtype`."""
            cache = cls(config, dtype, **kwargs)
            with torch.no_grad():
                for i, src in enumerate(dynamic.layers):
                    layer = cache.layers[i]
                    k, v = src.keys, src.values
                    if k is None or k.numel() == 0:
                        continue
                    if not cache.caches:
                        cache._initialize(k)
                    seen = int(src.get_seq_length())
                    if k.shape[2] < seen:  # a sliding layer keeps its last W − 1 positions
                        zeros = k.new_zeros(k.shape[0], k.shape[1], seen - k.shape[2],
                                            k.shape[3])
                        k, v = torch.cat([zeros, k], 2), torch.cat([zeros, v], 2)
                    cache.pads = [0] * cache.batch
                    cache._pads_tensor = torch.zeros(cache.batch, dtype=torch.long)
                    cache._append(layer, k, v, None)
                    layer.seen = seen
            return cache

        # ---- transformers' Cache interface ----

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
            impl = getattr(self.config, "_attn_implementation", None)
            if impl != "tokenmix":
                raise _unsupported(
                    f"the model runs attn_implementation={impl!r}; a tokenmix Cache serves "
                    "attn_implementation='tokenmix' only (its K/V live in tokenmix's tiles, "
                    "which other attention functions cannot read): use transformers' "
                    "DynamicCache with that implementation")
            if torch.is_grad_enabled() and (key_states.requires_grad or
                                            value_states.requires_grad):
                raise _unsupported("a tokenmix Cache is for inference: run generation under "
                                   "torch.no_grad() (no gradient flows through cached K/V)")
            layer = self.layers[layer_idx]
            if not self.caches or (self.batch != key_states.shape[0] and self._empty()):
                self._initialize(key_states)
            B, H, T, D = key_states.shape
            if B != self.batch or H != layer.heads_kv or D != layer.head_dim:
                raise _argument(f"layer {layer_idx}: key_states has shape {tuple(key_states.shape)}"
                                f"; this cache holds [batch={self.batch}, heads_kv="
                                f"{layer.heads_kv}, T, head_dim={layer.head_dim}]")
            if key_states.device.type != "cpu":
                raise _unsupported(f"key_states are on device '{key_states.device}'; tokenmix "
                                   "runs on the CPU only")
            layer.pending = (key_states, value_states)
            kv_length = layer.get_mask_sizes(T)[0]
            # The tag: shaped like the keys a dynamic cache returns, no storage, NaN if misused.
            tag_k = torch.full((), float("nan"), dtype=key_states.dtype).expand(B, H, kv_length, D)
            tag_v = torch.full((), float("nan"), dtype=value_states.dtype).expand(
                B, H, kv_length, value_states.shape[-1])
            tag_k._tokenmix_layer = layer  # type: ignore[attr-defined]
            return tag_k, tag_v

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.layers[layer_idx].seen if layer_idx < len(self.layers) else 0

        def reset(self) -> None:
            for c in self.caches.values():
                c.reset()
            for layer in self.layers:
                layer.reset()
            self.pads, self._pads_tensor, self._mask_ok = None, None, None

        def crop(self, tokens_to_remove: int) -> None:
            """Drops the last ``-tokens_to_remove`` positions of every layer (assisted decoding);
            ``tokens_to_remove`` ≤ 0 as for transformers' dynamic layers. A sliding layer can go
            back by up to 64 positions past its window (its ring's slack)."""
            if tokens_to_remove > 0:
                raise _argument(f"crop(tokens_to_remove={tokens_to_remove}): pass a negative "
                                "count of positions to remove (as transformers' dynamic cache)")
            k = -int(tokens_to_remove)
            if k == 0 or not self.caches:
                return
            seen = {layer.seen for layer in self.layers}
            if len(seen) != 1:
                raise _unsupported(f"crop in the middle of a forward (layers have seen {seen})")
            new_seen = seen.pop() - k
            pads = self.pads or [0] * self.batch
            if new_seen < max(pads):
                raise _argument(f"crop(tokens_to_remove={tokens_to_remove}) would remove "
                                "prompt tokens of a padded sequence back into its padding")
            for window, c in self.caches.items():  # check everything, then truncate
                for b in range(self.batch):
                    new_len = new_seen - pads[b]
                    for layer in range(c.layers):
                        first = c.first_position(b, layer)
                        if new_len and new_len < first:
                            raise _argument(
                                f"crop(tokens_to_remove={tokens_to_remove}): a sliding layer "
                                f"(window {window}) keeps positions from {first} on; it cannot "
                                f"go back to {new_len}")
            for c in self.caches.values():
                for b in range(self.batch):
                    c.truncate(b, new_seen - pads[b])
            for layer in self.layers:
                layer.seen = new_seen
            self._mask_ok = None

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: sequence b becomes a copy of sequence beam_idx[b]."""
            idx = [int(i) for i in beam_idx.tolist()]
            for c in self.caches.values():
                c.copy_sequences(c, idx)
            self._select_pads(idx)

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._rebatch([b for b in range(self.batch) for _ in range(int(repeats))])

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._rebatch([int(i) for i in torch.as_tensor(indices).tolist()])

        @property
        def is_compileable(self) -> bool:
            return False

        # ---- memory ----

        def memory_bytes(self) -> int:
            """All memory the cache holds (storage, block tables, bookkeeping)."""
            return sum(int(c.memory_bytes) for c in self.caches.values())

        def storage_bytes(self) -> int:
            """K/V storage (SPEC 4.8's figure for the allocated positions)."""
            return sum(int(c.storage_bytes) for c in self.caches.values())

        # ---- internals ----

        def _empty(self) -> bool:
            return all(layer.seen == 0 for layer in self.layers)

        def _spec(self, window: int, batch: int, tokens: int) -> Dict[str, Any]:
            layer = self.layers[self.groups[window][0]]
            spec = dict(layers=len(self.groups[window]), batch=batch, heads_kv=layer.heads_kv,
                        head_dim=layer.head_dim, dtype=self.dtype)
            if window:
                spec.update(capacity=self.max_cache_len or _BIG, window=window)
            elif self.max_cache_len is not None:
                spec.update(capacity=self.max_cache_len)
            else:  # paged, grown by _reserve
                bt = self.block_tokens
                capacity = -(-tokens // bt) * bt + bt  # the prompt and a block; then doubling
                spec.update(capacity=capacity, block_tokens=bt,
                            pool_blocks=batch * (capacity // bt))
            return spec

        def _initialize(self, key_states: torch.Tensor) -> None:
            self.batch = int(key_states.shape[0])
            tokens = int(key_states.shape[2]) + 1
            self.caches = {w: _C.KVCache(**self._spec(w, self.batch, tokens))
                           for w in self.groups}
            for layer in self.layers:
                layer.is_initialized = True
                layer.seen, layer.pending = 0, None
            self.pads, self._pads_tensor, self._mask_ok = None, None, None

        def _select_pads(self, idx: Sequence[int]) -> None:
            if self.pads is not None:
                self.pads = [self.pads[i] for i in idx]
                self._pads_tensor = torch.tensor(self.pads, dtype=torch.long)
            self._mask_ok = None

        def _rebatch(self, idx: List[int]) -> None:
            if not self.caches:
                return
            new = {}
            for window, old in self.caches.items():
                lengths = [max(old.length(b, l) for l in range(old.layers))
                           for b in range(self.batch)]
                spec = self._spec(window, len(idx), max(lengths, default=0) + 1)
                if "pool_blocks" in spec:
                    spec["capacity"] = max(spec["capacity"], old.capacity)
                    bt = self.block_tokens
                    spec["pool_blocks"] = max(spec["pool_blocks"],
                                              sum(-(-lengths[i] // bt) for i in idx))
                c = _C.KVCache(**spec)
                c.copy_sequences(old, idx)
                new[window] = c
            self.caches = new
            self.batch = len(idx)
            self._select_pads(idx)

        def _reserve(self, window: int, end: List[int]) -> None:
            """Paged (growing) full layers: capacity and pool for sequence lengths `end`."""
            c = self.caches[window]
            if window or self.max_cache_len is not None:
                return
            bt = self.block_tokens
            need_cap = max(end)
            need_pool = sum(-(-e // bt) for e in end)
            if need_cap <= c.capacity and need_pool <= c.pool_blocks:
                return
            spec = self._spec(window, self.batch, 1)
            spec["capacity"] = max(c.capacity, -(-max(need_cap, 2 * c.capacity) // bt) * bt)
            spec["pool_blocks"] = max(need_pool, 2 * c.pool_blocks)
            grown = _C.KVCache(**spec)
            grown.copy_sequences(c, list(range(self.batch)))
            self.caches[window] = grown

        def _append(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor,
                    pads: Optional[List[int]]) -> None:
            """k, v [B, H_kv, T, d_h] → the cache (sequence b from its pads[b]-th token)."""
            T = k.shape[2]
            pad = pads or [0] * self.batch
            base = self.pads or [0] * self.batch
            self._reserve(layer.window, [layer.seen + T - base[b] for b in range(self.batch)])
            c = self.caches[layer.window]
            kb, vb = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, H_kv, d_h] views
            if kb.dtype != torch.float32:
                kb, vb = kb.float(), vb.float()
            if not any(pad):
                c.append(layer.local, kb, vb, 0)
                return
            for b in range(self.batch):
                if T - pad[b] > 0:
                    c.append(layer.local, kb[b:b + 1, pad[b]:], vb[b:b + 1, pad[b]:], b)

        def _pads_of(self, mask: Optional[torch.Tensor], T: int) -> List[int]:
            """Pad tokens per sequence from a prefill mask [B, 1, T, T]: token t is real iff it
            sees itself; the real tokens must be a suffix (left padding)."""
            if mask is None:
                return [0] * self.batch
            real = torch.diagonal(mask.expand(self.batch, 1, T, T)[:, 0], dim1=-2, dim2=-1)
            if T > 1 and bool((real[:, 1:].int() < real[:, :-1].int()).any()):
                raise _unsupported(
                    "the prompt's attention_mask has padding after real tokens (right padding "
                    "or holes); a tokenmix Cache stores each sequence's tokens without its pads "
                    "and needs left padding (tokenizer.padding_side = 'left')")
            return (~real).sum(dim=1).tolist()

        def _check_mask(self, layer: _Layer, mask: Optional[torch.Tensor], T: int) -> None:
            """A mask given to a cached (non-prefill) call must be the one this cache implies:
            key u visible to query t iff u is a real token, u ≤ t (bottom-right, SPEC 4.3) and,
            on a sliding layer, t − W < u (positions with the pads, as transformers counts)."""
            if mask is None:
                return
            if mask.dtype != torch.bool:
                raise _unsupported(f"attention_mask of dtype {mask.dtype} with a tokenmix Cache; "
                                   "only transformers' boolean masks (padding, causal, window) "
                                   "are supported")
            memo = self._mask_ok
            if memo is not None and memo[0] is mask and memo[1] == layer.window \
                    and memo[2] == layer.seen:
                return
            kv_length, kv_offset = layer.get_mask_sizes(T)
            if mask.dim() != 4 or mask.shape[-2] != T or mask.shape[-1] != kv_length:
                raise _unsupported(f"attention_mask of shape {tuple(mask.shape)}; expected "
                                   f"[B, 1, {T}, {kv_length}] from transformers' mask interface")
            kp = torch.arange(kv_length) + kv_offset
            qp = (torch.arange(T) + layer.seen)[:, None]
            pads = self._pads_tensor if self._pads_tensor is not None else \
                torch.zeros(self.batch, dtype=torch.long)
            want = (kp >= pads[:, None, None]) & (kp <= qp)
            if layer.window:
                want &= kp > qp - layer.window
            if not torch.equal(mask.expand(self.batch, 1, T, kv_length)[:, 0], want):
                raise _unsupported(
                    "the attention_mask differs from what this cache holds (each sequence's "
                    "real tokens, causal, the layer's window): padding after the prompt, a "
                    "custom mask or a mask for other positions is not supported with a tokenmix "
                    "Cache")
            self._mask_ok = (mask, layer.window, layer.seen)

        def attend(self, layer: _Layer, query: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   scaling: Optional[float], softcap: Optional[float],
                   sinks: Optional[torch.Tensor], uncached: Any) -> torch.Tensor:
            """The attention of one layer's call; returns [B, L, H_q, E] (contiguous)."""
            if layer.pending is None:
                raise _unsupported(f"layer {layer.index}: attention without a preceding "
                                   "cache.update (tokenmix Cache tags are single-use)")
            k, v = layer.pending
            layer.pending = None
            T = query.shape[2]
            if attention_mask is not None and attention_mask.dtype != torch.bool:
                raise _unsupported(f"attention_mask of dtype {attention_mask.dtype} with a "
                                   "tokenmix Cache; only transformers' boolean masks (padding, "
                                   "causal, window) are supported")
            if layer.seen == 0:
                # Prefill: the new K/V as they are (what a dynamic cache computes with), then the
                # real tokens of each sequence into the cache.
                out = uncached(k, v)
                pads = self._pads_of(attention_mask, T)
                if self.pads is None:
                    self.pads = pads
                    self._pads_tensor = torch.tensor(pads, dtype=torch.long)
                elif pads != self.pads:
                    raise _unsupported(f"layer {layer.index}: the prefill mask pads the "
                                       f"sequences {pads}, an earlier layer's {self.pads}")
                self._append(layer, k, v, pads)
                layer.seen = T
                return out
            self._check_mask(layer, attention_mask, T)
            B, Hq, _, E = query.shape
            out = torch.empty(B, T, Hq, E, dtype=query.dtype)
            qb = query.transpose(1, 2)  # [B, T, H_q, E] view (the projection's own layout)
            window = layer.window or None
            sinks = None if sinks is None else sinks.detach()
            # A rolling cache serves up to R − W + 1 new queries per decode call: longer
            # chunks (chunked prefill on a sliding layer) go in pieces.
            step = T
            if layer.window:
                step = max(1, self.caches[layer.window].retained_positions - layer.window + 1)
            for t0 in range(0, T, step):
                t1 = min(T, t0 + step)
                self._append(layer, k[:, :, t0:t1], v[:, :, t0:t1], None)
                _C.attention_decode(qb[:, t0:t1], self.caches[layer.window], layer.local,
                                    out[:, t0:t1], None, scaling, self.threads, "auto", 0,
                                    window=window, softcap=softcap, alibi_slopes=None,
                                    sinks=sinks)
                layer.seen += t1 - t0
            return out
