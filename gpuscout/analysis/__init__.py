"""The answer to a run: prices, costs, confidence intervals, per-variant metrics, ranking, recommendation and the
report (md, html, json, PNG charts), and the run's results in its experiment trackers (``tracking``: MLflow,
W&B; they are imported only when a manifest tracks).

May import: gpuscout.domain, gpuscout.plan, gpuscout.store, gpuscout.errors, gpuscout.paths. numpy and matplotlib
are imported by the modules that need them (analyze, report), never by this package's ``__init__``, so a caller
that needs only ``intervals`` or ``pricing`` (the training callback, the job_events Lambda) stays light.
"""
