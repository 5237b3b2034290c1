"""Sources a deployed stack's jobs could never read are refused before anything runs, with the fix."""

from __future__ import annotations

import json

import pytest

from gpuscout.cloud.sources import cloud_problems, source_problems
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import parse_manifest

BUCKET = "gpuscout-data-123456789012"
BASE = """
name: sources
model: {MODEL}
tokenizer: {TOKENIZER}
dataset: {{source: {SOURCE}}}
sequence_length: 256
training: {{max_steps: 20}}
targets: [{{instance_type: ml.g5.8xlarge}}]
variants: [{{name: b4, per_device_batch_size: 4}}]
constraints: {{budget_usd: 50}}
network_isolation: {ISOLATION}
"""


def _manifest(
    source: str = "bundled:hebrew-bible",
    model: str = "{preset: qwen2.5-0.5b}",
    tokenizer: str = "{kind: qwen}",
    isolation: bool = False,
) -> Manifest:
    text = BASE.format(MODEL=model, TOKENIZER=tokenizer, SOURCE=source, ISOLATION=str(isolation).lower())
    return parse_manifest(text, "m.yaml", load_catalog())


@pytest.mark.parametrize(
    "source", ["bundled:hebrew-bible", "bundled:hebrew-chatterbot", f"s3://{BUCKET}/raw/datasets/he/"]
)
def test_readable_dataset_sources_pass(source: str) -> None:
    assert source_problems(_manifest(source=source), data_bucket=BUCKET) == []


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("s3://gpuscout-data-example/datasets/hebrew-text/", f"s3://{BUCKET}/raw/hebrew-text/"),
        (f"s3://{BUCKET}/datasets/he/", f"aws s3 sync s3://{BUCKET}/datasets/he/ s3://{BUCKET}/raw/he/"),
        (f"s3://{BUCKET}/processed/x/", "reads datasets only under"),
        ("/home/me/corpus", "is a local path"),
    ],
)
def test_unreadable_dataset_sources_are_refused_with_the_copy_command(source: str, says: str) -> None:
    # Given a dataset outside raw/ of the stack's data bucket (another bucket, another prefix, a local path)
    (problem,) = source_problems(_manifest(source=source), data_bucket=BUCKET)
    # Then the problem names the field and the fix
    assert problem.path == "dataset.source"
    assert says in problem.message and f"s3://{BUCKET}/raw/" in problem.message


def test_models_and_tokenizers_follow_the_same_rule() -> None:
    ok = _manifest(model=f"{{path: 's3://{BUCKET}/raw/models/q/', architecture: qwen2.5-0.5b}}",
                   tokenizer=f"{{kind: hf, path: 's3://{BUCKET}/raw/tok/'}}")  # fmt: skip
    assert source_problems(ok, data_bucket=BUCKET) == []
    bad = _manifest(model="{path: 's3://elsewhere/models/q/', architecture: qwen2.5-0.5b}",
                    tokenizer="{kind: hf, path: ./my-tokenizer}")  # fmt: skip
    assert {p.path for p in source_problems(bad, data_bucket=BUCKET)} == {"model.path", "tokenizer.path"}
    hub_tokenizer = _manifest(tokenizer="{kind: hf, path: Qwen/Qwen2.5-0.5B}")
    assert source_problems(hub_tokenizer, data_bucket=BUCKET) == []


def test_a_hub_model_under_network_isolation_is_refused() -> None:
    isolated = _manifest(model="{hf_id: Qwen/Qwen2.5-0.5B}", isolation=True)
    (problem,) = source_problems(isolated, data_bucket=BUCKET)
    assert problem.path == "model.hf_id" and "network_isolation: true" in problem.message
    assert f"model.path: s3://{BUCKET}/raw/models/Qwen2.5-0.5B/" in problem.message
    # without isolation the job downloads it itself; an S3 model under isolation arrives as a channel
    assert source_problems(_manifest(model="{hf_id: Qwen/Qwen2.5-0.5B}"), data_bucket=BUCKET) == []
    s3_isolated = _manifest(model=f"{{path: 's3://{BUCKET}/raw/models/q/', architecture: qwen2.5-0.5b}}",
                            isolation=True)  # fmt: skip
    assert source_problems(s3_isolated, data_bucket=BUCKET) == []


def test_targets_and_sources_together() -> None:
    problems = cloud_problems(_manifest(source="/data"), data_bucket=BUCKET, allowed_instance_types=("ml.p5.48xlarge",))
    assert [p.path for p in problems] == ["targets[0].instance_type", "dataset.source"]


def test_a_spot_wait_longer_than_the_execution_timeout_is_refused() -> None:
    text = BASE.format(MODEL="{preset: qwen2.5-0.5b}", TOKENIZER="{kind: qwen}", SOURCE="bundled:hebrew-bible",
                       ISOLATION="false").replace(
        "targets: [{instance_type: ml.g5.8xlarge}]",
        "targets: [{instance_type: ml.g5.8xlarge, spot: true, max_wait_hours: 96}]",
    )  # fmt: skip
    manifest = parse_manifest(text, "m.yaml", load_catalog())
    (problem,) = cloud_problems(manifest, data_bucket=BUCKET, execution_timeout_hours=72)
    assert problem.path == "targets[0].max_wait_hours" and "72 h" in problem.message
    assert cloud_problems(manifest, data_bucket=BUCKET, execution_timeout_hours=120) == []


def test_a_gpu_the_training_images_torch_has_no_kernels_for_is_refused() -> None:
    # Given a V100 target (compute capability 7.0): the image's torch 2.13 CUDA 12.8/13 build starts at Turing (7.5)
    text = BASE.format(
        MODEL="{preset: qwen2.5-0.5b}", TOKENIZER="{kind: qwen}", SOURCE="bundled:hebrew-bible", ISOLATION="false"
    ).replace("ml.g5.8xlarge}]", "ml.g5.8xlarge}, {instance_type: ml.p3.8xlarge}]")
    manifest = parse_manifest(text.replace("per_device_batch_size: 4", "per_device_batch_size: 1"), "m.yaml")
    # Then the cloud refuses it, naming the GPU, why, and what to choose instead; the A10G target passes
    [problem] = cloud_problems(manifest, data_bucket=BUCKET)
    assert problem.path == "targets[1].instance_type"
    assert "NVIDIA Tesla V100 SXM2 16GB (compute capability 7.0)" in problem.message
    assert "no kernels below Turing (7.5)" in problem.message and "ml.g5.*" in problem.message


JOB = """
name: own-code
job:
  source_dir: s3://{bucket}/raw/code/own/
  entry_point: train.py
  arguments: {{{arguments}}}
  canary_arguments: {{{canary}}}
training: {{max_steps: 100}}
targets: [{{instance_type: ml.g5.8xlarge}}]
variants: [{{name: base}}, {{name: wide, hyperparameters: {{{wide}}}}}]
constraints: {{budget_usd: 50}}
"""


def _job_manifest(arguments: dict[str, object], canary: dict[str, object], wide: dict[str, object]) -> Manifest:
    def inline(values: dict[str, object]) -> str:
        return ", ".join(f"{k}: {json.dumps(v)}" for k, v in values.items())  # YAML flow mapping, JSON scalars

    text = JOB.format(bucket=BUCKET, arguments=inline(arguments), canary=inline(canary), wide=inline(wide))
    return parse_manifest(text, "m.yaml", load_catalog())


def test_a_job_s_arguments_must_fit_sagemaker_s_hyperparameter_limits() -> None:
    # Given 99 job arguments, a variant adding 2 more and a 2,501-character value (SageMaker: 100 entries, 2,500)
    arguments: dict[str, object] = {f"a{i:02d}": i for i in range(99)}
    manifest = _job_manifest(arguments, {"steps": 2}, {"extra1": 1, "extra2": "x" * 2501})
    # Then each is refused with its field path, before anything runs
    problems = [(p.path, p.message) for p in cloud_problems(manifest, data_bucket=BUCKET)]
    by_path = dict(problems)
    assert "at most 2,500 characters" in by_path["variants[1].hyperparameters.extra2"]
    assert by_path["variants[1].hyperparameters"].startswith("variant wide: 101 arguments in all; SageMaker passes")
    assert "variants[0].hyperparameters" not in by_path  # 99 fit
    # the canaries are sent each variant's arguments and `steps`: base 99 + 1 = 100 fit, wide 101 + 1 do not
    assert [m for path, m in problems if path == "job.canary_arguments"] == [
        "variant wide: 102 arguments in all; SageMaker passes at most 100 hyperparameters to a job (put the rest in "
        "a config file of the code folder)"
    ]


def test_a_canary_over_the_limit_only_through_its_own_arguments_is_refused() -> None:
    # Given 98 job arguments, a variant adding 2 (100: fits) and a canary argument that is new (101 for the canary)
    manifest = _job_manifest({f"a{i:02d}": i for i in range(98)}, {"steps": 2}, {"extra1": 1, "extra2": 2})
    problems = [(p.path, p.message) for p in cloud_problems(manifest, data_bucket=BUCKET)]
    assert [path for path, _ in problems] == ["job.canary_arguments"]
    assert problems[0][1].startswith("variant wide: 101 arguments in all")


def test_a_multi_line_argument_is_refused() -> None:
    manifest = _job_manifest({"prompt": "line one\nline two"}, {}, {})
    (problem,) = cloud_problems(manifest, data_bucket=BUCKET)
    assert problem.path == "job.arguments.prompt" and "contains a line break" in problem.message


def test_a_job_within_the_limits_passes() -> None:
    manifest = _job_manifest({"a": 1, "text": "y" * 2500}, {"steps": 2}, {"hidden": 512})
    assert cloud_problems(manifest, data_bucket=BUCKET) == []


def test_a_url_encoded_key_falls_back_to_its_decoded_form_when_s3_says_access_denied() -> None:
    # Validate's role has no s3:ListBucket, so S3 answers a missing key 403 AccessDenied (not 404): the decoded key
    # is still tried
    import io

    from botocore.exceptions import ClientError

    from gpuscout.cloud.control_plane import _read_object

    class OnlyTheDecodedKey:
        def get_object(self, Bucket: str, Key: str) -> dict[str, object]:  # noqa: N803 - boto3's names
            if Key != "manifests/my run.yaml":
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "GetObject")
            return {"Body": io.BytesIO(b"name: x\n"), "ETag": '"abc"'}

    assert _read_object(OnlyTheDecodedKey(), "b", "manifests/my+run.yaml") == (
        "manifests/my run.yaml",
        b"name: x\n",
        "abc",
    )
