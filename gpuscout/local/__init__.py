"""``gpuscout local``: running a benchmark on this machine: data preparation with a cache, job folders in the
SageMaker container layout, training subprocesses and their progress, failure classification, the run's final
analysis and report. Console rendering is not here: the runner reports through ``runner.RunObserver`` and the CLI
draws.

May import: gpuscout.domain, gpuscout.plan, gpuscout.analysis, gpuscout.store, gpuscout.errors, gpuscout.paths.
"""
