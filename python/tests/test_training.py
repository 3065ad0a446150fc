"""Smoke test: a small two-layer causal transformer trained a few steps with tokenmix's SDPA
drop-in gives the same losses as with PyTorch's SDPA (no torch.compile)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tokenmix.torch as tmt


class Block(nn.Module):
    def __init__(self, d: int, H_q: int, H_kv: int, sdpa) -> None:
        super().__init__()
        self.H_q, self.H_kv, self.D = H_q, H_kv, d // H_q
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, (H_q + 2 * H_kv) * self.D, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.sdpa = sdpa

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.H_q * self.D, self.H_kv * self.D, self.H_kv * self.D], -1)
        # [B, T, H, D] projections seen as [B, H, T, D]: non-contiguous views, as in real models
        q = q.view(B, T, self.H_q, self.D).transpose(1, 2)
        k = k.view(B, T, self.H_kv, self.D).transpose(1, 2)
        v = v.view(B, T, self.H_kv, self.D).transpose(1, 2)
        y = self.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, sdpa, vocab=61, d=48, H_q=6, H_kv=2, T=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(T, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, H_q, H_kv, sdpa) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train(sdpa, steps=6):
    torch.manual_seed(0)
    model = TinyLM(sdpa)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 61, (4, 41), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_layer_model_trains_identically():
    ours = train(tmt.scaled_dot_product_attention)
    ref = train(F.scaled_dot_product_attention)
    assert ours[-1] < ours[0] - 0.1  # it learns
    # float32 both ways; rounding differs only inside attention. Bound: 1e-4 relative per step.
    for a, b in zip(ours, ref):
        assert abs(a - b) <= 1e-4 * abs(b), (ours, ref)
