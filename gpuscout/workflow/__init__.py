"""One run, two drivers: the steps of a benchmark run, each in a module of its own, in the order the state machine
runs them. ``gpuscout.local`` drives them in one process; ``gpuscout.cloud`` drives them from the Lambdas of the
state machine's states. What differs between the faces comes in through ports (``ports.py``: the result store, where
a report is published, who launches a job, who is told), never through a face's own client or console.

====================  ===================================  ===============================================
step (module)         state machine                        ``gpuscout local``
====================  ===================================  ===============================================
``validate``          Validate manifest                    ``planning.validate``, before the store opens
``calibrate``         (none: the cloud asks for            ``planning.plan_jobs``, for a job section
                      ``job.estimate``)                    without an estimate
``plan``              Plan jobs                            ``planning.plan_jobs``, ``runner``
``prepare_data``      Prepare data (a Processing job)      ``data_cache.prepare_data``, then the check
``canary``            Run canaries / Canary (rows: Plan)   ``runner`` (a ``FolderLauncher``)
``train_and_record``  Run jobs / Train / Record job         ``runner`` with ``job_process.run_job``
                      result (cloud/events.py)
``analyze``           Analyze run                          ``closing.close_run``
``report``            Analyze run                          ``closing.close_run``
``close``             Analyze run; a refusal; Mark run     ``closing.close_run`` (the console tells)
                      failed
====================  ===================================  ===============================================

``STEPS`` is that order and ``STATES`` each step's states. A driver enters each step's module once per run, in that
order: tests/integration/test_one_workflow.py walks ``gpuscout local``, test_state_machine.py the synthesized state
machine with the real handlers (and finds every state named here in it).

May import: gpuscout.domain, gpuscout.plan, gpuscout.store, gpuscout.analysis (lazily: numpy and matplotlib load
only in the analyze and report steps), gpuscout.errors. Not gpuscout.local, gpuscout.cloud or gpuscout.cli.
"""

from __future__ import annotations

STEPS: tuple[str, ...] = (
    "validate",
    "calibrate",
    "plan",
    "prepare_data",
    "canary",
    "train_and_record",
    "analyze",
    "report",
    "close",
)

STATES: dict[str, tuple[str, ...]] = {
    "validate": ("Validate manifest",),
    "calibrate": (),
    "plan": ("Plan jobs",),
    "prepare_data": ("Prepare data",),
    "canary": ("Run canaries", "Canary"),
    "train_and_record": ("Run jobs", "Train", "Record job result"),
    "analyze": ("Analyze run",),
    "report": ("Analyze run",),
    "close": ("Analyze run", "Mark run failed"),
}
