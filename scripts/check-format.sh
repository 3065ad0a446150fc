#!/usr/bin/env bash
# The format stage of scripts/test.sh: every tracked C++ file must be exactly as clang-format
# (the repository's .clang-format, clang-format 14 from Debian) leaves it. Fails listing the
# files that differ; `bash scripts/check-format.sh --fix` formats them in place.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.cc')
if [[ ${1:-} == --fix ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi
clang-format --version
bad=()
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
  echo "check-format: ${#bad[@]} of ${#files[@]} files are not clang-formatted:"
  printf '  %s\n' "${bad[@]}"
  echo "check-format: run 'bash scripts/check-format.sh --fix' (or clang-format -i FILE)"
  clang-format --dry-run "${bad[0]}" 2>&1 | head -n 20
  exit 1
fi
echo "check-format: all ${#files[@]} C++ files are clang-formatted"
