"""Payload models shared by the Lambda steps the state machine invokes (parsed with Powertools' parser)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CaughtError(BaseModel):
    """A Step Functions Catch's ``ResultPath`` value: the error name and its cause (often a JSON document)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    error: str = Field(default="", alias="Error")
    cause: str = Field(default="", alias="Cause")
