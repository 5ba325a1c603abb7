import sys

from mixprec.cli import main

sys.exit(main())
