"""Pictures: attention maps and the bench's roofline (the optional extra ``tokenmix[plot]``,
matplotlib).

:func:`attention_maps` draws the attention weights P (SPEC 4.4: row t of a head is the
distribution over the keys u that query t mixes) of chosen layers and heads as a grid of heatmaps,
with the token strings on the axes when given: from :func:`tokenmix.attention_weights` (an array
or tensor ``[B, H, T_q, T_k]``) or from a transformers model's ``outputs.attentions`` (a tuple of
those, one per layer, with ``output_attentions=True``; ``tokenmix.transformers``).

:func:`roofline` draws the results of ``tokenmix bench ... --json`` (one JSON object per line):
each case's useful GFLOP/s against its arithmetic intensity, under the ceilings the bench measured
in the same run (the sgemm ceiling ``ceiling_gflops`` for every case; for decode also the read
bandwidth ``ceiling_gbps``), and beside it each case's fraction of its ceiling (``ratio``).

Both write a PNG (any format matplotlib knows, from the file name) and return the
``matplotlib.figure.Figure`` (made without pyplot: no global state, no display needed).

The command line lives here, not in the C++ ``tokenmix`` tool (which cannot draw)::

    python -m tokenmix.plot maps weights.npy maps.png --tokens The cat sat --heads 0 1
    python -m tokenmix.plot roofline bench.jsonl roofline.png

``maps`` reads a ``.npy`` of ``[B, H, T_q, T_k]`` (one layer) or ``[layers, B, H, T_q, T_k]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np

__all__ = ["attention_maps", "roofline", "main"]


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError("tokenmix.plot needs matplotlib: pip install 'tokenmix[plot]'") from e
    del matplotlib
    return Figure


def _as_numpy(x: Any) -> np.ndarray:
    """A float32 NumPy copy of an array or a (CPU or not, bf16 or not) torch tensor."""
    if type(x).__module__.split(".", 1)[0] == "torch":
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def _layers(weights: Any) -> List[np.ndarray]:
    """The layers' [B, H, T_q, T_k] weights: a tuple/list (a model's ``attentions``) or one
    array of rank 2 ([T_q, T_k]), 3 ([H, T_q, T_k]), 4 or 5 ([layers, B, H, T_q, T_k])."""
    if isinstance(weights, (list, tuple)):
        out = [_as_numpy(w) for w in weights]
    else:
        a = _as_numpy(weights)
        out = list(a) if a.ndim == 5 else [a]
    for i, a in enumerate(out):
        while a.ndim < 4:
            a = a[None]
        if a.ndim != 4:
            raise ValueError(f"attention_maps: layer {i} has shape {a.shape}; expected "
                             "[B, H, T_q, T_k] (or [H, T_q, T_k], [T_q, T_k])")
        out[i] = a
    return out


def _pick(what: str, chosen: Optional[Sequence[int]], n: int) -> List[int]:
    if chosen is None:
        return list(range(n))
    chosen = [int(i) for i in ([chosen] if isinstance(chosen, (int, np.integer)) else chosen)]
    for i in chosen:
        if not -n <= i < n:
            raise ValueError(f"attention_maps: {what} {i} is out of range (there are {n})")
    return [i % n for i in chosen]


def attention_maps(weights: Any, path: Union[str, Path, None] = None,
                   layers: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None,
                   tokens: Optional[Sequence[str]] = None, *, batch: int = 0,
                   title: Optional[str] = None, cmap: str = "viridis",
                   cell_inches: float = 2.6, dpi: int = 100) -> Any:
    """A grid of attention maps: one row per chosen layer, one column per chosen head.

    Args:
        weights: ``[B, H, T_q, T_k]`` array or tensor (one layer), a 5-D ``[layers, B, H, T_q,
            T_k]`` array, or a tuple of 4-D ones (a model's ``outputs.attentions``).
        path: where to write the image (None: not written).
        layers, heads: indices to draw (default all; negative counts from the end).
        tokens: the T_k key strings (the x axis); the queries (the y axis) are the last T_q of
            them (bottom-right alignment, SPEC 4.3: query t sits at position t + T_k − T_q).
        batch: which sequence of the batch.
        title: the figure's title.

    Returns:
        the Figure: axes in row-major order (layer, head), each an image whose pixel (t, u) is
        P[batch, h, t, u] (query rows down, keys across), then one shared colour bar.
    """
    Figure = _matplotlib()
    stack = _layers(weights)
    layer_ids = _pick("layer", layers, len(stack))
    B, H, T_q, T_k = stack[layer_ids[0]].shape
    if not 0 <= batch < B:
        raise ValueError(f"attention_maps: batch {batch} is out of range (B = {B})")
    head_ids = _pick("head", heads, H)
    if tokens is not None:
        tokens = [str(t) for t in tokens]
        if len(tokens) != T_k:
            raise ValueError(f"attention_maps: {len(tokens)} tokens for T_k = {T_k} keys")
    rows, cols = len(layer_ids), len(head_ids)
    fig = Figure(figsize=(cell_inches * cols + 1.2, cell_inches * rows + 0.6), dpi=dpi,
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(np.nanmax(stack[l][batch, head_ids])) for l in layer_ids) or 1.0
    image = None
    for r, l in enumerate(layer_ids):
        w = stack[l]
        if w.shape[1:] != (H, T_q, T_k) or w.shape[0] <= batch:
            raise ValueError(f"attention_maps: layer {l} has shape {w.shape}; layer "
                             f"{layer_ids[0]} has {(B, H, T_q, T_k)}")
        for c, h in enumerate(head_ids):
            ax = axes[r][c]
            image = ax.imshow(w[batch, h], cmap=cmap, vmin=0.0, vmax=vmax,
                              interpolation="nearest", aspect="equal")
            ax.set_title(f"layer {l}, head {h}" if len(stack) > 1 else f"head {h}",
                         fontsize="small")
            if tokens is not None:
                ax.set_xticks(range(T_k), tokens, rotation=90, fontsize="x-small")
                ax.set_yticks(range(T_q), tokens[T_k - T_q:], fontsize="x-small")
            else:
                ax.set_xlabel("key u", fontsize="small")
                ax.set_ylabel("query t", fontsize="small")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="P (attention weight)")
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path)
    return fig


# Bytes of one element of the bench's activation dtypes.
_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def _read_cases(bench_json: Any) -> List[Dict[str, Any]]:
    """The bench's cases: a path to its ``--json`` output (one object per line), that text, or
    a list of dicts."""
    if isinstance(bench_json, (list, tuple)):
        return [dict(c) for c in bench_json]
    text = str(bench_json)
    if isinstance(bench_json, Path) or (("{" not in text) and Path(text).exists()):
        text = Path(bench_json).read_text("utf-8")
    cases = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line.startswith("{"):
            continue  # the bench's text lines (headers) and blank lines
        try:
            cases.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"roofline: line {n} is not JSON: {e}") from e
    if not cases:
        raise ValueError("roofline: no bench case (expected the JSON lines of "
                         "`tokenmix bench ... --json`)")
    return cases


def _case_bytes(c: Dict[str, Any]) -> float:
    """Bytes a case must move at least: decode the K/V it reads (kv_bytes); forward q, k, v, out;
    backward q, k, v, out, dout, dq, dk, dv (each once), plus the fp32 log-sum-exp."""
    if c["op"] == "decode":
        return float(c["kv_bytes"])
    e = _ELEMENT_BYTES.get(c.get("dtype", "f32"), 4)
    q = c["batch"] * c["tq"] * c["hq"] * c["dh"]
    kv = c["batch"] * c["tk"] * c["hkv"] * c["dh"]
    lse = 4 * c["batch"] * c["hq"] * c["tq"]
    if c["op"] == "backward":
        return e * (4 * q + 4 * kv) + lse
    return e * (2 * q + 2 * kv) + lse


def _case_label(c: Dict[str, Any]) -> str:
    t = f"T={c['tq']}" if c["tq"] == c["tk"] else f"Tq={c['tq']} Tk={c['tk']}"
    extra = f" {c['cache_dtype']} cache" if c["op"] == "decode" else ""
    return f"{c['op']} {c.get('dtype', 'f32')} {t}{extra} ({c.get('isa', '?')})"


def roofline(bench_json: Any, path: Union[str, Path, None] = None, *,
             title: Optional[str] = None, dpi: int = 100) -> Any:
    """A roofline chart of the bench's cases, each against the ceilings of its own run.

    Left axes (log–log): a point per case at (useful FLOPs per byte moved, useful GFLOP/s), the
    sgemm ceilings as horizontal roofs and, for decode cases, the read-bandwidth roof
    GB/s × intensity up to the sgemm ceiling. Right axes: one bar per case, its fraction of the
    ceiling that binds it (the bench's ``ratio``: GFLOP/s over the sgemm ceiling, or decode's
    GB/s over the read ceiling).

    Args:
        bench_json: a path to ``tokenmix bench ... --json`` output, that text, or a list of its
            cases (dicts).
        path: where to write the image (None: not written).

    Returns:
        the Figure with those two axes (the roofline's points are one line per case, labelled
        with the case).
    """
    Figure = _matplotlib()
    cases = _read_cases(bench_json)
    fig = Figure(figsize=(12, 0.9 + 0.45 * max(len(cases), 6)), dpi=dpi, layout="constrained")
    roof_ax, bar_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    labels, ratios = [], []
    xs = []
    for i, c in enumerate(cases):
        flops = float(c["gflops"]) * 1e9 * float(c["seconds"])
        x = flops / _case_bytes(c)
        xs.append(x)
        label = _case_label(c)
        labels.append(label)
        ratios.append(float(c["ratio"]))
        roof_ax.plot([x], [float(c["gflops"])], marker="o", linestyle="none", label=label,
                     color=f"C{i % 10}")
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = np.geomspace(lo, hi, 200)
    for i, c in enumerate(cases):
        ceiling = float(c["ceiling_gflops"])
        if c["op"] == "decode" and c.get("ceiling_gbps"):
            roof = np.minimum(float(c["ceiling_gbps"]) * grid, ceiling)  # GB/s · FLOP/B = GFLOP/s
        else:
            roof = np.full_like(grid, ceiling)
        roof_ax.plot(grid, roof, linestyle="--", linewidth=0.8, color=f"C{i % 10}", alpha=0.6)
    roof_ax.set_xscale("log")
    roof_ax.set_yscale("log")
    roof_ax.set_xlabel("arithmetic intensity (useful FLOPs per byte moved)")
    roof_ax.set_ylabel("useful GFLOP/s")
    roof_ax.set_title("cases (points) under their same-run ceilings (dashed)", fontsize="small")
    roof_ax.legend(fontsize="x-small", loc="lower right")
    positions = np.arange(len(cases))
    bar_ax.barh(positions, ratios, color=[f"C{i % 10}" for i in range(len(cases))])
    bar_ax.set_yticks(positions, labels, fontsize="x-small")
    bar_ax.invert_yaxis()
    bar_ax.axvline(1.0, color="black", linewidth=0.8)
    bar_ax.set_xlim(0, max(1.05, max(ratios) * 1.05) if ratios else 1.05)
    bar_ax.set_xlabel("fraction of the same-run ceiling (ratio)")
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path)
    return fig


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m tokenmix.plot maps|roofline ...`` (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m tokenmix.plot",
                                     description="Draw attention maps or the bench's roofline.")
    sub = parser.add_subparsers(dest="command", required=True)
    maps = sub.add_parser("maps", help="attention maps from a .npy of weights")
    maps.add_argument("weights", help=".npy: [B, H, T_q, T_k] or [layers, B, H, T_q, T_k]")
    maps.add_argument("out", help="image to write (.png, .svg, ...)")
    maps.add_argument("--tokens", nargs="+", help="the T_k token strings (key axis)")
    maps.add_argument("--layers", nargs="+", type=int, help="layers to draw (default all)")
    maps.add_argument("--heads", nargs="+", type=int, help="heads to draw (default all)")
    maps.add_argument("--batch", type=int, default=0, help="sequence of the batch (default 0)")
    maps.add_argument("--title")
    roof = sub.add_parser("roofline", help="roofline chart of `tokenmix bench ... --json`")
    roof.add_argument("bench_json", help="the bench's --json output ('-': standard input)")
    roof.add_argument("out", help="image to write (.png, .svg, ...)")
    roof.add_argument("--title")
    args = parser.parse_args(argv)
    try:
        if args.command == "maps":
            attention_maps(np.load(args.weights), args.out, layers=args.layers, heads=args.heads,
                           tokens=args.tokens, batch=args.batch, title=args.title)
        else:
            source = sys.stdin.read() if args.bench_json == "-" else Path(args.bench_json)
            roofline(source, args.out, title=args.title)
    except (OSError, ValueError) as e:
        print(f"tokenmix.plot: {e}", file=sys.stderr)
        return 2  # an error: one line on stderr, exit 2 (as the tokenmix CLI)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
