"""The PyTorch autograd node (``libtokenmix_torch.so``): where it comes from, and building it.

The node (python/src/torch_node.cpp; see :mod:`tokenmix._native`) compiles against the torch it
serves, so it cannot be part of a wheel that does not know which torch will be installed next
to it. It comes from one of three places, tried in this order by ``import tokenmix.torch``:

1. **bundled**: built with the package when the building interpreter could import torch
   (``pip install --no-build-isolation .`` in an environment with torch; the CI builds so), and
   used while that same torch version runs;
2. **cached**: built by step 3 earlier, in ``$TOKENMIX_CACHE_DIR/torch-node/<key>/``
   (default ``${XDG_CACHE_HOME:-~/.cache}/tokenmix``); the key names the torch version, its C++
   ABI and a hash of the node's sources, so another torch or another tokenmix gets its own;
3. **built at first use**: the package ships the node's sources, and the first
   ``import tokenmix.torch`` under a torch without a node compiles them with the C++ compiler
   that built the package (``$CXX``, else ``c++``; about a minute on 2 cores, once per torch
   version; a line on stderr says so). A plain ``pip install .`` (build isolation: torch is
   not importable while the wheel builds) therefore still gets the fast path
   (docs/design.md, "The PyTorch autograd node").

``TOKENMIX_AUTOGRAD_NODE`` chooses: ``auto`` (the default: 1, 2, 3), ``prebuilt`` (1 and 2 only:
never compile), ``off`` (no node: the Python ``autograd.Function`` path, same results bit for
bit, tens of microseconds more per call). Without the node the drop-in still computes the same
values; :data:`tokenmix._native.status` and ``python -m tokenmix.torch_node`` say which node is
in use and why.

``python -m tokenmix.torch_node`` builds it now (for a container image, say) and prints its
status; ``--rebuild`` compiles again even when a cached build exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shlex
import subprocess
import sys
import time
from typing import Iterator, List, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The node's sources as shipped in the package (python/CMakeLists.txt installs them).
SOURCE_DIR = os.path.join(_HERE, "_node_src")
#: The node built with the package, when the build could import torch.
BUNDLED_LIBRARY = os.path.join(_HERE, "libtokenmix_torch.so")
_MODES = ("auto", "prebuilt", "off")


def mode() -> str:
    """``TOKENMIX_AUTOGRAD_NODE`` (default ``auto``); any other value raises ArgumentError."""
    value = os.environ.get("TOKENMIX_AUTOGRAD_NODE", "auto").strip().lower() or "auto"
    if value not in _MODES:
        from ._errors import ArgumentError

        err = ArgumentError(
            f"TOKENMIX_AUTOGRAD_NODE: expected one of {', '.join(_MODES)}, got {value!r}")
        err.code = "invalid_argument"
        raise err
    return value


def cache_root() -> str:
    """``$TOKENMIX_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/tokenmix``."""
    root = os.environ.get("TOKENMIX_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "tokenmix")
    return root


def _sources() -> List[str]:
    """The files the build reads (the node, the entry table, the library's public headers)."""
    files = [os.path.join(SOURCE_DIR, "torch_node.cpp"), os.path.join(SOURCE_DIR, "native_entry.hpp")]
    include = os.path.join(SOURCE_DIR, "include", "tokenmix")
    if os.path.isdir(include):
        files += sorted(os.path.join(include, f) for f in os.listdir(include))
    return files


def _torch_facts() -> Tuple[str, str, int]:
    import torch

    return torch.__version__, os.path.dirname(os.path.abspath(torch.__file__)), int(
        torch._C._GLIBCXX_USE_CXX11_ABI)


def cached_library() -> str:
    """Where the build for the running torch and these sources is (or will be) cached."""
    version, _, abi = _torch_facts()
    digest = hashlib.sha256()
    for path in _sources():
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in version)
    return os.path.join(cache_root(), "torch-node", f"torch-{safe}-abi{abi}-{digest.hexdigest()[:16]}",
                        "libtokenmix_torch.so")


def compile_command(output: str) -> List[str]:
    """The compiler call that builds the node against the running torch into ``output``."""
    _, torch_dir, abi = _torch_facts()
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    return cxx + [
        "-O2", "-DNDEBUG", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-I", os.path.join(SOURCE_DIR, "include"), "-I", SOURCE_DIR,
        "-isystem", os.path.join(torch_dir, "include"),
        "-isystem", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
        os.path.join(SOURCE_DIR, "torch_node.cpp"), "-o", output,
        "-L", os.path.join(torch_dir, "lib"), "-ltorch_cpu", "-lc10",
        "-Wl,-rpath," + os.path.join(torch_dir, "lib"),
    ]


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    """One builder per cache entry: other processes wait here, then find the library."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(rebuild: bool = False, quiet: bool = False) -> str:
    """Compiles the node for the running torch into the cache (unless it is there) and returns
    its path. Raises :class:`tokenmix.ResourceError` naming the compiler's log on failure."""
    library = cached_library()
    directory = os.path.dirname(library)
    with _locked(directory):
        if os.path.exists(library) and not rebuild:
            return library
        missing = [p for p in _sources()[:2] if not os.path.exists(p)]
        if missing:
            from ._errors import ResourceError

            err = ResourceError(f"tokenmix.torch_node.build: the node's sources are not in the "
                                f"package: {', '.join(missing)} (reinstall tokenmix)")
            err.code = "io_error"
            raise err
        partial = library + f".{os.getpid()}.partial"
        log = os.path.join(directory, "build.log")
        command = compile_command(partial)
        if not quiet:
            print(f"tokenmix: compiling the PyTorch autograd node for torch {_torch_facts()[0]} "
                  f"(once per torch version, about a minute; TOKENMIX_AUTOGRAD_NODE=off skips it) "
                  f"into {directory}", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    check=False)
            output, returncode = result.stdout, result.returncode
        except OSError as e:  # no compiler at all
            output, returncode = str(e).encode(), -1
        with open(log, "wb") as f:
            f.write(shlex.join(command).encode() + b"\n\n" + output)
        if returncode != 0 or not os.path.exists(partial):
            with contextlib.suppress(OSError):
                os.remove(partial)
            from ._errors import ResourceError

            tail = output.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            err = ResourceError(f"tokenmix.torch_node.build: compiling the autograd node failed "
                                f"(exit {returncode}: {tail[0]}); full log: {log}")
            err.code = "io_error"
            raise err
        os.replace(partial, library)  # atomic: a reader sees the whole library or none
        if not quiet:
            print(f"tokenmix: autograd node built in {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
    return library


def find(allow_build: bool) -> Tuple[Optional[str], str]:
    """(path of the library to load, its origin), or (None, why there is none), for the running
    torch: the bundled build of the same torch version, else the cached build, else (when
    allowed) a new build."""
    import torch

    bundled = BUNDLED_LIBRARY
    try:
        from . import _native_build  # written by the build next to a bundled library
    except ImportError:
        _native_build = None
    if _native_build is not None and os.path.exists(bundled):
        if _native_build.TORCH_VERSION == torch.__version__:
            return bundled, "bundled"
    cached = cached_library()
    if os.path.exists(cached):
        return cached, "cached"
    if not allow_build:
        return None, (f"not built for torch {torch.__version__}, and TOKENMIX_AUTOGRAD_NODE="
                      f"prebuilt forbids compiling it (python -m tokenmix.torch_node builds it)")
    return build(), "built"


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tokenmix.torch_node",
        description="Build (once per torch version) and report tokenmix's PyTorch autograd node.")
    parser.add_argument("--rebuild", action="store_true", help="compile again even if cached")
    args = parser.parse_args(argv)
    try:
        if args.rebuild:
            build(rebuild=True)
        from . import _native
    except Exception as e:  # the CLI's convention: one line on stderr, exit status 2
        print(f"tokenmix: error: {e}", file=sys.stderr)
        return 2
    print(f"autograd node: {_native.status}")
    return 0 if _native.op is not None else 1


if __name__ == "__main__":
    sys.exit(main())
