import sys

from pdrouter.cli import main

sys.exit(main())
