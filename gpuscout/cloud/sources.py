"""What a valid manifest may still not do in a deployed stack, refused before anything runs (by `gpuscout submit`
and by the workflow's Validate step), each with the fix in the message.

- ``local`` targets run only with `gpuscout local`; a stack may allow only some instance types.
- Every S3 source (dataset, model, tokenizer) must be under ``s3://<data bucket>/raw/``: the SageMaker role reads
  nothing else (stacks/roles.py, ReadDatasets). Local paths do not exist in the cloud.
- A job section's ``source_dir`` (the user's code) must be there too, under raw/code/ when `gpuscout submit`
  uploaded it; its ``requirements`` need network to install.
- ``network_isolation: true`` gives the training container no network: a hub model (``model.hf_id``) cannot
  download. An S3 ``model.path`` works either way: it reaches the job as the ``model`` input channel, which
  SageMaker downloads with the role before the container starts (sagemaker_requests.training_job_request). A canary
  with network reads only its layers' part of it instead (gpuscout_train/partial_checkpoint.py); under isolation it too
  downloads the whole checkpoint.
- ``tracking`` (tracking_problems): a job reaches MLflow only at a server (an ARN or http(s) URI, and not under
  network isolation; an ARN must be a tracking server the deployment grants, context mlflow_tracking_servers), W&B
  only offline (no API key is passed to SageMaker), and the settings must fit one Environment value.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from gpuscout.cloud.plan_items import MAX_REQUESTS_PER_RUN
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.names import CODE_PREFIX, RAW_PREFIX
from gpuscout.domain.tracking import (
    CLOUD_WANDB_DIR,
    REMOTE_MLFLOW_RE,
    SAGEMAKER_ENV_VALUE_MAX_CHARS,
    TRACKING_ENV,
    JobTracking,
    cloud_destinations,
    encode,
)
from gpuscout.errors import Problem

# CreateTrainingJob HyperParameters (botocore's SageMaker model): at most 100 entries, values of at most 2,500
# characters. Not checked by botocore's client-side validation: SageMaker refuses the request when the job starts.
MAX_HYPERPARAMETERS = 100
MAX_HYPERPARAMETER_CHARS = 2500
LINE_BREAKS = re.compile("[\n\r\u0085\u2028\u2029]")  # what the API's '.*' (a Java regex) does not match
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _location_problems(field: str, location: str, data_bucket: str, what: str) -> list[Problem]:
    """[] when the SageMaker role can read ``location`` (under raw/ of the data bucket), else the problem with the
    `aws s3 sync` that puts it there: from another S3 location, or from a local path."""
    is_s3 = location.startswith("s3://")
    bucket, _, key = location.removeprefix("s3://").partition("/") if is_s3 else ("", "", location)
    if is_s3 and bucket == data_bucket and key.startswith(RAW_PREFIX):
        return []
    name = key.rstrip("/").rsplit("/", 1)[-1] or what
    target = f"s3://{data_bucket}/{RAW_PREFIX}{name}/"
    if is_s3:
        why = f"the stack's SageMaker role reads {what}s only under s3://{data_bucket}/{RAW_PREFIX}, not {location}"
        fix = f"copy it there (aws s3 sync {location.rstrip('/')}/ {target})"
    else:
        why = f"{location!r} is a local path, which a cloud job cannot read"
        fix = f"upload it (aws s3 sync {location} {target})"
    return [Problem(field, f"{why}; {fix} and set {field}: {target}")]


def source_problems(manifest: Manifest, *, data_bucket: str) -> list[Problem]:
    """Dataset, model and tokenizer sources the stack's jobs could never read (module docstring)."""
    problems: list[Problem] = []
    if manifest.job is not None:
        return job_source_problems(manifest, data_bucket=data_bucket)
    model, dataset, _ = manifest.builtin()
    if not dataset.source.startswith("bundled:"):
        problems += _location_problems("dataset.source", dataset.source, data_bucket, "dataset")
    if model.path is not None:
        problems += _location_problems("model.path", model.path, data_bucket, "model")
    if model.hf_id is not None and manifest.network_isolation:
        name = model.hf_id.rsplit("/", 1)[-1]
        problems.append(
            Problem(
                "model.hf_id",
                f"network_isolation: true leaves the training container without network, so {model.hf_id} cannot "
                f"download from the Hugging Face Hub; upload the model (huggingface-cli download {model.hf_id} "
                f"--local-dir {name} && aws s3 sync {name} s3://{data_bucket}/{RAW_PREFIX}models/{name}/) and set "
                f"model.path: s3://{data_bucket}/{RAW_PREFIX}models/{name}/ instead of hf_id",
            )
        )
    tokenizer = manifest.tokenizer.path
    hub_id = tokenizer is not None and _HUB_ID_RE.match(tokenizer) and not tokenizer.startswith((".", "/", "~"))
    if tokenizer is not None and not hub_id:  # a hub id downloads in the (networked) data-preparation job
        problems += _location_problems("tokenizer.path", tokenizer, data_bucket, "tokenizer")
    return problems


def job_source_problems(manifest: Manifest, *, data_bucket: str) -> list[Problem]:
    """The user's code (a job section) reaches the job as the ``code`` input channel, so its folder must be under
    raw/ (`gpuscout submit` uploads a local folder there); pip cannot install its requirements without network."""
    job = manifest.job
    assert job is not None
    problems: list[Problem] = []
    if job.in_s3:
        problems += _location_problems("job.source_dir", job.source_dir, data_bucket, "code folder")
    else:
        problems.append(
            Problem(
                "job.source_dir",
                f"{job.source_dir!r} is a local folder, which a cloud job cannot read; `gpuscout submit` uploads it "
                f"(to s3://{data_bucket}/{RAW_PREFIX}{CODE_PREFIX}) and submits the manifest with that source_dir",
            )
        )
    if job.requirements and manifest.network_isolation:
        problems.append(
            Problem(
                "job.requirements",
                "network_isolation: true leaves the training container without network, so pip cannot install "
                f"{job.requirements}; set network_isolation: false, or copy the pure-Python packages into source_dir "
                "(it is on the script's import path) and drop job.requirements",
            )
        )
    return problems


# The training image's PyPI torch (training/requirements.txt, 2.13) is a CUDA 12.8/13 build: since PyTorch 2.11 those
# carry no kernels below Turing (pytorch/pytorch#172352, RELEASE.md's CUDA support matrix), so a V100 job fails at its
# first kernel launch ("no kernel image is available for execution on the device").
IMAGE_MIN_COMPUTE_CAPABILITY = (7, 5)


def _image_cannot_run(instance_type: str) -> str | None:
    """Why the training image cannot run on ``instance_type``'s GPU, or None."""
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.errors import CatalogError

    try:
        sku = load_catalog().get(instance_type).sku
    except CatalogError:
        return None
    if sku is None or sku.compute_capability is None or sku.compute_capability >= IMAGE_MIN_COMPUTE_CAPABILITY:
        return None
    major, minor = sku.compute_capability
    return (
        f"{instance_type} has {sku.model} (compute capability {major}.{minor}); the training image's torch (a CUDA "
        "12.8/13 build) has no kernels below Turing (7.5) since PyTorch 2.11, so every job would fail at its first "
        "GPU kernel; choose a Turing-or-newer GPU (ml.g5.*, ml.p4d.*, ml.p5.*)"
    )


def target_problems(manifest: Manifest, *, allowed_instance_types: Collection[str] = ()) -> list[Problem]:
    """`local` targets, GPUs the image cannot run on, and types the stack does not allow (an empty allow-list allows
    every catalogued type)."""
    problems: list[Problem] = []
    jobs = manifest.planned_pairs() * manifest.repetitions
    if jobs > MAX_REQUESTS_PER_RUN:  # the cheap bound; with canaries counted: plan_items.request_count_problems
        problems.append(
            Problem(
                "targets x variants x repetitions",
                f"{len(manifest.targets)} x {len(manifest.variants)} x {manifest.repetitions} = {jobs} jobs; a cloud "
                f"run takes at most {MAX_REQUESTS_PER_RUN} SageMaker jobs, canaries included (the largest plan the "
                "state machine has been run with); split the manifest into several (each its own run) or lower "
                "repetitions",
            )
        )
    for i, target in enumerate(manifest.targets):
        if target.instance_type == "local":
            problems.append(Problem(f"targets[{i}].instance_type", "'local' runs only with `gpuscout local`"))
        elif (why := _image_cannot_run(target.instance_type)) is not None:
            problems.append(Problem(f"targets[{i}].instance_type", why))
        elif allowed_instance_types and target.instance_type not in allowed_instance_types:
            problems.append(
                Problem(
                    f"targets[{i}].instance_type",
                    f"{target.instance_type} is not allowed by this stack; allowed: "
                    f"{', '.join(allowed_instance_types)}",
                )
            )
    return problems


def timeout_problems(manifest: Manifest, *, execution_timeout_hours: float) -> list[Problem]:
    """Spot targets whose max_wait_hours outlasts the state machine's timeout: the execution would end (and the
    run fail) while SageMaker still waits for capacity."""
    return [
        Problem(
            f"targets[{i}].max_wait_hours",
            f"{target.max_wait_hours:g} h is longer than this stack's execution timeout "
            f"({execution_timeout_hours:g} h, context execution_timeout_hours); use at most that",
        )
        for i, target in enumerate(manifest.targets)
        if target.max_wait_hours is not None and target.max_wait_hours > execution_timeout_hours
    ]


# The job part of GPUSCOUT_TRACKING is bounded: a variant name (planner: a slug of at most 40 characters, a search
# candidate's name is shorter), the instance count, the spot flag and a price; these stand for the longest.
_LONGEST_JOB_PART = {"variant": "v" * 64, "instance_count": 64, "spot": False, "usd_per_hour": 1234.5678901234567}


@dataclass(frozen=True)
class TrackingServers:
    """The SageMaker managed MLflow tracking servers a deployment's training jobs may log to (its role's grant)."""

    names: tuple[str, ...]
    account: str
    region: str

    def problem(self, arn: str) -> str | None:
        """Why a job of this deployment could not log to ``arn``, or None."""
        match = _MLFLOW_ARN_RE.match(arn)
        if match is None:
            return (
                f"{arn} is not a SageMaker managed MLflow tracking server ARN "
                "(arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME)"
            )
        region, account, name = match.group("region", "account", "name")
        if (region, account) != (self.region, self.account):
            return (
                f"{arn} is in {account}/{region}, but this deployment's jobs may only reach tracking servers of "
                f"{self.account}/{self.region}"
            )
        if name not in self.names:
            allowed = ", ".join(self.names) if self.names else "none"
            return (
                f"the training jobs' role may not log to tracking server {name!r} (this deployment grants: {allowed}); "
                "add it to the cdk.json context mlflow_tracking_servers and redeploy (docs/deploy.md)"
            )
        return None


_MLFLOW_ARN_RE = re.compile(
    r"^arn:aws[a-z-]*:sagemaker:(?P<region>[a-z0-9-]+):(?P<account>\d{12}):mlflow-tracking-server/(?P<name>[^/]+)$"
)


def tracking_problems(manifest: Manifest, *, servers: TrackingServers | None = None) -> list[Problem]:
    """Tracking settings a SageMaker job cannot use (module docstring), each with what to do instead. ``servers``:
    the deployment's MLflow grant, when known (the control plane knows it; `gpuscout submit` does not)."""
    tracking = manifest.resolved_tracking()
    if tracking is None:
        return []
    problems: list[Problem] = []
    mlflow, wandb = tracking.mlflow, tracking.wandb
    if mlflow is not None:
        field = "tracking.mlflow.tracking_uri"
        uri = mlflow.tracking_uri
        if uri is None:
            problems.append(
                Problem(
                    field,
                    "a cloud run needs a tracking server: the ARN of a SageMaker managed MLflow tracking server "
                    "(arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME) or an http(s) URI; the "
                    "default (a SQLite file in the runs folder) exists only for `gpuscout local`",
                )
            )
        elif not REMOTE_MLFLOW_RE.match(uri):
            problems.append(
                Problem(
                    field,
                    f"{uri} is a file on this machine, which a SageMaker job cannot reach; give the ARN of a "
                    "SageMaker managed MLflow tracking server or an http(s) URI",
                )
            )
        elif servers is not None and uri.startswith("arn:") and (reason := servers.problem(uri)) is not None:
            problems.append(Problem(field, reason))
        elif manifest.network_isolation:
            problems.append(
                Problem(
                    field,
                    "network_isolation: true leaves the training container without network, so it cannot reach "
                    f"{uri}; set network_isolation: false, or track with W&B offline (tracking.wandb)",
                )
            )
    if wandb is not None and wandb.mode == "online":
        problems.append(
            Problem(
                "tracking.wandb.mode",
                "online needs WANDB_API_KEY inside the training job, and gpuscout passes no secret to SageMaker (a "
                "job's Environment shows in DescribeTrainingJob); use mode: offline: each job writes its run to "
                f"{CLOUD_WANDB_DIR}/wandb/, which comes back in its output.tar.gz; `wandb sync` uploads it",
            )
        )
    if not problems:
        value = encode(JobTracking(**cloud_destinations(tracking).model_dump(), **_LONGEST_JOB_PART))
        if len(value) > SAGEMAKER_ENV_VALUE_MAX_CHARS:
            problems.append(
                Problem(
                    "tracking",
                    f"a job's tracking settings ({TRACKING_ENV}) take up to {len(value)} characters, SageMaker "
                    f"allows {SAGEMAKER_ENV_VALUE_MAX_CHARS} in an Environment value; shorten "
                    "tracking.mlflow.experiment (default: the manifest's name) or tracking.mlflow.tracking_uri",
                )
            )
    return problems


def hyperparameter_problems(manifest: Manifest) -> list[Problem]:
    """A job section's arguments as SageMaker HyperParameters: each variant's (and the canary's) merged arguments
    within CreateTrainingJob's 100 entries, every value within 2,500 characters. The built-in job's own
    hyperparameters are gpuscout's (about 30, short)."""
    from gpuscout.plan.job_section import argument_text  # the text each value is sent as (lazy: the planner is heavy)

    job = manifest.job
    if job is None:
        return []
    problems: list[Problem] = []
    sources = {"job.arguments": job.arguments, "job.canary_arguments": job.canary_arguments}
    sources |= {f"variants[{i}].hyperparameters": v.hyperparameters for i, v in enumerate(manifest.variants)}
    for field, values in sources.items():
        for key, value in values.items():
            text = argument_text(value)
            if len(text) > MAX_HYPERPARAMETER_CHARS:
                problems.append(
                    Problem(
                        f"{field}.{key}",
                        f"{len(text):,} characters; SageMaker passes hyperparameters of at most "
                        f"{MAX_HYPERPARAMETER_CHARS:,} characters (put long values in a file of the code folder)",
                    )
                )
            if LINE_BREAKS.search(text):
                problems.append(
                    Problem(
                        f"{field}.{key}",
                        "contains a line break; a SageMaker hyperparameter value is one line (pattern '.*' of the "
                        "API; put multi-line text in a file of the code folder)",
                    )
                )
    for i, variant in enumerate(manifest.variants):
        # what each job and each of its canaries is sent (planner: job arguments, then the variant's; the canary's
        # over those, gpuscout.plan.canary)
        arguments = {**job.arguments, **variant.hyperparameters}
        for field, sent in ((f"variants[{i}].hyperparameters", arguments),
                            ("job.canary_arguments", {**arguments, **job.canary_arguments})):  # fmt: skip
            if len(sent) > MAX_HYPERPARAMETERS:
                problems.append(
                    Problem(
                        field,
                        f"variant {variant.name}: {len(sent)} arguments in all; SageMaker passes at most "
                        f"{MAX_HYPERPARAMETERS} hyperparameters to a job (put the rest in a config file of the code "
                        "folder)",
                    )
                )
    return problems


def search_problems(manifest: Manifest) -> list[Problem]:
    """A settings search runs as a SageMaker tuning job, whose trials share one CheckpointConfig S3 prefix (the API has
    no per-trial one) and get all of it copied to /opt/ml/checkpoints at start: with checkpoints on, every trial would
    download every earlier trial's checkpoints. Refused rather than paid for."""
    if manifest.search is None or manifest.training.checkpoint_interval == 0:
        return []
    return [
        Problem(
            "training.checkpoint_interval",
            "a cloud search's trials share one checkpoint location (a SageMaker tuning job has no per-trial one), so "
            "each trial would download every earlier trial's checkpoints; set it to 0 for a search, or benchmark the "
            "settings as variants (each job has its own checkpoints)",
        )
    ]


def cloud_problems(
    manifest: Manifest,
    *,
    data_bucket: str,
    allowed_instance_types: Collection[str] = (),
    execution_timeout_hours: float | None = None,
    tracking_servers: TrackingServers | None = None,
) -> list[Problem]:
    problems = target_problems(manifest, allowed_instance_types=allowed_instance_types)
    problems += source_problems(manifest, data_bucket=data_bucket)
    problems += tracking_problems(manifest, servers=tracking_servers)
    problems += hyperparameter_problems(manifest)
    problems += search_problems(manifest)
    if execution_timeout_hours is not None:
        problems += timeout_problems(manifest, execution_timeout_hours=execution_timeout_hours)
    return problems
