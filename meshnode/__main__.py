import sys

from meshnode.cli import main

sys.exit(main())
