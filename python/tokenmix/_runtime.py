"""Version, kernel paths (ISAs), CPU features and the TOKENMIX_CPU_CAP cap, default thread count.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List

from . import _tokenmix as _C

version = _C.version
cpu_features = _C.cpu_features
available_isas = _C.available_isas
default_threads = _C.default_threads
describe_kernel = _C.describe_kernel
cpu_cap = _C.cpu_cap  # None, or the TOKENMIX_CPU_CAP cap in effect ("portable"/"avx2"/"avx512")
# True if the avx512 decode kernel reads an fp8 E4M3 cache straight as fp32 bits, False if through
# f16 bits (TOKENMIX_FP8_WIDEN=direct|f16; automatic: direct on AMD family 19h/1Ah, Zen 3 to Zen 5). Same results either way.
fp8_direct_widening = _C.fp8_direct_widening
# True if the avx512 / avx2 decode kernels prefetch every cache dtype's next tile pair in address
# order, False if each path's per-dtype choice (TOKENMIX_LINEAR_PREFETCH=all|per-dtype; automatic:
# all on Intel). Same results either way.
linear_decode_prefetch = _C.linear_decode_prefetch
# True if int8-cache decode on the avx512 paths runs the products of its units of >= 4 rows on
# AMX-INT8 tiles (TOKENMIX_DECODE_AMX=on|off; automatic: where the CPU has AMX-INT8 and Linux grants
# the tile data). Results agree with the FMA products at fp32 rounding level, not bitwise.
decode_amx = _C.decode_amx


def resolve_isa(isa: str = "auto") -> str:
    """The kernel path a call with ``isa`` would run ("portable", "avx2", "avx512", "neon");
    honours TOKENMIX_ISA for "auto". Raises UnsupportedError for a path this CPU/build lacks."""
    return _C.resolve_isa(isa)


# The thread runtimes a library can bring into a process: OpenMP (GNU libgomp, LLVM libomp, Intel
# libiomp) and OpenBLAS's own pthread pool.
_RUNTIME_FILES = {"openmp": re.compile(r"lib(gomp|omp|iomp5)[-.\w]*\.so"),
                  "openblas": re.compile(r"lib(scipy_)?openblas[-.\w]*\.so")}


def thread_runtimes() -> Dict[str, List[str]]:
    """The thread pools' libraries mapped into this process (Linux; elsewhere empty lists):
    ``{"openmp": [paths], "openblas": [paths]}``.

    tokenmix's kernels run their teams on OpenMP; PyTorch's wheel ships ``libgomp.so.1`` under the
    same soname as the system's, so whichever is loaded first serves both (one pool, one
    ``omp_set_num_threads``: ``torch.set_num_threads(n)`` also sets :func:`default_threads`).
    More than one OpenMP entry means two pools taking turns on the same cores
    (docs/performance.md, D-torch-8). OpenBLAS (tokenmix's projections in
    :class:`CausalSelfAttention`, NumPy's own) keeps its own pthread pool."""
    found: Dict[str, List[str]] = {kind: [] for kind in _RUNTIME_FILES}
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return found
    for path in sorted(paths):
        name = os.path.basename(path)
        for kind, pattern in _RUNTIME_FILES.items():
            if pattern.match(name):
                found[kind].append(path)
    return found
