"""Attention dropout (docs/design.md "Attention dropout", D.1–D.4) through the Python interfaces:
the NumPy API against a float64 NumPy computation with the same mask, the PyTorch drop-in against
PyTorch's own math with that mask (values and gradients), repeatability under torch.manual_seed,
torch.compile, and a transformers model in training mode against eager attention whose dropout
is given the same masks (logits and every parameter's gradient)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmix
import tokenmix._torch_ops as tops
import tokenmix.torch as tmt


def _softmax_rows(s):
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    return e / np.sum(e, axis=-1, keepdims=True)


def _reference(q, k, v, z, p, causal=True):
    """float64 O of [B, H, T, d] inputs (bhtd) with the keep mask z [B, H, T_q, T_k] (D.1)."""
    g = q.shape[1] // k.shape[1]
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        Tq, Tk = s.shape[-2:]
        vis = np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
        s = np.where(vis, s, -np.inf)
    a = _softmax_rows(s)
    return (a * z / (1.0 - p)) @ v


def test_mask_statistics_and_repeatability():
    z = tokenmix.attention_dropout_mask(2, 4, 64, 200, 0.25, 1234, 7)
    assert z.dtype == np.bool_ and z.shape == (2, 4, 64, 200)
    n = z.size
    kept = int(z.sum())
    assert abs(kept - 0.75 * n) <= 5 * np.sqrt(n * 0.25 * 0.75)
    assert np.array_equal(z, tokenmix.attention_dropout_mask(2, 4, 64, 200, 0.25, 1234, 7,
                                                             threads=1))
    other = tokenmix.attention_dropout_mask(2, 4, 64, 200, 0.25, 1235, 7)
    agree = float((z == other).mean())
    assert abs(agree - (0.75**2 + 0.25**2)) < 0.01  # independent seeds
    # Negative seeds (PyTorch's generators hand out signed values) are seeds like any other.
    neg = tokenmix.attention_dropout_mask(1, 2, 30, 40, 0.5, -1, 0)
    assert not np.array_equal(neg, tokenmix.attention_dropout_mask(1, 2, 30, 40, 0.5, 1, 0))


@pytest.mark.parametrize("isa", tokenmix.available_isas())
def test_numpy_forward_and_backward_match_float64_with_the_same_mask(isa):
    rng = np.random.default_rng(3)
    B, T, Hq, Hkv, d, p = 2, 70, 4, 2, 16, 0.3
    q = rng.standard_normal((B, T, Hq, d), dtype=np.float32)
    k = rng.standard_normal((B, T, Hkv, d), dtype=np.float32)
    v = rng.standard_normal((B, T, Hkv, d), dtype=np.float32)
    kw = dict(dropout_p=p, dropout_seed=99, dropout_offset=5, isa=isa)
    out, lse = tokenmix.attention_forward(q, k, v, return_lse=True, **kw)
    z = tokenmix.attention_dropout_mask(B, Hq, T, T, p, 99, 5)
    t = lambda x: np.swapaxes(x, 1, 2).astype(np.float64)  # noqa: E731
    ref = _reference(t(q), t(k), t(v), z, p)
    assert np.max(np.abs(np.swapaxes(out, 1, 2) - ref)) <= 2e-5 * np.max(np.abs(ref))
    plain = _reference(t(q), t(k), t(v), np.ones_like(z), 0.0)
    assert np.max(np.abs(np.swapaxes(out, 1, 2) - plain)) > 1e-2  # the mask was applied
    # The backward against PyTorch's autograd of the same float64 math.
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    dq, dk, dv = tokenmix.attention_backward(q, k, v, out, lse, dout, **kw)
    qt, kt, vt = (torch.tensor(t(x), requires_grad=True) for x in (q, k, v))
    g = Hq // Hkv
    s = qt @ kt.repeat_interleave(g, 1).transpose(-1, -2) / np.sqrt(d)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = (torch.softmax(s, -1) * torch.tensor(z) / (1 - p)) @ vt.repeat_interleave(g, 1)
    o.backward(torch.tensor(t(dout)))
    for got, want in ((dq, qt.grad), (dk, kt.grad), (dv, vt.grad)):
        want = want.transpose(1, 2).numpy()
        assert np.max(np.abs(got - want)) <= 1e-4 * max(np.max(np.abs(want)), 1.0)


def test_numpy_arguments_are_checked():
    q = np.ones((1, 4, 2, 8), np.float32)
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(tokenmix.ArgumentError, match="dropout.p"):
            tokenmix.attention_forward(q, q, q, dropout_p=p)
    with pytest.raises(tokenmix.ArgumentError, match="dropout_offset"):
        tokenmix.attention_forward(q, q, q, dropout_p=0.1, dropout_offset=-1)
    with pytest.raises(tokenmix.ArgumentError, match="2\\^32"):
        tokenmix.attention_forward(q, q, q, dropout_p=0.1, dropout_offset=2**32)
    with pytest.raises(tokenmix.ArgumentError, match="dropout_seed"):
        tokenmix.attention_forward(q, q, q, dropout_p=0.1, dropout_seed=2**64)


# ---- the PyTorch drop-in ----

def _torch_reference(q, k, v, z, p, causal):
    """PyTorch's math path in float64 with the keep mask z (D.1), differentiable."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) * z / (1 - p)) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_pytorch_math_with_the_same_mask(dtype):
    torch.manual_seed(0)
    B, Hq, Hkv, L, E, p = 2, 8, 2, 37, 24, 0.2
    q = torch.randn(B, Hq, L, E, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, L, E, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, L, E, dtype=dtype, requires_grad=True)
    torch.manual_seed(11)
    out = tmt.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
    torch.manual_seed(11)
    seed, offset = tops.dropout_seed().tolist()  # the draw the call made
    z = torch.from_numpy(tokenmix.attention_dropout_mask(B, Hq, L, L, p, seed,
                                                         offset & 0xFFFFFFFF))
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _torch_reference(*x64, z, p, True)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    for got, want in zip((q.grad, k.grad, v.grad), x64):
        assert (got.double() - want.grad).abs().max() <= 10 * tol * max(want.grad.abs().max(), 1)
    # Repeatable under torch.manual_seed; another seed drops other weights.
    torch.manual_seed(11)
    again = tmt.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                             enable_gqa=True)
    assert torch.equal(out, again)
    torch.manual_seed(12)
    other = tmt.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                             enable_gqa=True)
    assert not torch.equal(out, other)


def test_sdpa_dropout_arguments():
    q = torch.randn(1, 2, 4, 8)
    for p in (1.0, -0.5):
        with pytest.raises(tokenmix.ArgumentError, match="dropout_p must be in"):
            tmt.scaled_dot_product_attention(q, q, q, dropout_p=p)
    with pytest.raises(TypeError, match="dropout_p"):
        tmt.scaled_dot_product_attention(q, q, q, dropout_p="0.1")
    # p = 0 is the plain call, bit for bit.
    assert torch.equal(tmt.scaled_dot_product_attention(q, q, q, dropout_p=0.0),
                       tmt.scaled_dot_product_attention(q, q, q))


def test_varlen_dropout_draws_each_sequence_as_a_batch_row():
    torch.manual_seed(1)
    q, k, v = (torch.randn(3 * 20, 4, 16) for _ in range(3))
    cu = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    torch.manual_seed(5)
    out = tmt.varlen_attention(q, k, v, cu, cu, 20, 20, dropout_p=0.3)
    torch.manual_seed(5)
    seed, offset = tops.dropout_seed().tolist()
    b = lambda x: x.view(3, 20, 4, 16).transpose(1, 2)  # noqa: E731
    z = torch.from_numpy(tokenmix.attention_dropout_mask(3, 4, 20, 20, 0.3, seed,
                                                         offset & 0xFFFFFFFF))
    ref = _torch_reference(b(q).double(), b(k).double(), b(v).double(), z, 0.3, True)
    assert (b(out).double() - ref).abs().max() <= 2e-5 * ref.abs().max()


@pytest.mark.slow
def test_torch_compile_draws_a_mask_per_call_and_matches_eager_with_fallback_random():
    import torch._inductor.config as inductor_config

    def f(q, k, v):
        return tmt.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 16, requires_grad=True) for _ in range(3))
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(f, fullgraph=True)
        torch.manual_seed(3)
        got = compiled(q, k, v)
        got.sum().backward()
        torch.manual_seed(3)
        want = f(q, k, v)
        assert torch.allclose(got, want, atol=1e-6)
        second = compiled(q, k, v)  # the next call draws a new mask
        assert not torch.allclose(got, second)
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---- transformers, training mode ----

def _llama(attn):
    import transformers
    from transformers import AutoModelForCausalLM

    import tokenmix.transformers as tmx_hf

    tmx_hf.register()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   attention_dropout=0.2, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).float()


def test_transformers_training_step_matches_eager_given_the_same_masks(monkeypatch):
    pytest.importorskip("transformers")
    eager, ours = _llama("eager"), _llama("tokenmix")
    ours.load_state_dict(eager.state_dict())
    eager.train(), ours.train()
    ids = torch.randint(3, 97, (2, 23), generator=torch.Generator().manual_seed(1))

    seeds = []
    draw = tops.dropout_seed
    monkeypatch.setattr(tops, "dropout_seed", lambda: seeds.append(draw()) or seeds[-1])
    torch.manual_seed(7)
    loss = ours(ids, labels=ids).loss
    loss.backward()
    assert len(seeds) == 2  # one mask per layer call

    masks = iter(seeds)

    def dropout(x, p=0.5, training=True, inplace=False):
        seed, offset = next(masks).tolist()
        z = torch.from_numpy(tokenmix.attention_dropout_mask(*x.shape, p, seed,
                                                             offset & 0xFFFFFFFF))
        return x * z / (1 - p)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    ref = eager(ids, labels=ids).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for (name, a), b in zip(ours.named_parameters(), eager.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-4 * max(b.grad.abs().max(), 1e-3), name
    # output_attentions in training: the dropped weights the values were averaged with, as
    # eager returns them (the same masks again).
    seeds.clear()
    torch.manual_seed(8)
    with torch.no_grad():
        got = ours(ids, output_attentions=True).attentions
    masks = iter(list(seeds))
    with torch.no_grad():
        want = eager(ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        assert (b == 0).any()  # some weights were dropped
    # Eval mode: no dropout (transformers passes 0.0), the plain attention.
    ours.eval(), eager.eval()
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, eager(ids).logits, atol=1e-5)


def test_transformers_dropout_with_a_tokenmix_cache_is_refused():
    pytest.importorskip("transformers")
    import tokenmix.transformers as tmx_hf

    model = _llama("tokenmix").train()
    ids = torch.randint(3, 97, (1, 5))
    cache = tmx_hf.Cache(model.config, "f32")
    with torch.no_grad(), pytest.raises(tokenmix.UnsupportedError, match="dropout.*Cache"):
        model(ids, cache=cache, use_cache=True)
