"""The deployed control plane, the cloud driver of the workflow (gpuscout.workflow), and its client: the Lambda logic
(validate, plan, job events, failures, the scheduled budget check, analyze), the Cloud contract's models, SageMaker
request shapes, Lambda settings from the environment, and the client that submits manifests to a deployed stack and
reads its results.

May import: gpuscout.domain, gpuscout.plan, gpuscout.analysis, gpuscout.store, gpuscout.workflow, gpuscout.errors,
gpuscout.paths.
Not gpuscout.local or gpuscout.cli. Modules a Lambda imports at start-up import the analysis lazily, so the
job_events function never loads numpy or matplotlib.
"""
