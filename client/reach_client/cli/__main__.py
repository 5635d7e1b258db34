"""``python -m reach_client.cli``: the ``reach`` command."""

import sys

from reach_client.cli import main

sys.exit(main())
