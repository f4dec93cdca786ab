import sys

from memattn.cli import main

sys.exit(main())
