"""`python -m grammar_service [flags]`: run the grammar service (see grammar_service.config)."""

import sys

from grammar_service.server import main

if __name__ == "__main__":
    sys.exit(main())
