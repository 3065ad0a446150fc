"""``python -m tokenmix.bench --model`` and ``--overhead``: tokenmix inside a whole model, and the
cost of one small attention call.

``--model`` builds a randomly initialised Llama-shaped model with Hugging Face transformers
(default 4 layers, hidden 2048, 16 query / 4 key-value heads; nothing is downloaded) in each
``--model-dtype`` (default float32 and bfloat16, the dtype models run in) and times, in one
process and on the same weights:

* forward (``no_grad``) and forward+backward of the decoder stack (``model.model``: the layers
  without the vocabulary projection, whose cost does not depend on the attention) at each
  ``--seq`` T (default 4096 and 8192), ``attn_implementation="sdpa"`` (PyTorch) against
  ``"tokenmix"`` (tokenmix.transformers): medians and their ratio (sdpa / tokenmix: > 1 means
  tokenmix is faster); then each side's attention inside the model: its time less that of the
  same model whose attention returns its query unchanged (the "null" side, timed in the same
  rounds: the projections, MLP, norms and RoPE without the attention itself, forward and
  backward alike), that time's share of the side's, and the ratio of the two attention times;
* greedy generation after each ``--gen-context``-token prompt (default 8192 and 16384): the
  time per decode step (T_q = 1 on the cache, as ``generate()`` does it) of transformers'
  DynamicCache with sdpa and with tokenmix attention, and of tokenmix.transformers.Cache (K/V in
  tokenmix's tiles, read in place by the decode kernel) in each ``--cache-dtypes`` (default f32,
  bf16, int8); with each side's speed-up over both dynamic sides, cache memory (and its ratio to
  the dynamic cache's), the share of decode time spent in attention + cache update
  (torch.profiler over ``--profile-tokens`` steps) and whether its greedy tokens equal sdpa's.
  The prompt is prefilled once; every side starts from a copy of that state.

Each case: a warm-up, then ``--repeats`` rounds alternating the order of the sides.

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


_TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _models(args: argparse.Namespace, dtype: str = "f32"):
    import transformers

    import tokenmix.transformers as tmx_hf

    tmx_hf.register()
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(max(args.seq, default=0), max(args.gen_context, default=0)
                                    + args.gen_tokens) + 8)
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="sdpa")
    sdpa = sdpa.to(_TORCH_DTYPES[dtype]).eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="tokenmix")
    ours = ours.to(_TORCH_DTYPES[dtype]).eval()
    ours.load_state_dict(sdpa.state_dict())
    return cfg, {"sdpa": sdpa, "tokenmix": ours}


def _print_row(what: str, med: Dict[str, float], unit: str = "ms", scale: float = 1e3) -> None:
    print(f"{what:34s} sdpa {med['sdpa'] * scale:10.2f} {unit}  tokenmix "
          f"{med['tokenmix'] * scale:10.2f} {unit}  ratio sdpa/tokenmix "
          f"{med['sdpa'] / med['tokenmix']:.2f}x")
    sys.stdout.flush()


def _cache_bytes(cache) -> int:
    """Bytes a cache holds: a tokenmix Cache's memory_bytes(), a DynamicCache's tensors."""
    if hasattr(cache, "memory_bytes"):
        return int(cache.memory_bytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)


def _decode(model, cache, first: torch.Tensor, n: int):
    """n one-token greedy decode steps on `cache` (as generate() does them, without its
    bookkeeping), then the cache cropped back: (seconds, the n tokens)."""
    tok, out = first, []
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(n):
            tok = model(tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out.append(tok)
        seconds = time.perf_counter() - start
        cache.crop(-n)
    return seconds, torch.cat(out, 1)


def _attention_share(model, cache, first: torch.Tensor, n: int) -> float:
    """Share of the model's decode time spent in attention — the attention function plus the
    cache's update (a dynamic cache's torch.cat, a tokenmix Cache's append) — from
    torch.profiler over n decode steps (labels from record_function around both)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import AttentionInterface

    impl = model.config._attn_implementation
    mapping = AttentionInterface._global_mapping
    inner = mapping[impl]
    update = type(cache).update

    def attention(*a, **kw):
        with record_function("bench::attention"):
            return inner(*a, **kw)

    def cache_update(self, *a, **kw):
        with record_function("bench::attention"):
            return update(self, *a, **kw)

    mapping[impl] = attention
    type(cache).update = cache_update
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("bench::decode"):
                _decode(model, cache, first, n)
    finally:
        mapping[impl] = inner
        type(cache).update = update
    total = {e.key: e.cpu_time_total for e in prof.key_averages()}
    return total.get("bench::attention", 0.0) / max(total.get("bench::decode", 1.0), 1.0)


def _generation(args: argparse.Namespace, dtype: str, models, gen) -> None:
    """Decode time per token after a long prompt: transformers' DynamicCache (with sdpa and
    with tokenmix attention) against tokenmix.transformers.Cache in each --cache-dtypes, in one
    process on the same weights. The prompt is prefilled once (sdpa, DynamicCache); every side
    starts from a copy of that state; rounds alternate the order of the sides; each round
    decodes --gen-tokens tokens and crops the cache back."""
    from transformers import DynamicCache

    from tokenmix.transformers import Cache

    for ctx in args.gen_context:
        prompt = torch.randint(0, args.vocab, (1, ctx), generator=gen)
        dyn = DynamicCache(config=models["sdpa"].config)
        with torch.no_grad():
            start = time.perf_counter()
            logits = models["sdpa"](prompt, cache=dyn, use_cache=True, logits_to_keep=1).logits
            prefill = time.perf_counter() - start
        first = logits[:, -1:].argmax(-1)
        print(f"[{dtype} model] prompt {ctx} tokens: prefill (sdpa) {prefill:.1f} s; decode "
              f"{args.gen_tokens} tokens a round, median of {args.repeats} alternating rounds")
        sides = {"dynamic + sdpa": (models["sdpa"], copy.deepcopy(dyn)),
                 "dynamic + tokenmix": (models["tokenmix"], copy.deepcopy(dyn))}
        for cd in args.cache_dtypes:
            sides[f"tokenmix Cache {cd}"] = (
                models["tokenmix"],
                Cache.from_dynamic(dyn, models["tokenmix"].config, cd,
                                   max_cache_len=ctx + args.gen_tokens + 1))
        del dyn
        names = list(sides)
        times: Dict[str, List[float]] = {name: [] for name in names}
        tokens: Dict[str, torch.Tensor] = {}
        for r in range(args.repeats + 1):  # round 0 is the warm-up
            for name in (names if r % 2 == 0 else names[::-1]):
                seconds, tokens[name] = _decode(*sides[name], first, args.gen_tokens)
                if r > 0:
                    times[name].append(seconds / args.gen_tokens)
        base = statistics.median(times["dynamic + sdpa"])
        base_tm = statistics.median(times["dynamic + tokenmix"])
        f32_bytes = _cache_bytes(sides["dynamic + sdpa"][1])
        print(f"  {'side':22s} {'ms/token':>9s} {'vs sdpa':>8s} {'vs dyn+tm':>9s} "
              f"{'cache MiB':>10s} {'mem ratio':>9s} {'attn share':>10s}  same tokens")
        for name in names:
            med = statistics.median(times[name])
            share = (_attention_share(*sides[name], first, args.profile_tokens)
                     if args.profile_tokens > 0 else float("nan"))
            nbytes = _cache_bytes(sides[name][1])
            same = torch.equal(tokens[name], tokens["dynamic + sdpa"])
            print(f"  {name:22s} {med * 1e3:9.2f} {base / med:7.2f}x {base_tm / med:8.2f}x "
                  f"{nbytes / 2**20:10.1f} {nbytes / f32_bytes:9.2f} {share:10.0%}  {same}")
            sys.stdout.flush()
        del sides


def run_model(args: argparse.Namespace) -> int:
    print(f"threads: {torch.get_num_threads()}; median of {args.repeats} rounds; tokenmix kernel "
          f"path {tokenmix.resolve_isa()}")
    for dtype in args.model_dtype:
        cfg, models = _models(args, dtype)
        print(f"model: Llama-shaped, {args.layers} layers, hidden {args.hidden}, heads "
              f"{args.heads}/{args.kv_heads} (head dim {args.hidden // args.heads}), intermediate "
              f"{args.intermediate}, vocab {args.vocab}, {dtype}, random weights")
        gen = torch.Generator().manual_seed(7)
        _forward_cases(args, models, gen)
        if args.gen_context:
            _generation(args, dtype, models, gen)
        del models
    return 0


def _forward_cases(args: argparse.Namespace, models, gen) -> None:
    for T in args.seq:
        ids = torch.randint(0, args.vocab, (1, T), generator=gen)
        dtype = next(models["sdpa"].parameters()).dtype
        grad = torch.randn(1, T, args.hidden, generator=gen).to(dtype)

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
        for what, call in (("forward", fwd), ("forward+backward", fwd_bwd)):
            calls = {n: call(m) for n, m in models.items()}
            calls["null"] = _without_attention(models["sdpa"], call(models["sdpa"]))
            med = _median_pair(calls, args.repeats)
            _print_row(f"T={T} {what}", med)
            _print_attention_row(med)
        print(f"{'':34s} max relative difference of the hidden states: {err:.1e}")


def _null_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function of transformers' interface that returns its query [B, H, T, D] as
    the output [B, T, H, D]: the model's work without the attention's (the "null" side)."""
    return query.transpose(1, 2).contiguous(), None


def _without_attention(model, call: Callable[[], None]) -> Callable[[], None]:
    """call() with `model`'s attention function swapped for _null_attention while it runs."""
    from transformers import AttentionInterface

    mapping = AttentionInterface._global_mapping
    impl = model.config._attn_implementation

    def run() -> None:
        inner = mapping[impl]
        mapping[impl] = _null_attention
        try:
            call()
        finally:
            mapping[impl] = inner
    return run


def _print_attention_row(med: Dict[str, float]) -> None:
    """Each side's attention inside the model: its median less the null side's (the model
    without attention), the share of its model time, and the ratio sdpa / tokenmix."""
    attn = {n: med[n] - med["null"] for n in ("sdpa", "tokenmix")}
    ratio = attn["sdpa"] / attn["tokenmix"] if attn["tokenmix"] > 0 else float("nan")
    print(f"{'  attention in the model':34s} sdpa {attn['sdpa'] * 1e3:10.2f} ms  tokenmix "
          f"{attn['tokenmix'] * 1e3:10.2f} ms  ratio sdpa/tokenmix {ratio:.2f}x  share sdpa "
          f"{attn['sdpa'] / med['sdpa']:.0%} tokenmix {attn['tokenmix'] / med['tokenmix']:.0%}  "
          f"(model without attention {med['null'] * 1e3:.2f} ms)")
    sys.stdout.flush()


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
    p.add_argument("--seq", type=int, nargs="*", default=[4096, 8192],
                   help="sequence lengths of the forward and forward+backward cases (none: "
                        "no such case)")
    p.add_argument("--model-dtype", nargs="+", choices=sorted(_TORCH_DTYPES),
                   default=["f32", "bf16"], help="dtype(s) of the model's weights and activations")
    p.add_argument("--gen-context", type=int, nargs="*", default=[8192, 16384],
                   help="prompt lengths before greedy generation (none: no generation case)")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens generated a round")
    p.add_argument("--cache-dtypes", nargs="*", default=["f32", "bf16", "int8"],
                   choices=["f32", "bf16", "f16", "int8", "fp8_e4m3"],
                   help="dtypes of the tokenmix.transformers.Cache sides of the generation case")
    p.add_argument("--profile-tokens", type=int, default=4,
                   help="decode steps profiled (torch.profiler) for each side's attention share "
                        "(0: not measured)")
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
    if any(T < 1 for T in args.seq + args.gen_context):
        p.error("--seq and --gen-context must be >= 1")
    if args.profile_tokens < 0:
        p.error("--profile-tokens must be >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"load average before: {'%.2f %.2f %.2f' % os.getloadavg()}")
    rc = run_model(args) if args.model else run_overhead(args)
    print(f"load average after: {'%.2f %.2f %.2f' % os.getloadavg()}")
    return rc
