import sys

from forge_grain.cli import main

sys.exit(main())
