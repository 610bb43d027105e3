"""`python -m parcompile` is the `parcompile` command."""

import sys

from parcompile.cli import main

sys.exit(main())
