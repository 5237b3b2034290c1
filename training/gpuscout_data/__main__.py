"""``python -m gpuscout_data --input ... --output ...``: the data preparation job (prepare.py)."""

from .prepare import main

raise SystemExit(main())
