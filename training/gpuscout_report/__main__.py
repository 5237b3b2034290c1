"""``python -m gpuscout_report --from-log LOG``: benchmark.json from a log of metric lines (log.py)."""

import sys

from .log import main

sys.exit(main())
