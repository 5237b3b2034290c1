"""The plan's requests live in S3, not in the execution's state.

plan_jobs writes each list of requests it built (canaries, jobs, tunings: ``[{"job_name", "request", ...}]``) as one
JSON array to ``s3://<artifacts>/plans/<run_id>/<kind>.json``; the state carries only where each list is and how
long it is (``{"bucket", "<kind>": {"key", "count"}}``). Each fan-out is a Distributed Map whose ItemReader reads that
object, so every child workflow gets one request (its input) and keeps its own history: no state of the parent grows
with the number of jobs, and the parent's history stays a few dozen events whatever the run's size.

What is left that grows with a run, and its limit:
- One item is one child workflow's input, to which the child adds the run's status, the job's ARN and, on failure,
  the caught error (a Cause of at most 32,768 characters): an item is at most MAX_ITEM_BYTES, so a child's state
  stays under Step Functions' 256 KiB.
- A run makes at most MAX_REQUESTS_PER_RUN SageMaker requests (jobs, canaries and tuning jobs together): the size
  the synthesized state machine is executed with in tests/integration/test_state_machine.py
  (test_a_thousand_request_plan_runs_with_every_payload_measured), every state's payload measured there. Nothing
  larger has been run, so nothing larger is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.cloud.contract import ItemList, PlanItems
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.names import PLANS_PREFIX  # plan_jobs writes here, the state machine reads here
from gpuscout.errors import GpuscoutError, Problem

ITEM_KINDS = ("canaries", "jobs", "tunings")
STATE_PAYLOAD_LIMIT_BYTES = 256 * 1024
# Room a child workflow adds to its item: the caught error (a Cause is at most 32,768 characters), the run's status,
# the job's ARN, and JSON framing.
CHILD_STATE_ROOM_BYTES = 64 * 1024
MAX_ITEM_BYTES = STATE_PAYLOAD_LIMIT_BYTES - CHILD_STATE_ROOM_BYTES
MAX_REQUESTS_PER_RUN = 1000


class PlanItemsError(GpuscoutError):
    """The plan's request lists could not be written or read."""


def items_key(run_id: str, kind: str) -> str:
    return f"{PLANS_PREFIX}{run_id}/{kind}.json"


def item_size(item: Mapping[str, Any]) -> int:
    return len(json.dumps(item, separators=(",", ":")).encode())


def oversized_items(items: Mapping[str, Sequence[Mapping[str, Any]]], limit: int = MAX_ITEM_BYTES) -> list[str]:
    """One line per item over ``limit`` bytes (its name and size)."""
    return [
        f"{item['job_name']} ({size / 1024:.0f} KiB)"
        for listed in items.values()
        for item in listed
        if (size := item_size(item)) > limit
    ]


def write_plan_items(s3: Any, bucket: str, run_id: str, items: Mapping[str, Sequence[Mapping[str, Any]]]) -> PlanItems:
    """Write every list of ``items`` (keys: ITEM_KINDS) and return the state's reference to them."""
    written: dict[str, ItemList] = {}
    for kind in ITEM_KINDS:
        listed = list(items.get(kind, ()))
        key = items_key(run_id, kind)
        try:
            s3.put_object(
                Bucket=bucket,
                Key=key,
                Body=json.dumps(listed, separators=(",", ":")).encode(),
                ContentType="application/json",
            )
        except (ClientError, BotoCoreError) as err:
            raise PlanItemsError(f"cannot write s3://{bucket}/{key}: {err}") from err
        written[kind] = ItemList(key=key, count=len(listed))
    return PlanItems(bucket=bucket, **written)


def request_count_problems(specs: Sequence[JobSpec], *, search_targets: int | None, canaries: int) -> list[Problem]:
    """Whether the SageMaker requests the state machine iterates over fit a run: the ``canaries`` planned
    (gpuscout.plan.canary.cloud_canaries), then one training job per spec, or for a search one tuning job per target
    instead (its trials are started by SageMaker, not by the state machine)."""
    jobs = search_targets if search_targets is not None else len(specs)
    count = canaries + jobs
    if count <= MAX_REQUESTS_PER_RUN:
        return []
    kind = "tuning" if search_targets is not None else "benchmark"
    return [
        Problem(
            "targets x variants x repetitions",
            f"the run would start {count} SageMaker jobs ({jobs} {kind} jobs and {count - jobs} canaries, one per "
            f"distinct configuration); a cloud run takes at most {MAX_REQUESTS_PER_RUN}, the largest plan the state "
            "machine has been run with; split the manifest into several (each its own run) or lower repetitions",
        )
    ]
