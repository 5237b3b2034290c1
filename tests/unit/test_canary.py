"""The canary plan: one scaled-down job per distinct configuration (gpuscout.plan.canary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuscout import paths
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.jobspec import JobSpec
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.local.planning import plan_jobs
from gpuscout.plan.canary import CANARY_MAX_RUNTIME_S, CANARY_STEPS, configuration_key, plan_canaries

MANIFEST = """
name: canary-plan
model: {preset: qwen2-tiny}
tokenizer: {kind: bpe, vocab_size: 512}
dataset: {source: bundled:hebrew-bible, max_documents: 12}
sequence_length: 64
training: {max_steps: 40, checkpoint_interval: 10, stop_rule: {kind: steady_state}}
targets: [{instance_type: local, price_per_hour_usd: 0.1}]
variants:
  - {name: a, per_device_batch_size: 2, gradient_accumulation_steps: 2}
  - {name: a-again, per_device_batch_size: 2, gradient_accumulation_steps: 2}
  - {name: b, per_device_batch_size: 4, gradient_accumulation_steps: 1}
  - {name: c, per_device_batch_size: 2, gradient_accumulation_steps: 2, gradient_checkpointing: true}
repetitions: 2
constraints: {budget_usd: 1.0}
"""


def _jobs(tmp_path: Path) -> list[JobSpec]:
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST)
    plan = plan_jobs(load_manifest(path), load_catalog())
    return list(plan.jobs)


def test_one_canary_per_distinct_configuration(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path)
    assert len(jobs) == 8
    canaries = plan_canaries(jobs)
    # a and a-again differ only in their names: one configuration; repetitions share it too
    covered = [sorted({j.variant_name for j in jobs if j.job_name in c.covers}) for c in canaries]
    assert covered == [["a", "a-again"], ["b"], ["c"]]
    assert sorted(n for c in canaries for n in c.covers) == sorted(j.job_name for j in jobs)


def test_the_canary_keeps_the_code_path_and_shrinks_the_run(tmp_path: Path) -> None:
    jobs = _jobs(tmp_path)
    canary = plan_canaries(jobs)[2]
    original = next(j for j in jobs if j.variant_name == "c")
    hp, before = canary.spec.hyperparameters, original.hyperparameters
    assert hp["max_steps"] == str(CANARY_STEPS) and hp["stop_rule"] == "fixed" and hp["validation_batches"] == "1"
    assert hp["checkpoint_interval"] == "1", "a job that checkpoints has its canary checkpoint (and prune) too"
    same = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "packing",
            "attention_implementation", "torch_compile", "deepspeed_stage", "precision", "sequence_length",
            "fused_cross_entropy", "model_preset")  # fmt: skip
    assert {k: hp[k] for k in same} == {k: before[k] for k in same}
    assert configuration_key(canary.spec) == configuration_key(original)
    assert canary.spec.job_name.endswith("-canary3") and len(canary.spec.job_name) <= 63
    assert canary.spec.job_name == hp["job_name"]
    assert canary.spec.max_runtime_seconds <= CANARY_MAX_RUNTIME_S


def test_a_job_without_checkpoints_has_a_canary_without_them() -> None:
    quick = paths.MANIFESTS_DIR / "quickstart.yaml"
    plan = plan_jobs(load_manifest(quick), load_catalog())
    assert all(c.spec.hyperparameters["checkpoint_interval"] == "0" for c in plan_canaries(plan.jobs))
    long_name = plan.jobs[0].model_copy(update={"job_name": "x" * 63})
    (canary,) = plan_canaries([long_name])
    assert len(canary.spec.job_name) == 63 and canary.spec.job_name.endswith("-canary1")


def test_the_cloud_canary_is_a_two_layer_two_step_job_on_the_canary_instance(tmp_path: Path) -> None:
    import botocore.session
    from botocore.validate import ParamValidator

    from gpuscout.cloud.sagemaker_requests import training_job_request
    from gpuscout.plan.canary import CLOUD_CANARY_LAYERS, plan_cloud_canaries
    from tests.unit.test_sagemaker_requests import DATA, SETTINGS

    jobs = _jobs(tmp_path)
    canaries = plan_cloud_canaries(jobs, instance_type="ml.g5.8xlarge", gpus_per_instance=1, price_per_hour_usd=2.45)
    assert len(canaries) == 3
    spec = canaries[0].spec
    assert (spec.instance_type, spec.instance_count, spec.spot) == ("ml.g5.8xlarge", 1, False)
    hp = spec.hyperparameters
    assert hp["canary_layers"] == str(CLOUD_CANARY_LAYERS) and hp["max_steps"] == "2"
    assert (hp["per_device_train_batch_size"], hp["gradient_accumulation_steps"]) == ("1", "1")
    assert spec.job_name.startswith("gs-")  # the stack's IAM and event rules cover gs-* jobs only
    # named once: <job>-canary<N> (it was <job>-canary1-canary1: the cloud canary renamed the canary)
    assert [c.spec.job_name.count("-canary") for c in canaries] == [1, 1, 1]
    assert [c.spec.job_name.rsplit("-", 1)[1] for c in canaries] == ["canary1", "canary2", "canary3"]
    assert all(c.spec.hyperparameters["job_name"] == c.spec.job_name for c in canaries)
    request = training_job_request(spec, SETTINGS, DATA, enable_network_isolation=False)
    model = botocore.session.get_session().get_service_model("sagemaker")
    report = ParamValidator().validate(request, model.operation_model("CreateTrainingJob").input_shape)
    assert not report.has_errors(), report.generate_report()


def test_a_canary_too_large_for_the_canary_gpu_runs_on_its_jobs_type_and_says_why() -> None:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.canary import cloud_canaries, cloud_canary_memory_gb, predicted_canary_cost_usd
    from gpuscout.plan.planner import CLOUD_OVERHEAD_S, architecture, plan

    catalog = load_catalog()
    # Given the shipped Qwen2.5-7B manifest: its untied embedding and head (~1.1 B parameters) stay whole in a
    # 2-layer cut, so by the planner's own memory model its canary needs ~30 GB, over the 24 GB of an ml.g5.8xlarge
    manifest = load_manifest(paths.MANIFESTS_DIR / "p4d-to-p5.yaml", catalog=catalog)
    jobs = plan(manifest, catalog, run_id="r-7b").jobs
    need = cloud_canary_memory_gb(architecture(manifest), jobs[0], world=1)
    assert 0.9 * 24 < need < 40
    # When its cloud canaries are planned on the stack's default canary type
    canaries = cloud_canaries(jobs, manifest, catalog, "ml.g5.8xlarge")
    # Then each runs on one instance of its own job's type, on demand, and says why
    assert [c.spec.instance_type for c in canaries] == [j.instance_type for j in jobs]
    assert all(c.spec.instance_count == 1 and not c.spec.spot for c in canaries)
    assert all(c.placement is not None and "ml.g5.8xlarge has 24 GB" in c.placement for c in canaries)
    assert all(c.spec.hyperparameters["instance_type"] == c.spec.instance_type for c in canaries)
    # and their predicted cost is each one's start-up (as every cloud job's) at its own on-demand price
    expected = sum(CLOUD_OVERHEAD_S / 3600 * catalog.get(j.instance_type).on_demand_usd_per_hour for j in jobs)
    assert predicted_canary_cost_usd(canaries) == pytest.approx(expected)


def test_a_canary_that_fits_stays_on_the_canary_type(tmp_path: Path) -> None:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.canary import cloud_canaries

    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST.replace("instance_type: local, price_per_hour_usd: 0.1", "instance_type: ml.p4d.24xlarge"))
    catalog = load_catalog()
    manifest = load_manifest(path, catalog=catalog)
    from gpuscout.plan.planner import plan

    canaries = cloud_canaries(plan(manifest, catalog, run_id="r-tiny").jobs, manifest, catalog, "ml.g5.8xlarge")
    assert canaries and all(c.spec.instance_type == "ml.g5.8xlarge" and c.placement is None for c in canaries)


def test_a_canary_moved_to_a_spot_jobs_type_runs_on_spot_as_its_job(tmp_path: Path) -> None:
    from gpuscout.cloud.quotas import plan_needs
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.canary import cloud_canaries
    from gpuscout.plan.planner import plan

    # Given the 7B manifest with its first target on spot: its canary is too large for the canary type
    text = (paths.MANIFESTS_DIR / "p4d-to-p5.yaml").read_text()
    path = tmp_path / "spot.yaml"
    path.write_text(
        text.replace("  - instance_type: ml.p4d.24xlarge\n", "  - instance_type: ml.p4d.24xlarge\n    spot: true\n", 1)
    )
    catalog = load_catalog()
    manifest = load_manifest(path, catalog=catalog)
    jobs = plan(manifest, catalog, run_id="r-spot").jobs
    assert jobs[0].spot and not jobs[1].spot
    canaries = cloud_canaries(jobs, manifest, catalog, "ml.g5.8xlarge")
    # Then it runs on that type on spot, at the spot price, saying so: it needs no quota its job does not need
    first = canaries[0]
    assert first.spec.instance_type == "ml.p4d.24xlarge" and first.spec.spot
    assert first.spec.spot_price_per_hour_usd == jobs[0].spot_price_per_hour_usd
    assert first.placement is not None and first.placement.endswith("(spot, as its job)")
    needs = plan_needs(jobs, concurrency=4, canary_instance_type="ml.g5.8xlarge", canaries=[c.spec for c in canaries])
    on_demand_p4d = [n for n in needs if n.instance_type == "ml.p4d.24xlarge" and not n.spot]
    assert on_demand_p4d == []


def test_a_canary_that_must_copy_a_whole_s3_model_says_so(tmp_path: Path) -> None:
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.plan.canary import canary_model_note

    catalog = load_catalog()
    s3_model = "model: {path: 's3://gpuscout-data-1/raw/models/q/', architecture: qwen2-tiny}"
    text = MANIFEST.replace("model: {preset: qwen2-tiny}", s3_model).replace("tokenizer: {kind: bpe, vocab_size: 512}",
                                                                            "tokenizer: {kind: qwen}")  # fmt: skip
    notes = {}
    for isolated in (False, True):
        path = tmp_path / f"m-{isolated}.yaml"
        path.write_text(text + f"network_isolation: {str(isolated).lower()}\n")
        notes[isolated] = canary_model_note(load_manifest(path, catalog=catalog))
    # With network a canary reads only its layers' byte ranges (gpuscout_train/partial_checkpoint.py): nothing to say;
    # under network isolation only the model channel reaches it, and that copies the whole checkpoint
    assert notes[False] is None
    assert notes[True] is not None and "downloads the whole model s3://gpuscout-data-1/raw/models/q/" in notes[True]
    assert canary_model_note(load_manifest(paths.MANIFESTS_DIR / "p4d-to-p5.yaml", catalog=catalog)) is None
