"""The cloud's ``workflow.ports.Notifier``: the stack's SNS topic (e-mail subscribers get each notice as plain text).
What is said is the workflow's close step (gpuscout.workflow.close); publishing never fails the run: a failed
publish is returned, and logged by the caller."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpuscout.workflow.ports import Notice


@dataclass(frozen=True)
class SnsNotifier:
    sns: Any  # a boto3 SNS client
    topic_arn: str

    def publish(self, notice: Notice) -> str | None:
        """Publish; returns None when sent, else why not."""
        try:
            self.sns.publish(TopicArn=self.topic_arn, Subject=notice.subject, Message=notice.message)
        except (ClientError, BotoCoreError) as err:
            return f"cannot publish the run summary to {self.topic_arn}: {err}"
        return None


def sns_notifier(sns: Any, topic_arn: str | None) -> SnsNotifier | None:
    """The topic's notifier; None when the stack has no topic (NOTIFICATION_TOPIC_ARN unset) or no client is given."""
    return SnsNotifier(sns, topic_arn) if topic_arn and sns is not None else None
