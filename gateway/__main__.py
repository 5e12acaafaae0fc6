"""`python -m gateway` runs the gateway server (same flags as `gramserve gateway`)."""

import sys

from gateway.server import main

sys.exit(main())
