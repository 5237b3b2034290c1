"""What every Lambda handler shares: Powertools' logger, tracer and metrics, made once, and the decorators each
handler wears (lambdas/<name>/handler.py: ``@lambda_handler()`` above its parser).

One of each per process is what Powertools expects (a Lambda runs one handler), and a handler imports the three names
it uses from here. Imported only by the Lambda handlers (the local face never loads Powertools)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from aws_lambda_powertools import Logger, Metrics, Tracer

from gpuscout.domain.names import METRIC_NAMESPACE

logger = Logger()
tracer = Tracer()
metrics = Metrics(namespace=METRIC_NAMESPACE)

Handler = TypeVar("Handler", bound=Callable[..., Any])


def lambda_handler(*, flush_metrics: bool = True) -> Callable[[Handler], Handler]:
    """The invocation's context in every log line, an X-Ray segment around it and, with ``flush_metrics``, the
    metrics it added flushed when it returns (job_events emits single metrics instead: no flush to warn about)."""

    def wear(handler: Handler) -> Handler:
        inner = metrics.log_metrics(handler) if flush_metrics else handler
        return cast(Handler, logger.inject_lambda_context(tracer.capture_lambda_handler(inner)))

    return wear
