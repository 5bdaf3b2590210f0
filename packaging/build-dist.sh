#!/bin/sh
# Build the wheel and the sdist into dist/ (or $1). Needs `build` (pip install build);
# without it, pip builds the wheel alone.
set -eu
cd "$(dirname "$0")/.."
out="${1:-dist}"
if python3 -c "import build" 2>/dev/null; then
    python3 -m build --wheel --sdist --outdir "$out" .
else
    echo "python -m build not installed: building the wheel only (pip install build for the sdist)" >&2
    python3 -m pip wheel --no-deps --wheel-dir "$out" .
fi
ls -l "$out"
