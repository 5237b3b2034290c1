"""``gpuscout local``: the local driver of the workflow (gpuscout.workflow), one module per part of a run:
``planning`` (the Validate and Plan steps on this machine: the manifest read once, the runs folder checked, the
hardware detected, a job section calibrated first), ``runner`` (the run in the state machine's order: data, canaries,
jobs, closing), ``data_cache`` (data preparation with a cache), ``job_process`` (one job's folders in the SageMaker
container layout, its training subprocess and progress, failure classification; ``FolderLauncher``, the workflow's
``JobLauncher``), ``closing`` (analysis, report and final status through the workflow; abandoned runs; tracking
again), ``results`` (the ranked rows; a repriced analysis), ``observer`` (what a run reports as it goes), ``search`` (a
settings search's Optuna driver). Console rendering is not here: the runner reports through ``observer.RunObserver``
and the CLI draws.

May import: gpuscout.domain, gpuscout.plan, gpuscout.analysis, gpuscout.store, gpuscout.workflow, gpuscout.errors,
gpuscout.paths.
"""
