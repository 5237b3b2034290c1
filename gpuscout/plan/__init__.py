"""Turning a manifest into jobs: expansion of targets x variants x repetitions, per-job settings, predicted
throughput, time, cost and memory, and the budget and fit checks that refuse a run before anything is launched.
``planner`` (``plan()`` and the predictions), ``jobs`` (the ``Plan``, run ids, job names, repetitions, train.py's
hyperparameters, runtime limits), ``job_section`` (a user's own code: arguments, environment, estimate or
calibration), ``memory``, ``search``, ``canary``.

May import: gpuscout.domain, gpuscout.errors, gpuscout.paths.
"""
