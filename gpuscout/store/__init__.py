"""Result stores: one protocol (base.ResultStore), SQLite locally, DynamoDB in the cloud.

May import: gpuscout.domain, gpuscout.errors, gpuscout.paths (and boto3 in dynamodb.py, sqlite3 in sqlite.py).
"""

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
