"""Bring your own job: the manifest's job section, the gpuscout_report helper's statistics and stop rule, and the
planner's prediction from the user's estimate."""

import json
from pathlib import Path

import gpuscout_report
import pytest
import yaml

from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.manifest_loader import load_manifest, parse_manifest, validate_manifest_data
from gpuscout.errors import ManifestError
from gpuscout.paths import REPO_DIR
from gpuscout.plan.planner import plan

CATALOG = load_catalog()
EXAMPLE = REPO_DIR / "examples" / "two-tower"


def job_manifest() -> dict:
    return yaml.safe_load((EXAMPLE / "local.yaml").read_text())


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(data), "m.json", CATALOG)
    return {p.path: p.message for p in info.value.problems}


def test_the_examples_validate_and_the_job_paths_resolve():
    m = load_manifest(EXAMPLE / "local.yaml", CATALOG)
    assert m.job is not None and Path(m.job.source_dir) == EXAMPLE.resolve()
    assert m.model is None and m.dataset is None
    assert load_manifest(EXAMPLE / "cloud.yaml", CATALOG).job is not None


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d["job"].update(entrypoint="x.py"), "job.entrypoint", "unknown field; allowed: source_dir"),
        (lambda d: d["job"].pop("entry_point"), "job.entry_point", "required field is missing"),
        (lambda d: d["job"].update(entry_point="../x.py"), "job.entry_point", "inside it"),
        (lambda d: d["job"].update(entry_point="run.sh"), "job.entry_point", "ending in .py"),
        (lambda d: d["job"].update(unit="rows"), "job.unit", "'tokens' or 'samples'"),
        (lambda d: d.update(sequence_length=128), "sequence_length", "not used with a job section"),
        (
            lambda d: d["variants"][0].update(per_device_batch_size=4),
            "variants[0].per_device_batch_size",
            "hyperparameters",
        ),
        (lambda d: d["variants"][1]["hyperparameters"].pop("batch_size"), "variants[1].hyperparameters", "batch_size"),
        (lambda d: d["training"].update(max_steps=None, max_tokens=100), "training.max_steps", "needs max_steps"),
        (
            lambda d: d["job"]["estimate"].update(units_per_s_by_instance_type={"ml.p3.2xlarge": 5.0}),
            "job.estimate.units_per_s_by_instance_type",
            "not a target",
        ),
    ],
)
def test_bad_job_sections_name_the_field(mutate, path, fragment):
    data = job_manifest()
    mutate(data)
    found = problems(data)
    assert path in found, found
    assert fragment in found[path]
    assert all("\n" not in message for message in found.values())


def test_without_a_job_the_builtin_fields_stay_required():
    data = job_manifest()
    data.pop("job")
    found = problems(data)
    assert {"model", "dataset", "sequence_length", "variants[0].hyperparameters"} <= set(found)


def test_a_missing_entry_point_fails_at_load(tmp_path):
    data = job_manifest()
    data["job"]["source_dir"] = str(EXAMPLE)
    data["job"]["entry_point"] = "nope.py"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ManifestError) as info:
        load_manifest(path, CATALOG)
    assert [p.path for p in info.value.problems] == ["job.entry_point"]


def test_the_planner_predicts_from_the_estimate_and_says_so():
    m = load_manifest(EXAMPLE / "local.yaml", CATALOG)
    hw = LocalHardware(device="cpu", cpu_count=2, memory_gib=8.0, startup_s=0.0)
    p = plan(m, CATALOG, run_id="r1", local_hardware=hw)
    by_variant = {j.variant_name: j for j in p.jobs}
    b128 = by_variant["b128"].prediction
    assert b128.unit == "samples" and b128.samples_per_s == 20000 and b128.tokens_per_s is None
    assert b128.training_seconds == pytest.approx(12 * 128 / 20000)
    assert "user's estimate" in b128.method and "no FLOPs model" in b128.method
    assert by_variant["b512"].hyperparameters["batch_size"] == "512"
    assert by_variant["b512"].job_code is not None
    assert by_variant["b512"].job_code.environment["GPUSCOUT_MAX_STEPS"] == "12"


def _reporter(tmp_path, **kw):
    clock = iter(range(1000))
    lines: list[str] = []
    rep = gpuscout_report.Reporter(output_dir=tmp_path, clock=lambda: float(next(clock)), emit=lines.append, **kw)
    return rep, lines


def test_the_helper_excludes_warmup_and_writes_the_schema(tmp_path):
    from gpuscout.domain.benchmark import BenchmarkResult

    rep, lines = _reporter(tmp_path, unit="samples", max_steps=6, warmup_steps=2)
    stops = [rep.step(samples=100, loss=1.0, seconds=s) for s in (9.0, 9.0, 1.0, 1.0, 1.0, 1.0)]
    assert stops == [False] * 5 + [True]
    rep.done()
    result = BenchmarkResult.model_validate_json((tmp_path / "benchmark.json").read_text())
    assert result.unit == "samples" and result.throughput is not None
    assert result.throughput.samples_per_s == pytest.approx(100.0)  # the 9 s warm-up steps are excluded
    assert result.throughput.tokens_per_s is None
    assert result.timing is not None and result.timing.warmup_steps == 2 and result.timing.timed_steps == 4
    assert result.stop is not None and result.stop.reason == "max_steps reached"
    assert lines[0].startswith("gpuscout_metric step=1") and "samples_per_s=" in lines[0]


def test_the_helper_asks_the_script_to_stop_at_steady_state(tmp_path):
    rep, _ = _reporter(tmp_path, unit="samples", max_steps=1000, warmup_steps=1, stop_rule="steady_state",
                       ci_tolerance=0.05, min_timed_steps=5)  # fmt: skip
    steps = 0
    while not rep.step(samples=100, seconds=1.0 + 0.01 * (steps % 2)):
        steps += 1
    assert steps + 1 == 6  # 1 warm-up + 5 timed: steady enough as soon as min_timed_steps allows
    assert "throughput CI within" in (rep.stop_reason or "")


def test_an_exception_is_a_failed_benchmark(tmp_path):
    rep, _ = _reporter(tmp_path, unit="samples")
    rep.fail("RuntimeError: CUDA out of memory")
    data = json.loads((tmp_path / "benchmark.json").read_text())
    assert data["status"] == "failed" and "out of memory" in data["failure_reason"]


def test_metric_lines_without_the_helper(tmp_path):
    log = [
        "hello",
        *(f"gpuscout_metric step={i} samples=50 loss=0.5 step_time_s={2 if i == 1 else 0.5}" for i in range(1, 6)),
    ]
    rep, _ = _reporter(tmp_path, unit="samples", warmup_steps=1)
    result = gpuscout_report.from_log(log, rep)
    assert result["throughput"]["samples_per_s"] == pytest.approx(100.0)
    assert result["timing"]["timed_steps"] == 4


def test_a_job_manifest_round_trips_through_its_dump_as_the_cloud_steps_pass_it() -> None:
    # Given the two-tower cloud manifest (Validate hands Plan manifest.model_dump(mode="json"), defaults filled in)
    from gpuscout.domain.manifest_loader import load_manifest, validate_manifest_data
    from gpuscout.paths import REPO_DIR

    manifest = load_manifest(REPO_DIR / "examples" / "two-tower" / "cloud.yaml")
    dumped = manifest.model_dump(mode="json")
    assert dumped["model"] is None and dumped["variants"][0]["attention"] is not None  # defaults, not user input
    # Then the dump validates to the same manifest (the defaults are not taken for built-in settings the user gave)
    assert validate_manifest_data(dumped, "dumped") == manifest


def test_units_per_step_is_per_device_and_may_be_a_product_of_hyperparameters() -> None:
    # Given the HF Trainer cloud example: samples per process per step = batch_size x gradient_accumulation_steps
    from gpuscout.domain.catalog import load_catalog
    from gpuscout.domain.manifest_loader import load_manifest
    from gpuscout.paths import REPO_DIR
    from gpuscout.plan.planner import plan

    manifest = load_manifest(REPO_DIR / "examples" / "hf-trainer" / "cloud.yaml")
    jobs = {(j.instance_type, j.variant_name, j.spot): j for j in plan(manifest, load_catalog(), run_id="r").jobs}
    g5 = jobs[("ml.g5.8xlarge", "b16-accum2", False)].prediction
    p4d = jobs[("ml.p4d.24xlarge", "b16-accum2", False)].prediction
    b8 = jobs[("ml.p4d.24xlarge", "b8", False)].prediction
    # Then one A10G does 400 steps x 32 samples at 40 samples/s, and 8 A100 processes each do 32 per step at 150/s
    assert g5.training_seconds == pytest.approx(400 * 16 * 2 / 40)
    assert p4d.samples_per_s == 8 * 150 and p4d.training_seconds == pytest.approx(400 * 32 / 150)
    # (a variant without accumulation: the absent factor counts 1)
    assert b8.training_seconds == pytest.approx(400 * 8 / 150)
    with pytest.raises(ManifestError) as info:
        validate_manifest_data(
            {**manifest.model_dump(mode="json"), "job": {**manifest.model_dump(mode="json")["job"],
             "estimate": {"units_per_s": 1, "units_per_step": []}}}, "m"
        )  # fmt: skip
    assert "job.estimate.units_per_step" in str(info.value)
