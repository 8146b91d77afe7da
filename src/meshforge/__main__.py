import sys

from meshforge.cli import main

sys.exit(main())
