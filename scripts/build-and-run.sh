#!/usr/bin/env bash
# README command 1: install the Debian packages, build tokenmix (Release, build/release) and run
# the command-line tool. Arguments are passed to the tool; the default is `run`:
#   bash scripts/build-and-run.sh                 # tokenmix run
#   bash scripts/build-and-run.sh info            # tokenmix info
# Environment: TOKENMIX_JOBS (parallel build jobs, default 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

jobs=${TOKENMIX_JOBS:-2}
build=build/release

bash scripts/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" --target tokenmix_cli --parallel "$jobs"

tool="$build/tools/cli/tokenmix"
if [[ ! -x "$tool" ]]; then
  echo "build-and-run: $tool was not built" >&2
  exit 1
fi
if [[ $# -eq 0 ]]; then
  set -- run
fi
echo "+ $tool $*"
exec "$tool" "$@"
