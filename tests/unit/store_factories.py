"""Every ResultStore implementation the shared contract suite (test_store_contract.py) runs against.

Each factory is a context manager taking a fresh temporary folder and yielding an empty store; a store that
needs a mocked service (DynamoDB via moto) keeps the mock active inside its ``with`` block. Add a store by
adding an entry to STORE_FACTORIES.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import boto3
from moto import mock_aws

from gpuscout.store.base import ResultStore
from gpuscout.store.dynamodb import DynamoDbStore, table_definition
from gpuscout.store.sqlite import SqliteStore


@contextmanager
def sqlite_store(tmp_path: Path) -> Iterator[ResultStore]:
    yield SqliteStore(tmp_path / "contract.db")


@contextmanager
def dynamodb_store(tmp_path: Path) -> Iterator[ResultStore]:
    with mock_aws():
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(**table_definition("gpuscout-contract"))
        yield DynamoDbStore("gpuscout-contract", client=client)


STORE_FACTORIES: dict[str, Callable[[Path], AbstractContextManager[ResultStore]]] = {
    "sqlite": sqlite_store,
    "dynamodb": dynamodb_store,
}
