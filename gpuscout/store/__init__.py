"""Result stores: one protocol (base.ResultStore), SQLite locally, DynamoDB in the cloud."""

from gpuscout.store.base import (
    JOB_STATUS_RANK,
    JobRecord,
    JobStatus,
    ResultRecord,
    ResultStore,
    RunRecord,
    RunStatus,
)

__all__ = [
    "JOB_STATUS_RANK",
    "JobRecord",
    "JobStatus",
    "ResultRecord",
    "ResultStore",
    "RunRecord",
    "RunStatus",
]
