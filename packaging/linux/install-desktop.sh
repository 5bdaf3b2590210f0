#!/bin/sh
# Install the .desktop entry and the icon (SVG and PNG sizes) for this user.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
icons="$here/../../assets/icons"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
install -Dm644 "$here/meshnode.desktop" "$data/applications/meshnode.desktop"
install -Dm644 "$icons/meshnode.svg" "$data/icons/hicolor/scalable/apps/meshnode.svg"
for size in 16 32 48 64 128 256 512; do
    install -Dm644 "$icons/meshnode-$size.png" "$data/icons/hicolor/${size}x${size}/apps/meshnode.png"
done
echo "installed meshnode.desktop and its icons under $data"
