"""A settings search in the cloud: one SageMaker CreateHyperParameterTuningJob request per search target.

The planner (gpuscout.plan.search) has already expanded each target's candidates and dropped the ones that cannot
run; only the launchable ones become values of one categorical hyperparameter, ``search_candidate``, whose value is
the candidate's name. train.py turns the name back into settings
(gpuscout.domain.candidates.parse_candidate_name); every other hyperparameter is the same for all candidates of a
target and is static. The objective is the running $ per 1M tokens that train.py prints on its step lines once it
knows the job's price (``price_per_hour_usd``), minimized;
SageMaker reads it with the same MetricDefinitions regexes as every training job (gpuscout.domain.metric_lines).

SageMaker names a tuning job's training jobs (its trials) with the tuning job's name as prefix, so trials start with
``gs-`` like every gpuscout job: the EventBridge rule sends their state changes to job_events, which creates each
trial's JOB row from the candidate's JobSpec. Those JobSpecs are written by the plan step to
``s3://<artifacts>/search/<run_id>/<tuning job name>.json`` (:class:`SearchTarget`), where job_events and the
workflow's recording steps read them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpuscout.cloud.sagemaker_requests import (
    DataSource,
    RequestSettings,
    checkpoint_uri,
    max_wait_seconds,
    training_job_request,
)
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.metric_lines import OBJECTIVE_METRIC
from gpuscout.domain.names import JOB_NAME_PREFIX, SEARCH_PREFIX
from gpuscout.domain.search_plan import SearchPlan, TargetSearch
from gpuscout.errors import GpuscoutError

# CategoricalParameterRange.Values holds at most 30 values (botocore's SageMaker model, ParameterValues).
MAX_CATEGORICAL_VALUES = 30
CANDIDATE_HYPERPARAMETER = "search_candidate"
PRICE_HYPERPARAMETER = "price_per_hour_usd"
OBJECTIVE_STEPS_HYPERPARAMETER = "objective_min_timed_steps"
# train.py's hyperparameters that a candidate's name sets (gpuscout_train/args.py CANDIDATE_HYPERPARAMETERS), and
# the job name, which SageMaker gives each trial: only these may differ between the candidates of one target.
CANDIDATE_KEYS = frozenset(
    {
        "job_name",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "deepspeed_stage",
        "gradient_checkpointing",
        "torch_compile",
        "attention_implementation",
        "fused_cross_entropy",
        "dataloader_num_workers",
        "method",
        "lora_rank",
    }
)
# The adapters' other knobs: the base variant's for every adapter candidate, absent from a full one (train.py reads
# them only with method lora or qlora), so shared by the candidates that have them.
ADAPTER_KEYS = frozenset({"lora_alpha", "lora_dropout", "lora_target_modules"})
TUNING_JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,31}$")  # HyperParameterTuningJobName (1-32)


class TuningRequestError(GpuscoutError):
    """A search target cannot become a SageMaker tuning job (the message says which limit and what to change)."""


def tuning_job_name(run_id: str, target_index: int) -> str:
    """``gs-<12 hex of the run id>-t<NN>``: 19 characters (SageMaker allows 32, names are case-insensitive), unique
    per run and target, and the prefix of every trial's name."""
    name = f"{JOB_NAME_PREFIX}{hashlib.sha256(run_id.encode()).hexdigest()[:12]}-t{target_index:02d}"
    if not TUNING_JOB_NAME_RE.match(name):  # pragma: no cover - hex digits and a number by construction
        raise ValueError(f"invalid tuning job name {name!r}")
    return name


def search_target_key(run_id: str, tuning_name: str) -> str:
    """Where the plan step writes a tuning job's :class:`SearchTarget` in the artifacts bucket."""
    return f"{SEARCH_PREFIX}{run_id}/{tuning_name}.json"


def tuning_name_of_arn(arn: str) -> str:
    """``arn:aws:sagemaker:<region>:<account>:hyper-parameter-tuning-job/<name>`` -> ``<name>``."""
    return arn.rsplit("/", 1)[-1]


class SearchTarget(BaseModel):
    """What job_events needs to turn a trial's first event into its JOB row: the candidates' JobSpecs by name."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    tuning_job_name: str
    target_index: int
    instance_type: str
    early_stopping: bool
    candidates: dict[str, JobSpec]

    def trial_spec(self, candidate: str, trial_name: str) -> JobSpec:
        """The candidate's JobSpec as the trial ``trial_name`` ran it. Raises KeyError for an unknown candidate."""
        spec = self.candidates[candidate]
        hyperparameters = {**spec.hyperparameters, "job_name": trial_name}
        return spec.model_copy(update={"job_name": trial_name, "hyperparameters": hyperparameters})


def strategy(search: SearchPlan, target: TargetSearch) -> tuple[str, str]:
    """(Strategy, TrainingJobEarlyStoppingType) of a target's tuning job.

    With pruning on: Bayesian with early stopping Auto (SageMaker stops a trial whose objective is worse than the
    median of the earlier trials' running averages at the same point; Hyperband has its own early stopping and needs
    TrainingJobEarlyStoppingType Off plus an epoch count, so it does not apply). With pruning off and every candidate
    within max_trials: Grid, which runs each candidate exactly once. Otherwise Bayesian without early stopping."""
    if search.pruning:
        return "Bayesian", "Auto"
    if target.max_trials >= len(target.candidates):
        return "Grid", "Off"
    return "Bayesian", "Off"


def objective_price_per_hour(spec: JobSpec) -> float:
    """The whole job's price per hour the objective uses: the spot price when the target states one (spot jobs
    otherwise at the on-demand price), times the instance count."""
    price = spec.spot_price_per_hour_usd if spec.spot and spec.spot_price_per_hour_usd is not None else None
    return (price if price is not None else spec.price_per_hour_usd) * spec.instance_count


def static_hyperparameters(specs: Sequence[JobSpec], where: str) -> dict[str, str]:
    """The hyperparameters every candidate shares; raises TuningRequestError when one that a candidate's name does
    not set differs between them (train.py could not tell the trials apart)."""
    values: dict[str, set[str]] = {}
    for spec in specs:
        for key, value in spec.hyperparameters.items():
            values.setdefault(key, set()).add(value)
    common = {
        key: next(iter(seen))
        for key, seen in values.items()
        if len(seen) == 1 and (key in ADAPTER_KEYS or all(key in s.hyperparameters for s in specs))
    }
    differing = sorted(set(values) - set(common) - CANDIDATE_KEYS)
    if differing:
        raise TuningRequestError(
            f"search: {where}: the candidates differ in {', '.join(differing)}, which a candidate's name does not "
            "carry; a tuning job can vary only what the name sets"
        )
    return {k: v for k, v in common.items() if k != "job_name"}


def tuning_job_request(
    target: TargetSearch,
    specs: Sequence[JobSpec],
    search: SearchPlan,
    settings: RequestSettings,
    data: DataSource,
    *,
    enable_network_isolation: bool,
    max_parallel_jobs: int,
    spot_max_wait_seconds: int | None = None,
) -> dict[str, Any]:
    """The CreateHyperParameterTuningJob request of one search target. ``specs`` are the target's candidates (the
    plan's JobSpecs, in ``target.candidates`` order); ``max_parallel_jobs`` caps the trials running at once."""
    where = f"targets[{target.target_index}] {target.instance_type}"
    by_name = {s.variant_name: s for s in specs}
    if sorted(by_name) != sorted(target.candidates) or len(specs) != len(target.candidates):
        raise TuningRequestError(f"search: {where}: the plan's jobs are not the target's candidates")
    if len(target.candidates) > MAX_CATEGORICAL_VALUES:
        raise TuningRequestError(
            f"search: {where} has {len(target.candidates)} candidates that fit; a SageMaker tuning job tries at most "
            f"{MAX_CATEGORICAL_VALUES} (values of one categorical hyperparameter): narrow search.space or give "
            f"search.by_instance_type.{target.instance_type} fewer values"
        )
    if max_parallel_jobs < 1:
        raise TuningRequestError(f"search: {where}: max_parallel_jobs must be at least 1")
    ordered = [by_name[name] for name in target.candidates]
    first = ordered[0]
    run_id = first.run_id
    name = tuning_job_name(run_id, target.target_index)
    static = static_hyperparameters(ordered, where)
    static.update(
        {
            "job_name": name,  # each trial replaces it with its own (TRAINING_JOB_NAME in the container)
            PRICE_HYPERPARAMETER: repr(objective_price_per_hour(first)),
            OBJECTIVE_STEPS_HYPERPARAMETER: str(search.min_timed_steps),
        }
    )
    runtime = max(s.max_runtime_seconds for s in ordered)
    stopping: dict[str, int] = {"MaxRuntimeInSeconds": runtime}
    if first.spot:
        stopping["MaxWaitTimeInSeconds"] = max_wait_seconds(runtime, spot_max_wait_seconds)
    # Channels, output path, image, metrics, environment and tags exactly as a training job of the same target
    base = training_job_request(first, settings, data, enable_network_isolation=enable_network_isolation)
    environment = {k: v for k, v in base["Environment"].items() if k != "GPUSCOUT_JOB_NAME"}
    strategy_name, early_stopping = strategy(search, target)
    trials = len(target.candidates) if strategy_name == "Grid" else min(target.max_trials, len(target.candidates))
    config: dict[str, Any] = {
        "Strategy": strategy_name,
        "HyperParameterTuningJobObjective": {"Type": "Minimize", "MetricName": OBJECTIVE_METRIC},
        "ResourceLimits": {
            "MaxNumberOfTrainingJobs": trials,
            "MaxParallelTrainingJobs": min(max_parallel_jobs, trials),
        },
        "ParameterRanges": {
            "CategoricalParameterRanges": [{"Name": CANDIDATE_HYPERPARAMETER, "Values": list(target.candidates)}]
        },
        "TrainingJobEarlyStoppingType": early_stopping,
        "RandomSeed": search.seed,
    }
    return {
        "HyperParameterTuningJobName": name,
        "HyperParameterTuningJobConfig": config,
        "TrainingJobDefinition": {
            "StaticHyperParameters": static,
            "AlgorithmSpecification": base["AlgorithmSpecification"],
            "RoleArn": base["RoleArn"],
            "InputDataConfig": base["InputDataConfig"],
            "OutputDataConfig": base["OutputDataConfig"],
            "ResourceConfig": base["ResourceConfig"],
            "StoppingCondition": stopping,
            # one prefix for the tuning job (train.py keeps each trial in its own folder under it); a cloud search
            # with checkpoints is refused (sources.search_problems): each trial would download all the others
            "CheckpointConfig": {**base["CheckpointConfig"], "S3Uri": checkpoint_uri(settings, run_id, name)},
            "EnableManagedSpotTraining": first.spot,
            "EnableNetworkIsolation": enable_network_isolation,
            "Environment": environment,
        },
        "Tags": base["Tags"],  # SageMaker adds a tuning job's tags to every trial: the run id reaches job_events
    }


def search_target(target: TargetSearch, specs: Sequence[JobSpec], search: SearchPlan) -> SearchTarget:
    """The file the plan step writes next to a tuning job (:func:`search_target_key`)."""
    run_id = specs[0].run_id
    return SearchTarget(
        run_id=run_id,
        tuning_job_name=tuning_job_name(run_id, target.target_index),
        target_index=target.target_index,
        instance_type=target.instance_type,
        early_stopping=strategy(search, target)[1] == "Auto",
        candidates={s.variant_name: s for s in specs},
    )
