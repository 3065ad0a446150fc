"""``python -m tokenmix.bench --model`` and ``--overhead``: tokenmix inside a whole model, and the
cost of one small attention call.

``--model`` builds a randomly initialised Llama-shaped model with Hugging Face transformers
(default 4 layers, hidden 2048, 16 query / 4 key-value heads, float32; nothing is downloaded)
and times, in one process and on the same weights, ``attn_implementation="sdpa"`` (PyTorch)
against ``"tokenmix"`` (tokenmix.transformers):

* forward (``no_grad``) and forward+backward of the decoder stack (``model.model``: the layers
  without the vocabulary projection, whose cost does not depend on the attention) at each
  ``--seq`` T (default 4096 and 8192);
* greedy generation after a ``--gen-context``-token prompt (default 16384) on a dynamic cache,
  step by step as ``generate()`` does it: the prefill, and the time per decode step over
  ``--gen-tokens`` tokens (T_q = 1 calls on a growing cache).

Each case: a warm-up, then ``--repeats`` rounds alternating the order of the two sides; the
medians and their ratio (sdpa / tokenmix: > 1 means tokenmix is faster) are printed.

``--overhead`` times tiny calls with ``timeit`` (what generation does thousands of times per
second): the drop-in vs ``F.scaled_dot_product_attention`` for a [1, 4, 8, 64] causal call with
autograd (forward + backward) and under ``no_grad``, and one-query decode-shaped calls
(T_q = 1, T_k = 128 and 1024, GQA 8/2 heads), each side's best of ``--repeats`` batches.
"""

import argparse
import copy
import os
import statistics
import sys
import time
import timeit
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import tokenmix
from tokenmix.torch import scaled_dot_product_attention as tm_sdpa


def _median_pair(calls: Dict[str, Callable[[], None]], repeats: int) -> Dict[str, float]:
    for call in calls.values():  # warm-up
        call()
    times: Dict[str, List[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _models(args: argparse.Namespace):
    import transformers

    import tokenmix.transformers as tmx_hf

    tmx_hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(max(args.seq), args.gen_context + args.gen_tokens) + 8)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="sdpa")
    sdpa = sdpa.float().eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="tokenmix")
    ours = ours.float().eval()
    ours.load_state_dict(sdpa.state_dict())
    return cfg, {"sdpa": sdpa, "tokenmix": ours}


def _print_row(what: str, med: Dict[str, float], unit: str = "ms", scale: float = 1e3) -> None:
    print(f"{what:34s} sdpa {med['sdpa'] * scale:10.2f} {unit}  tokenmix "
          f"{med['tokenmix'] * scale:10.2f} {unit}  ratio sdpa/tokenmix "
          f"{med['sdpa'] / med['tokenmix']:.2f}x")
    sys.stdout.flush()


def _generate(model, prompt: torch.Tensor, n: int):
    """Greedy generation on a dynamic cache, as generate() does it without its bookkeeping:
    (prefill seconds, seconds for the n one-token decode steps, the n tokens)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        logits = model(prompt, cache=cache, use_cache=True, logits_to_keep=1).logits
        prefill = time.perf_counter() - start
        tok = logits[:, -1:].argmax(-1)
        out = [tok]
        start = time.perf_counter()
        for _ in range(n):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(tok)
        decode = time.perf_counter() - start
    return prefill, decode, torch.cat(out, 1)


def run_model(args: argparse.Namespace) -> int:
    cfg, models = _models(args)
    print(f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, heads "
          f"{args.heads}/{args.kv_heads} (head dim {args.hidden // args.heads}), intermediate "
          f"{args.intermediate}, vocab {args.vocab}, float32, random weights")
    print(f"threads: {torch.get_num_threads()}; median of {args.repeats} rounds; tokenmix kernel "
          f"path {tokenmix.resolve_isa()}")
    gen = torch.Generator().manual_seed(7)
    for T in args.seq:
        ids = torch.randint(0, args.vocab, (1, T), generator=gen)
        grad = torch.randn(1, T, args.hidden, generator=gen)

        def fwd(m):
            def call() -> None:
                with torch.no_grad():
                    m.model(ids)
            return call

        def fwd_bwd(m):
            def call() -> None:
                m.zero_grad(set_to_none=True)
                m.model(ids).last_hidden_state.backward(grad)
            return call

        with torch.no_grad():
            a = models["sdpa"].model(ids).last_hidden_state
            b = models["tokenmix"].model(ids).last_hidden_state
        err = ((a - b).abs().max() / a.abs().max()).item()
        _print_row(f"T={T} forward", _median_pair({n: fwd(m) for n, m in models.items()},
                                                  args.repeats))
        _print_row(f"T={T} forward+backward", _median_pair(
            {n: fwd_bwd(m) for n, m in models.items()}, args.repeats))
        print(f"{'':34s} max relative difference of the hidden states: {err:.1e}")

    if args.gen_context > 0:
        prompt = torch.randint(0, args.vocab, (1, args.gen_context), generator=gen)
        times = {name: ([], []) for name in models}
        tokens: Dict[str, torch.Tensor] = {}
        names = list(models)
        for r in range(args.repeats + 1):  # round 0 is the warm-up
            for name in (names if r % 2 == 0 else names[::-1]):
                pre, dec, tokens[name] = _generate(models[name], prompt, args.gen_tokens)
                if r > 0:
                    times[name][0].append(pre)
                    times[name][1].append(dec / args.gen_tokens)
        _print_row(f"prefill {args.gen_context} tokens",
                   {n: statistics.median(t[0]) for n, t in times.items()})
        _print_row(f"decode at {args.gen_context} (per token)",
                   {n: statistics.median(t[1]) for n, t in times.items()})
        same = torch.equal(tokens["sdpa"], tokens["tokenmix"])
        print(f"{'':34s} greedy tokens identical: {same}")
    return 0


def _timeit(fn: Callable[[], object], repeats: int) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeats, number=number)) / number


def run_overhead(args: argparse.Namespace) -> int:
    print(f"per-call time, best of {args.repeats} timeit batches; threads "
          f"{torch.get_num_threads()}; tokenmix kernel path {tokenmix.resolve_isa()}")
    g = torch.Generator().manual_seed(3)
    cases = []
    q = torch.randn(1, 4, 8, 64, generator=g)
    k = torch.randn(1, 4, 8, 64, generator=g)
    v = torch.randn(1, 4, 8, 64, generator=g)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def autograd(fn):
        def call():
            fn(qg, kg, vg, is_causal=True).sum().backward()
        return call

    def no_grad(fn, *t, **kw):
        def call():
            with torch.no_grad():
                fn(*t, **kw)
        return call

    cases.append(("[1,4,8,64] causal, fwd+bwd", autograd(F.scaled_dot_product_attention),
                  autograd(tm_sdpa)))
    cases.append(("[1,4,8,64] causal, no_grad", no_grad(F.scaled_dot_product_attention, q, k, v,
                                                        is_causal=True),
                  no_grad(tm_sdpa, q, k, v, is_causal=True)))
    for T_k in (128, 1024):
        dq = torch.randn(1, 8, 1, 64, generator=g)
        dk = torch.randn(1, 2, T_k, 64, generator=g)
        dv = torch.randn(1, 2, T_k, 64, generator=g)
        cases.append((f"decode T_q=1 T_k={T_k} (8/2 heads)",
                      no_grad(F.scaled_dot_product_attention, dq, dk, dv, enable_gqa=True),
                      no_grad(tm_sdpa, dq, dk, dv, enable_gqa=True)))
    for name, ref, ours in cases:
        t_ref, t_ours = _timeit(ref, args.repeats), _timeit(ours, args.repeats)
        print(f"{name:36s} torch {t_ref * 1e6:8.1f} us  tokenmix {t_ours * 1e6:8.1f} us  "
              f"difference {(t_ours - t_ref) * 1e6:+8.1f} us")
        sys.stdout.flush()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenmix.bench --model | --overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="store_true", help="time a whole model (transformers)")
    p.add_argument("--overhead", action="store_true", help="time tiny per-call shapes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192],
                   help="sequence lengths of the forward and forward+backward cases")
    p.add_argument("--gen-context", type=int, default=16384,
                   help="prompt length before greedy generation (0: no generation case)")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens generated after it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.model == args.overhead:
        p.error("pass exactly one of --model and --overhead")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "repeats",
                 "gen_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    if args.gen_context < 0 or any(T < 1 for T in args.seq):
        p.error("--seq must be >= 1 and --gen-context >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"load average before: {'%.2f %.2f %.2f' % os.getloadavg()}")
    rc = run_model(args) if args.model else run_overhead(args)
    print(f"load average after: {'%.2f %.2f %.2f' % os.getloadavg()}")
    return rc
