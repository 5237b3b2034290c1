"""The names the deployed stack and the code it runs share: the S3 key prefixes of its two buckets and the prefix of
every SageMaker job name. Each is defined here once.

The stack (stacks/) builds its IAM grants, bucket lifecycle rules and EventBridge rules from these; the control plane,
the CLI client and the planner build object keys and job names from the same constants, so a grant cannot drift from
the keys the code writes (tests/infra/test_shared_names.py reads the synthesized template for them).

May import: nothing (standard library only): the stack, the Lambdas and the training image all import it.
"""

from __future__ import annotations

# -- the data bucket (output DataBucketName): what a user puts in and takes out
MANIFESTS_PREFIX = "manifests/"  # a manifest written here starts a run (the EventBridge rule's key filter)
RAW_PREFIX = "raw/"  # datasets, models, tokenizers and code: the only prefix the SageMaker role reads sources from
CODE_PREFIX = "code/"  # under RAW_PREFIX: the code folders `gpuscout submit` uploads (content-addressed)
PROCESSED_PREFIX = "processed/"  # prepared datasets, one folder per (source, tokenizer, sequence length) key
REPORTS_PREFIX = "reports/"  # reports/<run_id>/report.md|html|json and its charts (the analyze step)
REJECTED_PREFIX = "rejected/"  # rejected/<name>.error.json: why the Validate step refused a manifest

# -- the artifacts bucket (output ArtifactsBucketName): what jobs and the workflow write
OUTPUT_PREFIX = "output/"  # output/<run_id>/<job name>/output/output.tar.gz (SageMaker's OutputDataConfig)
CHECKPOINTS_PREFIX = "checkpoints/"  # checkpoints/<run_id>/<job name>/ (CheckpointConfig; expired by lifecycle)
PLANS_PREFIX = "plans/"  # plans/<run_id>/<canaries|jobs|tunings>.json: the request lists the Distributed Maps read
SEARCH_PREFIX = "search/"  # search/<run_id>/<tuning job>.json: a settings search's candidates per tuning job

# -- SageMaker: every job gpuscout starts (training, processing, tuning, and the trials SageMaker names after their
# tuning job) has a name that starts so; the IAM grants and the job-state event rule cover these jobs only.
JOB_NAME_PREFIX = "gs-"

# -- IAM: each run's own role for its SageMaker jobs (gpuscout.cloud.run_roles) is named so, under the path
# /gpuscout/<region>/<stack name>/; the stack's grants to create, pass and delete run roles cover these names only.
RUN_ROLE_NAME_PREFIX = f"{JOB_NAME_PREFIX}run-"
RUN_ROLE_PATH_PREFIX = "/gpuscout/"
# The service principal that assumes the jobs' roles (run roles, data preparation's), and what a run's jobs may do
# with their own output and checkpoints (SageMaker uploads the first and syncs the second both ways): the run roles'
# boundary (stacks/roles.py) and each run role's inline policy (gpuscout.cloud.run_roles) grant exactly these.
SAGEMAKER_SERVICE = "sagemaker.amazonaws.com"
RUN_ARTIFACT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")

# -- CloudWatch: gpuscout's own metrics (the Lambdas emit them; the failed-runs alarm and the dashboard read them)
METRIC_NAMESPACE = "gpuscout"
