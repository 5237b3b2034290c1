"""Quota pre-flight: the account's SageMaker training quotas against what a plan will ask for, before anything runs.

A new AWS account starts with the GPU training quotas at 0: a run whose jobs (or canaries) need one waits in the
state machine's quota retries for hours and then fails. Each instance type has two quotas, named by SageMaker as
``<type> for training job usage`` (on-demand) and ``<type> for spot training job usage`` (managed spot), counted in
instances running at once in the region. ``QuotaBook`` reads them all with Service Quotas ListServiceQuotas (service
code ``sagemaker``; AWS's defaults from ListAWSDefaultServiceQuotas under the account's applied values, since the
listing leaves out quotas never changed; cached per region for ``CACHE_SECONDS``), and ``check`` turns a plan's needs
into refusals (a needed quota is 0, or smaller than one job's instance count: the job could never start) and warnings
(the run would start more instances of a type at once than the quota allows: jobs wait for each other).

Where Service Quotas cannot be read (no permission, an unknown region) the check says so as a warning and refuses
nothing: the quota retries of the workflow still apply.

May import: gpuscout.domain, gpuscout.errors and gpuscout.plan."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.domain.jobspec import JobSpec
from gpuscout.errors import Problem

SERVICE_CODE = "sagemaker"
CACHE_SECONDS = 900.0
# (region, names asked for) -> (read at, quota name -> quota)
_CACHE: dict[tuple[str, tuple[str, ...]], tuple[float, dict[str, Quota]]] = {}


def training_quota_name(instance_type: str, *, spot: bool) -> str:
    """SageMaker's name of the quota that limits training jobs of ``instance_type`` (instances at once)."""
    return f"{instance_type} for {'spot ' if spot else ''}training job usage"


def console_url(region: str, code: str) -> str:
    """Where a quota increase is requested."""
    return f"https://{region}.console.aws.amazon.com/servicequotas/home/services/{SERVICE_CODE}/quotas/{code}"


@dataclass(frozen=True)
class Quota:
    name: str
    code: str
    value: float
    source: str = "list_service_quotas"  # the operation the value came from (a default may be confirmed)


@dataclass(frozen=True)
class Need:
    """What a plan asks of one quota: the largest single job and the most instances it would run at once."""

    instance_type: str
    spot: bool
    per_job: int  # instances one job of this kind needs (its instance_count)
    at_once: int  # instances the run would start at once (jobs x count, up to the Map's concurrency)
    what: str  # who needs it, for the message ("targets[0] ml.p5.48xlarge", "the canaries")
    parallel_trials: bool = False  # a search's tuning trials: SageMaker fails (not queues) a trial over the quota

    @property
    def quota_name(self) -> str:
        return training_quota_name(self.instance_type, spot=self.spot)


def plan_needs(
    jobs: Sequence[JobSpec],
    *,
    concurrency: int,
    canary_instance_type: str | None,
    max_parallel_trials: int | None = None,
    canaries: Sequence[JobSpec] | None = None,
) -> list[Need]:
    """The quotas a plan's jobs need (per instance type and purchase option) and, when canaries run, the canary
    type's on-demand quota (one instance per canary; at most one canary per job, up to ``concurrency`` at once).
    A search (``max_parallel_trials`` given) runs that many trials of a target at once, within ``concurrency``."""
    search = max_parallel_trials is not None
    if search:
        concurrency = min(concurrency, max_parallel_trials or 1)
    groups: dict[tuple[str, bool], list[JobSpec]] = {}
    for job in jobs:
        groups.setdefault((job.instance_type, job.spot), []).append(job)
    needs = []
    for (instance_type, spot), group in groups.items():
        per_job = max(j.instance_count for j in group)
        busiest = sorted((j.instance_count for j in group), reverse=True)[: max(1, concurrency)]
        targets = sorted({j.target_index for j in group})
        what = ", ".join(f"targets[{t}]" for t in targets) + f" {instance_type}{' (spot)' if spot else ''}"
        needs.append(
            Need(instance_type, spot, per_job=per_job, at_once=sum(busiest), what=what, parallel_trials=search)
        )
    if canaries is not None:  # where each canary was placed (a canary too big for the canary type runs on its job's)
        by_type: dict[tuple[str, bool], int] = {}
        for canary in canaries:
            by_type[(canary.instance_type, canary.spot)] = by_type.get((canary.instance_type, canary.spot), 0) + 1
        for (instance_type, spot), count in by_type.items():
            what = "the canaries" if instance_type == canary_instance_type else "canaries too large for the canary type"
            needs.append(Need(instance_type, spot, per_job=1, at_once=min(count, max(1, concurrency)), what=what))
    elif canary_instance_type and jobs:  # the canaries' Map runs up to `concurrency` at once, one instance each
        needs.append(
            Need(
                canary_instance_type, False, per_job=1, at_once=min(len(jobs), max(1, concurrency)), what="the canaries"
            )
        )
    return needs


class QuotasUnreadableError(Exception):
    """The quotas could not be read within the time the caller allows."""


class QuotaBook:
    """The region's SageMaker quotas by name: the account's applied values (ListServiceQuotas) over AWS's defaults
    (ListAWSDefaultServiceQuotas, read only for names the applied listing lacks), cached for CACHE_SECONDS. Reading
    stops as soon as every name asked for is found, and gives up after ``budget_s`` seconds (a Lambda step has a
    minute)."""

    def __init__(self, client: Any, *, clock: Any = time.monotonic, budget_s: float = 20.0) -> None:
        self._client = client
        self._clock = clock
        self._budget_s = budget_s
        self.region = str(client.meta.region_name)

    def _read(self, operation: str, wanted: set[str], found: dict[str, Quota], started: float) -> None:
        pages = self._client.get_paginator(operation).paginate(
            ServiceCode=SERVICE_CODE, PaginationConfig={"PageSize": 100}
        )
        for page in pages:
            for q in page.get("Quotas", []):
                if "QuotaName" in q and "QuotaCode" in q and "Value" in q and q["QuotaName"] not in found:
                    found[q["QuotaName"]] = Quota(q["QuotaName"], q["QuotaCode"], float(q["Value"]), operation)
            if wanted and wanted <= found.keys():
                return
            if self._clock() - started > self._budget_s:
                raise QuotasUnreadableError(f"{operation} took over {self._budget_s:g} s")

    def quotas(self, wanted: Sequence[str] = (), *, fresh: bool = False) -> dict[str, Quota]:
        """The quotas named in ``wanted`` (all of them when empty) that exist in the region."""
        key = (self.region, tuple(sorted(wanted)))
        cached = _CACHE.get(key)
        if not fresh and cached is not None and self._clock() - cached[0] < CACHE_SECONDS:
            return cached[1]
        started = self._clock()
        found: dict[str, Quota] = {}
        self._read("list_service_quotas", set(wanted), found, started)
        if not wanted or not set(wanted) <= found.keys():
            defaults: dict[str, Quota] = {}
            self._read("list_aws_default_service_quotas", set(wanted) - found.keys(), defaults, started)
            found = {**defaults, **found}
        _CACHE[key] = (self._clock(), found)
        return found

    def confirm(self, quota: Quota) -> Quota:
        """A default-only value checked with GetServiceQuota (the account's applied value, where one exists)."""
        try:
            applied = self._client.get_service_quota(ServiceCode=SERVICE_CODE, QuotaCode=quota.code)["Quota"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") == "NoSuchResourceException":
                return quota  # no applied value: AWS's default is the account's
            raise
        return Quota(quota.name, quota.code, float(applied.get("Value", quota.value)), "get_service_quota")


def check(needs: Sequence[Need], book: QuotaBook) -> tuple[list[Problem], list[str]]:
    """Refusals (as manifest problems: the field is the target) and warnings for a plan's needs. A refusal stands on
    a fresh read (not the cache: a quota may have been raised since) and, for a value only AWS's default gave, on
    GetServiceQuota's answer."""
    wanted = sorted({n.quota_name for n in needs})
    try:
        quotas = book.quotas(wanted)
        if any(n.quota_name in quotas and quotas[n.quota_name].value < n.per_job for n in needs):
            quotas = book.quotas(wanted, fresh=True)
    except (ClientError, BotoCoreError, QuotasUnreadableError) as err:
        return [], [_unreadable(book, err)]
    problems: list[Problem] = []
    warnings: list[str] = []
    for need in needs:
        quota = quotas.get(need.quota_name)
        field = need.what.split(" ")[0] if need.what.startswith("targets[") else "canary"
        if quota is None:
            warnings.append(
                f"{need.what}: no quota named {need.quota_name!r} in {book.region} (is the type offered there?); "
                f"{UNCHECKED}"
            )
            continue
        where = f"request an increase at {console_url(book.region, quota.code)}"
        if quota.value < need.per_job and quota.source == "list_aws_default_service_quotas":
            try:
                quota = book.confirm(quota)
            except (ClientError, BotoCoreError) as err:
                warnings.append(
                    f"{need.what}: {quota.name!r} is {quota.value:g} by AWS's default; {_unreadable(book, err)}"
                )
                continue
        if quota.value < need.per_job:
            problems.append(
                Problem(
                    field,
                    f"{need.what}: the account's quota {quota.name!r} ({quota.code}) is {quota.value:g} in "
                    f"{book.region}, and one job needs {need.per_job} instance(s): it could never start; {where}",
                )
            )
        elif quota.value < need.at_once and need.parallel_trials:
            fits = int(quota.value) // need.per_job
            problems.append(
                Problem(
                    "search.max_parallel_trials",
                    f"{need.what}: {need.at_once} instance(s) of parallel trials at once, but the quota {quota.name!r} "
                    f"({quota.code}) is {quota.value:g} in {book.region}, and a tuning trial over it fails instead of "
                    f"waiting: set search.max_parallel_trials to {max(1, fits)}, or {where}",
                )
            )
        elif quota.value < need.at_once:
            warnings.append(
                f"{need.what}: the run would start {need.at_once} instance(s) at once; the quota {quota.name!r} "
                f"allows {quota.value:g}, so jobs wait for each other ({where})"
            )
    return problems, warnings


UNCHECKED = "the run is not checked against them"  # ends every warning that leaves a quota unchecked


def all_checked(warnings: Sequence[str]) -> bool:
    """Whether check()'s warnings leave every needed quota checked (a warning may only say that jobs will wait)."""
    return not any(w.endswith(UNCHECKED) for w in warnings)


def _unreadable(book: QuotaBook, err: Exception) -> str:
    return (
        f"could not read the account's SageMaker quotas in {book.region} (Service Quotas: "
        f"{str(err).splitlines()[0]}); {UNCHECKED}"
    )
