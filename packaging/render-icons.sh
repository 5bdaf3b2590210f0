#!/bin/sh
# Render assets/icons/meshnode-<size>.png from meshnode.svg (needs cairosvg: pip install cairosvg).
set -eu
cd "$(dirname "$0")/../assets/icons"
for size in 16 32 48 64 128 256 512; do
    cairosvg meshnode.svg --output-width "$size" --output-height "$size" -o "meshnode-$size.png"
done
