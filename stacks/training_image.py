"""The training / data-preparation image: training/Dockerfile built from the repository root at deploy time.

A DockerImageAsset synthesizes without a Docker engine (only `cdk deploy` builds and pushes it to the bootstrap
ECR repository). The build context is the repository root, but only gpuscout/, configs/ and training/ enter it,
the same patterns as the root .dockerignore. The base image comes from public ECR (no `docker login`, no account or
region); `base_image` (context `training_image_base`) overrides the Dockerfile's default.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import IgnoreMode
from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

REPO_DIR = Path(__file__).resolve().parent.parent
DOCKERFILE = "training/Dockerfile"
BUILD_CONTEXT_EXCLUDE = ["*", "!gpuscout", "!configs", "!training", "**/__pycache__", "**/*.pyc"]


class TrainingImage(Construct):
    """`image_uri` (tagged by asset hash) and `repository` (for the SageMaker role's pull permissions)."""

    def __init__(self, scope: Construct, construct_id: str, *, base_image: str | None = None) -> None:
        super().__init__(scope, construct_id)
        if not (REPO_DIR / DOCKERFILE).is_file():
            raise FileNotFoundError(f"{REPO_DIR / DOCKERFILE} is missing; the training image cannot be defined")
        self.asset = ecr_assets.DockerImageAsset(
            self,
            "Asset",
            directory=str(REPO_DIR),
            file=DOCKERFILE,
            exclude=BUILD_CONTEXT_EXCLUDE,
            ignore_mode=IgnoreMode.DOCKER,
            platform=ecr_assets.Platform.LINUX_AMD64,
            display_name="gpuscout training image",
            build_args={"BASE_IMAGE": base_image} if base_image else None,
        )
        self.image_uri = self.asset.image_uri
        self.repository = self.asset.repository
