"""Lambda: create a run's own SageMaker execution role before its first job, or delete it after the analysis
(Cloud contract: run_role; gpuscout.cloud.run_roles says why each run has a role of its own).

``{"run_id", "action": "create"}`` returns ``{"role_arn"}``, which the state machine hands to every SageMaker task
of the run; ``{"run_id", "action": "delete"}`` returns ``{"deleted"}`` (False: there was no role left to delete).
mark_run_failed deletes the role of a run that ends any other way.
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from gpuscout.cloud import control_plane, run_roles
from gpuscout.cloud.contract import RunRoleRequest
from gpuscout.cloud.lambda_runtime import lambda_handler, logger, metrics


@lambda_handler()
@event_parser(model=RunRoleRequest)
def handler(event: RunRoleRequest, context: LambdaContext) -> dict[str, Any]:
    services = control_plane.services()
    logger.append_keys(run_id=event.run_id, action=event.action)
    if event.action == "create":
        role_arn = run_roles.create_run_role(services.iam, services.settings, event.run_id)
        metrics.add_metric(name="RunRolesCreated", unit=MetricUnit.Count, value=1)
        logger.info("run role created", extra={"role_arn": role_arn})
        return {"role_arn": role_arn}
    deleted = run_roles.delete_run_role(services.iam, services.settings, event.run_id)
    logger.info("run role deleted" if deleted else "no run role left to delete")
    return {"deleted": deleted}
