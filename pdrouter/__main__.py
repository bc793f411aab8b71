import sys

from pdrouter.cli.main import main

sys.exit(main())
