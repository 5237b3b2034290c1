"""DynamoDB ResultStore: the single-table design of docs/internals.md ("Cloud contract").

Rows (``pk``/``sk`` strings):

- RUN     ``pk=RUN#<run_id>, sk=RUN``             + ``gsi1pk="RUNS"``, ``gsi1sk=<created_at>`` (runs newest first)
- JOB     ``pk=RUN#<run_id>, sk=JOB#<job_name>``  + ``gsi2pk=JOB#<job_name>`` (a job's run, from an event)
- RESULT  ``pk=RUN#<run_id>, sk=RESULT``

Every record field is its own attribute (native DynamoDB types; floats as Numbers), so single fields can be
updated in place. ``last_event_time`` is stored as a Number (epoch microseconds) so the order-safety condition of
``apply_job_event`` compares instants, not strings.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, TypeVar

import boto3
from boto3.dynamodb.types import TypeDeserializer, TypeSerializer
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import BaseModel, TypeAdapter, ValidationError

from gpuscout.errors import RunExistsError, RunNotFoundError, StoreError
from gpuscout.store.base import (
    JOB_STATUS_RANK,
    TERMINAL_JOB_STATUSES,
    JobRecord,
    JobStatus,
    ResultRecord,
    RunRecord,
    RunStatus,
    outdated_result,
    utcnow,
)

RUNS_INDEX = "gsi1"
JOBS_INDEX = "gsi2"
_TERMINAL_RANK = min(JOB_STATUS_RANK[s] for s in TERMINAL_JOB_STATUSES)
_KEY_ATTRIBUTES = frozenset({"pk", "sk", "gsi1pk", "gsi1sk", "gsi2pk"})
_EVENT_TIME_FIELD = "last_event_time"

_serializer = TypeSerializer()
_deserializer = TypeDeserializer()

M = TypeVar("M", bound=BaseModel)


def _run_pk(run_id: str) -> str:
    return f"RUN#{run_id}"


def _job_sk(job_name: str) -> str:
    return f"JOB#{job_name}"


def _sortable_time(value: datetime) -> str:
    """A fixed-width UTC timestamp whose string order is time order (the runs index sort key)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _epoch_us(value: datetime) -> int:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    delta = value - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _from_epoch_us(value: int) -> datetime:
    return datetime.fromtimestamp(value // 1_000_000, tz=UTC).replace(microsecond=value % 1_000_000)


def _to_dynamo_value(value: Any) -> dict[str, Any]:
    """JSON-compatible value -> DynamoDB attribute value (floats become exact decimal Numbers)."""
    native = json.loads(json.dumps(value), parse_float=Decimal)
    return dict(_serializer.serialize(native))


def _from_dynamo_number(value: object) -> object:
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {k: _from_dynamo_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_dynamo_number(v) for v in value]
    return value


def _encode_fields(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """model_dump(mode="json") fields -> attribute values; None fields are left out."""
    out: dict[str, dict[str, Any]] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name == _EVENT_TIME_FIELD:
            out[name] = {"N": str(_epoch_us(datetime.fromisoformat(value)))}
        else:
            out[name] = _to_dynamo_value(value)
    return out


def _conditional_check_failed(err: ClientError) -> bool:
    return bool(err.response.get("Error", {}).get("Code") == "ConditionalCheckFailedException")


def _decode_item(item: dict[str, Any], model: type[M]) -> M:
    data: dict[str, Any] = {}
    for name, attr in item.items():
        if name in _KEY_ATTRIBUTES:
            continue
        value = _from_dynamo_number(_deserializer.deserialize(attr))
        if name == _EVENT_TIME_FIELD and isinstance(value, int | float):
            value = _from_epoch_us(int(value))
        data[name] = value
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise StoreError(f"stored {model.__name__} row {item.get('pk')}/{item.get('sk')} is invalid: {err}") from err


@functools.cache
def _job_field(name: str) -> TypeAdapter[Any]:
    """One JobRecord field's type with its constraints: a job event's fields are checked as the row holds them."""
    info = JobRecord.model_fields[name]
    annotated: Any = Annotated[info.annotation, *info.metadata] if info.metadata else info.annotation
    return TypeAdapter(annotated)


BATCH_WRITE_ITEMS = 25  # DynamoDB BatchWriteItem: at most 25 put or delete requests per call
BATCH_WRITE_ATTEMPTS = 8


class DynamoDbStore:
    """ResultStore on one DynamoDB table (created by the CDK stack; see stacks/)."""

    def __init__(self, table_name: str, client: Any | None = None, *, sleep: Any = time.sleep) -> None:
        self.table_name = table_name
        self._client = client if client is not None else boto3.client("dynamodb")
        self._sleep = sleep

    # -- low level ---------------------------------------------------------------------------------------------

    def _call(self, operation: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response: dict[str, Any] = getattr(self._client, operation)(TableName=self.table_name, **kwargs)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code == "ConditionalCheckFailedException":
                raise
            raise StoreError(f"DynamoDB {operation} on table {self.table_name!r} failed: {code or err}") from err
        except BotoCoreError as err:
            raise StoreError(f"DynamoDB {operation} on table {self.table_name!r} failed: {err}") from err
        return response

    def _get_item(self, pk: str, sk: str) -> dict[str, Any] | None:
        response = self._call("get_item", Key={"pk": {"S": pk}, "sk": {"S": sk}}, ConsistentRead=True)
        item: dict[str, Any] | None = response.get("Item")
        return item

    def _query_all(self, **kwargs: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        while True:
            response = self._call("query", **kwargs)
            items.extend(response.get("Items", []))
            last = response.get("LastEvaluatedKey")
            if not last:
                return items
            kwargs["ExclusiveStartKey"] = last

    # -- runs --------------------------------------------------------------------------------------------------

    def _run_item(self, run: RunRecord) -> dict[str, Any]:
        item = _encode_fields(run.model_dump(mode="json"))
        item.update(
            pk={"S": _run_pk(run.run_id)},
            sk={"S": "RUN"},
            gsi1pk={"S": "RUNS"},
            gsi1sk={"S": f"{_sortable_time(run.created_at)}#{run.run_id}"},
        )
        return item

    def put_run(self, run: RunRecord) -> None:
        self._call("put_item", Item=self._run_item(run))

    def get_run(self, run_id: str) -> RunRecord:
        item = self._get_item(_run_pk(run_id), "RUN")
        if item is None:
            raise RunNotFoundError(run_id)
        return _decode_item(item, RunRecord)

    def list_runs(self, limit: int = 50) -> list[RunRecord]:
        """The newest ``limit`` runs. Paged: a query returns at most 1 MB, and run items carry their manifest and
        search plan, so one page can hold fewer runs than asked for (and the budget check would miss a run)."""
        items: list[dict[str, Any]] = []
        start: dict[str, Any] | None = None
        while len(items) < limit:
            page = self._call(
                "query",
                IndexName=RUNS_INDEX,
                KeyConditionExpression="gsi1pk = :runs",
                ExpressionAttributeValues={":runs": {"S": "RUNS"}},
                ScanIndexForward=False,
                Limit=limit - len(items),
                **({"ExclusiveStartKey": start} if start else {}),
            )
            items += page.get("Items", [])
            start = page.get("LastEvaluatedKey")
            if not start:
                break
        return [_decode_item(item, RunRecord) for item in items[:limit]]

    def create_run(self, run: RunRecord, *, replace: Collection[RunStatus] = ()) -> None:
        condition = "attribute_not_exists(pk)"
        values: dict[str, Any] = {}
        if replace:
            values = {f":r{i}": {"S": RunStatus(status).value} for i, status in enumerate(replace)}
            condition += f" OR #status IN ({', '.join(values)})"
        kwargs: dict[str, Any] = {"ConditionExpression": condition}
        if values:
            kwargs.update(ExpressionAttributeNames={"#status": "status"}, ExpressionAttributeValues=values)
        try:
            self._call("put_item", Item=self._run_item(run), **kwargs)
        except ClientError as err:
            if not _conditional_check_failed(err):
                raise
            existing = self._get_item(_run_pk(run.run_id), "RUN") or {}
            raise RunExistsError(run.run_id, str(existing.get("status", {}).get("S", "unknown"))) from err

    def update_run(self, run_id: str, *, unless_status: Collection[RunStatus] = (), **fields: Any) -> RunRecord:
        current = self.get_run(run_id)
        unknown = set(fields) - set(RunRecord.model_fields)
        if unknown:
            raise StoreError(f"unknown run field(s): {', '.join(sorted(unknown))}")
        if current.status in set(unless_status):
            return current
        try:
            updated = RunRecord.model_validate({**current.model_dump(), **fields, "updated_at": utcnow()})
        except ValidationError as err:
            raise StoreError(f"invalid update of run {run_id!r}: {err}") from err
        # Only the given fields (and updated_at) are written: a concurrent writer's other fields survive.
        dumped = updated.model_dump(mode="json")
        changed = [*fields, "updated_at"]
        names = {f"#f{i}": name for i, name in enumerate(changed)}
        values: dict[str, Any] = {}
        sets: list[str] = []
        removes: list[str] = []
        for alias, name in names.items():
            encoded = _encode_fields({name: dumped[name]})
            if name in encoded:
                values[f":v{alias[2:]}"] = encoded[name]
                sets.append(f"{alias} = :v{alias[2:]}")
            else:
                removes.append(alias)
        if "created_at" in fields:  # the runs index sorts by it
            names["#gsi1sk"] = "gsi1sk"
            values[":gsi1sk"] = {"S": f"{_sortable_time(updated.created_at)}#{run_id}"}
            sets.append("#gsi1sk = :gsi1sk")
        condition = "attribute_exists(pk)"
        if unless_status:
            names["#status_now"] = "status"
            guards = {f":u{i}": {"S": RunStatus(status).value} for i, status in enumerate(unless_status)}
            values.update(guards)
            condition += f" AND NOT #status_now IN ({', '.join(guards)})"
        expression = ("SET " + ", ".join(sets) if sets else "") + (" REMOVE " + ", ".join(removes) if removes else "")
        try:
            self._call(
                "update_item",
                Key={"pk": {"S": _run_pk(run_id)}, "sk": {"S": "RUN"}},
                UpdateExpression=expression.strip(),
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        except ClientError as err:
            if not _conditional_check_failed(err):
                raise
            now = self.get_run(run_id)  # RunNotFoundError when it is gone
            if now.status in set(unless_status):
                return now
            raise StoreError(f"update of run {run_id!r} was refused: {err}") from err
        return updated

    # -- jobs --------------------------------------------------------------------------------------------------

    def _job_item(self, job: JobRecord) -> dict[str, Any]:
        item = _encode_fields(job.model_dump(mode="json"))
        item.update(
            pk={"S": _run_pk(job.run_id)},
            sk={"S": _job_sk(job.job_name)},
            gsi2pk={"S": _job_sk(job.job_name)},
        )
        return item

    def put_job(self, job: JobRecord) -> None:
        self._call("put_item", Item=self._job_item(job))

    def put_jobs(self, jobs: Sequence[JobRecord]) -> None:
        """BatchWriteItem, BATCH_WRITE_ITEMS rows per request (a 1,000-job plan: 40 requests instead of 1,000 PutItem
        calls); rows DynamoDB leaves unprocessed (throttling) are sent again with backoff, and a StoreError says how
        many were left when they still are after BATCH_WRITE_ATTEMPTS."""
        items: list[Any] = [{"PutRequest": {"Item": self._job_item(job)}} for job in jobs]
        for start in range(0, len(items), BATCH_WRITE_ITEMS):
            pending: list[Any] = items[start : start + BATCH_WRITE_ITEMS]
            for attempt in range(BATCH_WRITE_ATTEMPTS):
                try:
                    response = self._client.batch_write_item(RequestItems={self.table_name: pending})
                except (ClientError, BotoCoreError) as err:
                    raise StoreError(f"DynamoDB batch_write_item on table {self.table_name!r} failed: {err}") from err
                pending = response.get("UnprocessedItems", {}).get(self.table_name, [])
                if not pending:
                    break
                self._sleep(min(0.05 * 2**attempt, 2.0))
            else:
                raise StoreError(
                    f"DynamoDB batch_write_item on table {self.table_name!r} left {len(pending)} row(s) unprocessed "
                    f"after {BATCH_WRITE_ATTEMPTS} attempts (throttled)"
                )

    def create_job(self, job: JobRecord) -> bool:
        try:
            self._call("put_item", Item=self._job_item(job), ConditionExpression="attribute_not_exists(pk)")
        except ClientError as err:
            if _conditional_check_failed(err):
                return False
            raise
        return True

    def get_job(self, run_id: str, job_name: str) -> JobRecord | None:
        item = self._get_item(_run_pk(run_id), _job_sk(job_name))
        return None if item is None else _decode_item(item, JobRecord)

    def list_jobs(self, run_id: str) -> list[JobRecord]:
        items = self._query_all(
            KeyConditionExpression="pk = :pk AND begins_with(sk, :job)",
            ExpressionAttributeValues={":pk": {"S": _run_pk(run_id)}, ":job": {"S": "JOB#"}},
            ConsistentRead=True,
        )
        return [_decode_item(item, JobRecord) for item in items]

    def find_run_id(self, job_name: str) -> str | None:
        """The run a job belongs to (gsi2), for events whose tags were lost; None when unknown."""
        response = self._call(
            "query",
            IndexName=JOBS_INDEX,
            KeyConditionExpression="gsi2pk = :job",
            ExpressionAttributeValues={":job": {"S": _job_sk(job_name)}},
            Limit=1,
        )
        items = response.get("Items", [])
        if not items:
            return None
        return str(items[0]["pk"]["S"]).removeprefix("RUN#")

    def apply_job_event(
        self,
        run_id: str,
        job_name: str,
        status: JobStatus,
        event_time: datetime,
        **fields: Any,
    ) -> bool:
        """One conditional UpdateItem: applied only when newer (or equally new and higher ranked) and never
        turning a terminal status back into a live one. A lost race or a stale event returns False."""
        forbidden = {"run_id", "job_name", "status", "status_rank", _EVENT_TIME_FIELD} & set(fields)
        unknown = set(fields) - set(JobRecord.model_fields)
        if forbidden or unknown:
            raise StoreError(f"apply_job_event cannot set field(s): {', '.join(sorted(forbidden | unknown))}")
        status = JobStatus(status)
        rank = JOB_STATUS_RANK[status]
        try:
            # Validate the carried fields exactly as a JobRecord would hold them.
            checked = {name: _job_field(name).dump_python(_job_field(name).validate_python(value), mode="json")
                       for name, value in fields.items()}  # fmt: skip
        except ValidationError as err:
            raise StoreError(f"invalid job event fields for {job_name!r}: {err}") from err

        names = {"#status": "status", "#rank": "status_rank", "#t": _EVENT_TIME_FIELD, "#u": "updated_at"}
        values: dict[str, dict[str, Any]] = {
            ":s": {"S": status.value},
            ":r": {"N": str(rank)},
            ":t": {"N": str(_epoch_us(event_time))},
            ":u": _to_dynamo_value(_sortable_time(utcnow())),
        }
        sets = ["#status = :s", "#rank = :r", "#t = :t", "#u = :u"]
        removes: list[str] = []
        for index, (name, value) in enumerate(sorted(checked.items())):
            names[f"#f{index}"] = name
            if value is None:
                removes.append(f"#f{index}")
            else:
                values[f":f{index}"] = _to_dynamo_value(value)
                sets.append(f"#f{index} = :f{index}")
        update = "SET " + ", ".join(sets) + (" REMOVE " + ", ".join(removes) if removes else "")
        condition = "attribute_exists(pk) AND (attribute_not_exists(#t) OR #t < :t OR (#t = :t AND #rank < :r))"
        if rank < _TERMINAL_RANK:
            values[":terminal"] = {"N": str(_TERMINAL_RANK)}
            condition += " AND (attribute_not_exists(#rank) OR #rank < :terminal)"
        try:
            self._call(
                "update_item",
                Key={"pk": {"S": _run_pk(run_id)}, "sk": {"S": _job_sk(job_name)}},
                UpdateExpression=update,
                ConditionExpression=condition,
                ExpressionAttributeNames=names,
                ExpressionAttributeValues=values,
            )
        except ClientError:  # _call re-raises only ConditionalCheckFailedException
            return False
        return True

    # -- results -----------------------------------------------------------------------------------------------

    def put_result(self, result: ResultRecord) -> None:
        item = _encode_fields(result.model_dump(mode="json"))
        item.update(pk={"S": _run_pk(result.run_id)}, sk={"S": "RESULT"})
        self._call("put_item", Item=item)

    def get_result(self, run_id: str) -> ResultRecord | None:
        item = self._get_item(_run_pk(run_id), "RESULT")
        try:
            return None if item is None else _decode_item(item, ResultRecord)
        except StoreError as err:
            remedy = (
                "read it with the gpuscout version the stack runs, or analyse it again there: invoke the stack's "
                f'analyze_run function with {{"run_id": "{run_id}"}}'
            )
            raise StoreError(outdated_result(run_id, err, remedy=remedy)) from err


def table_definition(table_name: str) -> dict[str, Any]:
    """CreateTable arguments matching the stack's table (used by tests against moto)."""
    string = "S"
    return {
        "TableName": table_name,
        "BillingMode": "PAY_PER_REQUEST",
        "AttributeDefinitions": [
            {"AttributeName": name, "AttributeType": string} for name in ("pk", "sk", "gsi1pk", "gsi1sk", "gsi2pk")
        ],
        "KeySchema": [{"AttributeName": "pk", "KeyType": "HASH"}, {"AttributeName": "sk", "KeyType": "RANGE"}],
        "GlobalSecondaryIndexes": [
            {
                "IndexName": RUNS_INDEX,
                "KeySchema": [
                    {"AttributeName": "gsi1pk", "KeyType": "HASH"},
                    {"AttributeName": "gsi1sk", "KeyType": "RANGE"},
                ],
                "Projection": {"ProjectionType": "ALL"},
            },
            {
                "IndexName": JOBS_INDEX,
                "KeySchema": [{"AttributeName": "gsi2pk", "KeyType": "HASH"}],
                "Projection": {"ProjectionType": "KEYS_ONLY"},
            },
        ],
    }
