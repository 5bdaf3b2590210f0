"""The PyInstaller app's entry point: the `meshnode` command."""

import sys

from meshnode.cli import main

sys.exit(main())
