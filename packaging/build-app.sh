#!/bin/sh
# Build the one-folder app with PyInstaller (dist/meshnode/meshnode) and run
# `meshnode --version` from the result. Run it from an environment where meshnode and
# PyInstaller are installed: pip install . pyinstaller
set -eu
cd "$(dirname "$0")/.."
python3 -m PyInstaller --noconfirm --clean --distpath dist --workpath build/pyinstaller packaging/meshnode.spec
dist/meshnode/meshnode --version
