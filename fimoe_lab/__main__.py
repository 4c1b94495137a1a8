import sys

from fimoe_lab.cli import main

sys.exit(main())
