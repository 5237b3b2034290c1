"""``gpuscout local``: running a benchmark on this machine, one module per step of a run: ``runner`` (the run's
orchestration, in the cloud workflow's order, and its canaries), ``planning`` (the plan against this machine,
calibration), ``data_cache`` (data preparation with a cache; degenerate-data checks), ``job_process`` (one job's
folders in the SageMaker container layout, its training subprocess and progress, failure classification),
``results`` (the ranked rows, the analysis and report), ``closing`` (how a run ends, abandoned runs, tracking again),
``observer`` (what a run reports as it goes), ``search`` (a settings search's Optuna driver). Console rendering is not
here: the runner reports through ``observer.RunObserver`` and the CLI draws.

May import: gpuscout.domain, gpuscout.plan, gpuscout.analysis, gpuscout.store, gpuscout.errors, gpuscout.paths.
"""
