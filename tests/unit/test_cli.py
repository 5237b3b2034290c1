"""The gpuscout command line through typer's CliRunner (no training: stored runs are built here)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gpuscout.analysis.analyze import analyze_run
from gpuscout.analysis.terms import RunTerms
from gpuscout.cli import app as cli
from gpuscout.domain.benchmark import BenchmarkResult
from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_loader import load_manifest
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.store.base import JobRecord, JobStatus, ResultRecord, RunRecord, RunStatus
from gpuscout.store.sqlite import SqliteStore
from tests.job_specs import job_spec

QUICKSTART = MANIFESTS_DIR / "quickstart.yaml"
RUN_ID = "quickstart-20250301-120000-abc123"

runner = CliRunner(env={"COLUMNS": "200"})  # xdist workers set COLUMNS=80; tables must not be cut


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "gpuscout.db"


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _benchmark(job_name: str, tokens_per_s: float, batch: int) -> dict[str, object]:
    result = BenchmarkResult.model_validate(
        {
            "status": "completed",
            "job_name": job_name,
            "run_id": RUN_ID,
            "instance_type": "local",
            "hardware": {"device": "cpu", "gpus_per_node": 0, "nodes": 1, "world_size": 1, "cpu_count": 2},
            "software": {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.23.0", "gpuscout": "0.1.0"},
            "config": {
                "model": "qwen2-tiny",
                "params_total": 400_000,
                "params_matmul": 360_000,
                "num_layers": 2,
                "num_heads": 4,
                "head_dim": 16,
                "sequence_length": 256,
                "per_device_batch_size": batch,
                "gradient_accumulation_steps": 16 // batch,
                "global_batch_size": 16,
                "precision": "fp32",
                "packing": True,
                "attention": "sdpa",
                "torch_compile": False,
                "gradient_checkpointing": False,
                "deepspeed_stage": 0,
                "dataloader_workers": 0,
                "learning_rate": 1e-3,
                "seed": 42,
            },
            "dataset": {
                "sha256": "0" * 64,
                "documents": 400,
                "tokens": 500_000,
                "padding_fraction": 0.0,
                "tokenizer": "bpe-4096",
            },
            "timing": {
                "warmup_steps": 3,
                "timed_steps": 27,
                "total_steps": 30,
                "step_time_mean_s": 4096 / tokens_per_s,
                "step_time_p50_s": 4096 / tokens_per_s,
                "step_time_p90_s": 1.1 * 4096 / tokens_per_s,
                "wall_time_s": 40.0,
                "train_time_s": 30 * 4096 / tokens_per_s,
                "dataloader_wait_fraction": 0.01,
            },
            "throughput": {
                "tokens_per_s": tokens_per_s,
                "tokens_per_s_ci95": (tokens_per_s * 0.97, tokens_per_s * 1.03),
                "samples_per_s": tokens_per_s / 256,
                "tokens_timed": 27 * 4096,
            },
            "efficiency": {
                "flops_per_token": 2.5e6,
                "hardware_flops_per_token": 2.5e6,
                "t_eff": 256.0,
                "mfu": None,
                "note": "no GPU: MFU is defined against a GPU's dense peak",
            },
            "loss": {"train": [{"step": 30, "tokens": 122_880, "elapsed_s": 20.0, "loss": 6.5}]},
            "stop": {"rule": "fixed", "reason": "max_steps reached", "steps": 30},
        }
    )
    return result.model_dump(mode="json")


def _stored_run(db: Path) -> SqliteStore:
    """A finished local run with two completed jobs and one failed one, analyzed by the real analysis code."""
    store = SqliteStore(db)
    catalog = load_catalog()
    manifest = load_manifest(QUICKSTART, catalog=catalog)
    run = RunRecord(
        run_id=RUN_ID,
        name="quickstart",
        status=RunStatus.SUCCEEDED,
        manifest_source=str(QUICKSTART),
        manifest=manifest.model_dump(mode="json"),
        predicted_cost_usd=0.001,
    )
    store.put_run(run)
    jobs = []
    for variant, tps, status in [
        ("b2-a8", 6000.0, JobStatus.COMPLETED),
        ("b8-a2", 9000.0, JobStatus.COMPLETED),
        ("b8-a2-nopack", 0, None),
    ]:
        name = f"gs-abc123-local-{variant}-r0"
        job = JobRecord(
            run_id=RUN_ID,
            job_name=name,
            status=status or JobStatus.FAILED,
            instance_type="local",
            variant_name=variant,
            spec=job_spec(name, RUN_ID, variant_name=variant, price_per_hour_usd=0.096),
            benchmark=_benchmark(name, tps, 2 if variant == "b2-a8" else 8) if status else None,
            failure_reason=None if status else "ValueError: per_device_train_batch_size must be >= 1",
        )
        store.put_job(job)
        jobs.append(job)
    analysis = analyze_run(run, jobs, terms=RunTerms.of(manifest), catalog=catalog)
    report_dir = db.parent / "report"
    report_dir.mkdir()
    (report_dir / "report.md").write_text("# quickstart report\n\nb8-a2 is cheapest.\n")
    store.put_result(ResultRecord(run_id=RUN_ID, analysis=analysis.model_dump(mode="json"), report_uri=str(report_dir)))
    return store


def _bad_manifest(tmp_path: Path) -> Path:
    text = QUICKSTART.read_text()
    text = text.replace("sequence_length: 256", "sequence_length: 8")  # below the minimum of 16
    text = text.replace("instance_type: local", "instance_type: ml.p9.huge")  # not in the catalog
    text = text.replace("training:\n", "training:\n  max_stepz: 31\n")  # typo: unknown field
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def test_validate_accepts_the_quickstart() -> None:
    code, out, _ = invoke("validate", str(QUICKSTART))
    assert code == 0
    assert "3 job(s)" in out


def test_validate_lists_every_problem_with_its_path_and_exits_2(tmp_path: Path) -> None:
    code, out, err = invoke("validate", str(_bad_manifest(tmp_path)))
    assert code == 2
    assert "3 problem(s)" in err
    assert "sequence_length:" in err
    assert "targets[0].instance_type:" in err
    assert "training.max_stepz:" in err
    assert "Traceback" not in out + err


def test_validate_missing_file_is_one_error(tmp_path: Path) -> None:
    code, _, err = invoke("validate", str(tmp_path / "nope.yaml"))
    assert code == 2
    assert "cannot read file" in err
    assert "Traceback" not in err


def test_plan_prints_the_matrix_and_total() -> None:
    code, out, _ = invoke("plan", str(QUICKSTART))
    assert code == 0, out
    for variant in load_manifest(QUICKSTART).variants:
        assert variant.name in out
    assert "total (3 jobs)" in out
    assert "within budget" in out


def test_validate_refuses_what_the_jobs_would_fail_on_and_warns_on_duplicates(tmp_path: Path) -> None:
    # Given a manifest whose jobs would each fail at their first step: one step leaves no timed step
    one_step = tmp_path / "one-step.yaml"
    one_step.write_text(QUICKSTART.read_text().replace("max_steps: 20", "max_steps: 1"))
    code, out, err = invoke("validate", str(one_step))
    assert code == 2 and "training: max_steps: 1 step leaves" in err and "give max_steps 5 or more" in err
    # Given a 7B model on a 24 GB GPU, every variant refused by the planner: all listed by one validate, exit 3
    big = yaml.safe_load(QUICKSTART.read_text())
    big["model"] = {"preset": "qwen2.5-7b"}
    big["targets"] = [{"instance_type": "ml.g5.8xlarge"}]
    big["variants"].append({**big["variants"][1], "name": "b4-a1-again"})
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(big))
    code, out, err = invoke("validate", str(path))
    assert code == 3 and "4 refusal(s)" in err, err
    assert err.count("  - targets[0] ml.g5.8xlarge, variant") == 4
    # and once they fit, the two variants with the same settings are a warning (paid twice), not an error
    path.write_text(yaml.safe_dump({**big, "model": {"preset": "qwen2-tiny"}, "targets": yaml.safe_load(
        QUICKSTART.read_text())["targets"]}))  # fmt: skip
    code, out, err = invoke("validate", str(path))
    assert code == 0 and "warning: variants 'b4-a1', 'b4-a1-again' have the same settings" in " ".join(out.split())


def test_validate_reports_faults_of_every_level_in_one_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuscout.domain import catalog

    cpu = catalog.LocalHardware(device="cpu", cpu_model="test cpu", cpu_count=2, memory_gib=16)
    monkeypatch.setattr(catalog, "detect_local_hardware", lambda: cpu)
    # Given 8 faults at four levels: fields (an unknown key, an unknown type), a section's rule (one step), a
    # cross-section rule (a sequence over the model's positions), this machine (fp16, ZeRO and flex on a CPU), and two
    # variants with the same settings
    data = yaml.safe_load(QUICKSTART.read_text())
    data["training"] |= {"max_steps": 1, "learning_rat": 0.1, "precision": "fp16"}
    data["sequence_length"] = 100_000
    data["targets"].append({"instance_type": "ml.p9.huge"})
    data["variants"][0]["deepspeed_stage"] = 3
    data["variants"][1]["attention"] = "flex"
    data["variants"].append({**data["variants"][2], "name": "again"})
    path = tmp_path / "eight.yaml"
    path.write_text(yaml.safe_dump(data))
    # When it is validated once
    code, out, err = invoke("validate", str(path))
    said = " ".join((out + err).split())
    # Then all eight are in the one report, each with the file's own path, exit 2 (the manifest is invalid)
    assert code == 2, said
    for expected in (
        "training.learning_rat: unknown field",
        "targets[1].instance_type: unknown instance type 'ml.p9.huge'",
        "training: max_steps: 1 step leaves 1 timed",
        "sequence_length: 100000 exceeds the model's max_position_embeddings",
        "training.precision: fp16 is not supported by targets[0] local",
        "variants[0]: 'b1-a4' on targets[0] local: ZeRO stage 3",
        "variants[1]: 'b4-a1' on targets[0] local: attention flex",
        "warning: variants 'b4-a1-nopack', 'again' have the same settings",
    ):
        assert expected in said, expected
    assert "error: " + str(path) + ": 4 problem(s)" in said and ": 3 refusal(s)" in said


def test_plan_shows_the_objective_per_job(tmp_path: Path) -> None:
    # the planned p4d job costs less than the p5 job, but not per token: the column a user ranks by is there
    code, out, _ = invoke("plan", str(MANIFESTS_DIR / "p4d-to-p5.yaml"))
    assert code == 0 and "pred. $/1M tokens" in out
    rows = {line.split("│")[2].strip(): line.split("│") for line in out.splitlines() if "│ gs-" in line}
    dollars = {instance: (float(cells[7]), float(cells[8])) for instance, cells in rows.items()}
    assert dollars["ml.p4d.24xlarge"][0] < dollars["ml.p5.48xlarge"][0]
    assert dollars["ml.p4d.24xlarge"][1] > dollars["ml.p5.48xlarge"][1]


def test_plan_over_budget_exits_3(tmp_path: Path) -> None:
    path = tmp_path / "tight.yaml"
    path.write_text(QUICKSTART.read_text().replace("budget_usd: 1.0", "budget_usd: 0.000001"))
    code, out, err = invoke("plan", str(path))
    assert code == 3
    assert "exceeds the budget" in err
    assert "Traceback" not in out + err


def test_catalog_lists_instances() -> None:
    code, out, _ = invoke("catalog")
    assert "ml.p5.4xlarge" in out and "ml.g6e.xlarge" in out and "training plan" in out
    assert "snapshot 2026-" in out and "ml.p6-b300.48xlarge: no price (" in out
    assert code == 0
    assert "ml.p5.48xlarge" in out
    assert "local" in out


def test_catalog_shows_one_type_with_every_source() -> None:
    code, out, _ = invoke("catalog", "ml.p5.4xlarge")
    assert code == 0, out
    assert "1 x NVIDIA H100 SXM5 80GB, 80 GB each" in out and "sold as: on demand, spot, training plan" in out
    assert "source (2026-11): EC2 DescribeInstanceTypes" in out and "GPU source" in out
    assert "price: $7.9120/h on-demand SageMaker Training (snapshot 2026-09-27" in out and "source: public copy" in out
    code, out, _ = invoke("catalog", "ml.p6-b200.48xlarge")
    assert code == 0 and "price: unknown (no SageMaker Training rate" in out
    code, _, err = invoke("catalog", "ml.p9.huge")
    assert code != 0 and "unknown instance type 'ml.p9.huge'" in err and err.strip().count("\n") == 0


def test_runs_on_an_empty_database(db: Path) -> None:
    SqliteStore(db)
    code, out, _ = invoke("runs", "--db", str(db))
    assert code == 0
    assert "no runs yet" in out


@pytest.mark.parametrize(
    "command", [["runs"], ["results", "some-run"], ["report", "some-run"], ["analyze", "some-run"]]
)
def test_read_only_commands_never_create_a_database(tmp_path: Path, command: list[str]) -> None:
    # Given a --db that does not exist, When a read-only command runs, Then it is an error and nothing is created
    missing = tmp_path / "nested" / "g.db"
    code, _, err = invoke(*command, "--db", str(missing))
    assert code == 1
    assert f"no result database at {missing}" in " ".join(err.split())
    assert not (tmp_path / "nested").exists()


def test_runs_never_truncates_the_run_id_and_has_json(db: Path) -> None:
    _stored_run(db)
    store = SqliteStore(db)
    run = store.get_run(RUN_ID)
    store.put_run(run.model_copy(update={"error": "a very long note " * 30}))
    narrow = CliRunner(env={"COLUMNS": "80"})
    out = narrow.invoke(cli.app, ["runs", "--db", str(db)]).stdout
    assert RUN_ID in out  # whole, on one line: the note gives way
    code, out, _ = invoke("runs", "--db", str(db), "--format", "json")
    assert code == 0
    [row] = json.loads(out)
    assert row["run_id"] == RUN_ID and row["status"] == run.status.value and "note" in row
    # and csv, as --help offers it: the same fields, the long note whole
    code, out, err = invoke("runs", "--db", str(db), "--format", "csv")
    assert code == 0, err
    [csv_row] = list(csv.DictReader(io.StringIO(out)))
    assert list(csv_row) == list(row) and csv_row["run_id"] == RUN_ID and csv_row["note"] == row["note"]


@pytest.mark.parametrize(
    ("variant", "words"),
    [
        ({"name": "z2", "deepspeed_stage": 2}, "deepspeed_stage 0"),
        ({"name": "big", "per_device_batch_size": 4096}, "needs ~"),
    ],
)
def test_plan_refusals_exit_3_like_the_budget_refusal(tmp_path: Path, variant: dict[str, object], words: str) -> None:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["variants"] = [variant]
    data["sequence_length"] = 4096  # with batch 4096: far beyond this host's memory, whatever it is
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(data))
    code, _, err = invoke("plan", str(manifest))
    assert code == 3, err
    assert words in " ".join(err.split())
    # --debug shows the traceback and keeps the exit code
    code, _, err = invoke("--debug", "plan", str(manifest))
    assert code == 3 and "Traceback" in err


def test_an_unwritable_runs_dir_is_a_clear_error_before_anything_runs(
    tmp_path: Path, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a runs dir below a regular file
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = invoke("local", str(QUICKSTART), "--runs-dir", str(blocker / "runs"), "--db", str(db))
    assert code == 1 and f"{blocker} is not a folder" in " ".join(err.split())
    # a folder this user cannot write (as root every folder is writable, so the permission check is simulated)
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
    code, _, err = invoke("local", str(QUICKSTART), "--runs-dir", str(locked / "runs"), "--db", str(db))
    assert code == 1 and "is not writable" in err
    assert not (locked / "runs").exists() and not db.exists()


def test_manifest_loader_refuses_devices_and_fifos(tmp_path: Path) -> None:
    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), fifo):
        code, _, err = invoke("validate", str(path))
        assert code == 2 and "not a regular file" in err


def test_runs_lists_stored_runs(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("runs", "--db", str(db))
    assert code == 0
    assert RUN_ID in out
    assert "SUCCEEDED" in out


def test_unknown_run_id_is_one_line_and_non_zero(db: Path) -> None:
    SqliteStore(db)
    for command in ("results", "report"):
        code, out, err = invoke(command, "no-such-run", "--db", str(db))
        assert code != 0
        assert err.strip().count("\n") == 0
        assert "no run with id 'no-such-run'" in err
        assert "Traceback" not in out + err


def test_results_table_ranks_and_recommends(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("results", RUN_ID, "--db", str(db))
    assert code == 0, out
    assert "n/a (CPU)" in out
    assert "Recommendation" in out
    assert out.index("b8-a2 ") < out.index("b2-a8")  # faster at the same price ranks first
    assert "priced: local $0.096/h on-demand (manifest" in out  # the rate with its kind


def test_results_json(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("results", RUN_ID, "--format", "json", "--db", str(db))
    assert code == 0, out
    payload = json.loads(out)
    assert payload["run_id"] == RUN_ID
    assert payload["status"] == "SUCCEEDED"
    by_variant = {j["variant"]: j for j in payload["jobs"]}
    assert by_variant["b8-a2"]["rank"] == 1
    assert by_variant["b8-a2"]["tokens_per_s"] == pytest.approx(9000.0)
    assert by_variant["b8-a2"]["usd_per_million_tokens"] == pytest.approx(0.096 / 3600 / 9000 * 1e6)
    assert by_variant["b8-a2-nopack"]["rank"] is None
    assert "per_device_train_batch_size" in by_variant["b8-a2-nopack"]["note"]
    assert payload["recommendation"]["job_name"] == by_variant["b8-a2"]["job_name"]


def test_results_csv(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("results", RUN_ID, "-f", "csv", "--db", str(db))
    assert code == 0, out
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["variant"] for r in rows] == ["b8-a2", "b2-a8", "b8-a2-nopack"]
    assert float(rows[0]["tokens_per_s"]) == pytest.approx(9000.0)
    assert rows[2]["tokens_per_s"] == ""
    assert {r["spot"] for r in rows} == {"false"}  # as --format json spells it, not Python's "False"


def test_results_reprice_keeps_the_manifest_price(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("results", RUN_ID, "--format", "json", "--reprice", "--db", str(db))
    assert code == 0, out
    payload = json.loads(out)
    assert payload["repriced"] is True
    best = next(j for j in payload["jobs"] if j["variant"] == "b8-a2")
    assert best["usd_per_million_tokens"] == pytest.approx(0.096 / 3600 / 9000 * 1e6)


def test_report_prints_the_markdown(db: Path) -> None:
    _stored_run(db)
    code, out, _ = invoke("report", RUN_ID, "--db", str(db))
    assert code == 0
    assert "# quickstart report" in out


def test_report_open_without_a_display_says_why_no_browser_starts(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a Linux shell with Chromium installed but no display (as over ssh): Python's webbrowser finds nothing
    _stored_run(db)
    (db.parent / "report" / "report.html").write_text("<html></html>")
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "BROWSER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setattr(cli.webbrowser, "open", lambda _uri: False)
    code, out, _ = invoke("report", RUN_ID, "--open", "--db", str(db))
    # Then it says the display is what is missing, and where the file is
    assert code == 0
    text = " ".join(out.split())
    assert "there is no graphical display (DISPLAY and WAYLAND_DISPLAY are unset)" in text
    assert "report.html where you have one" in text
    monkeypatch.setenv("DISPLAY", ":0")
    code, out, _ = invoke("report", RUN_ID, "--open", "--db", str(db))
    assert "no browser was found to start (set BROWSER to one)" in " ".join(out.split())


def test_unexpected_errors_are_one_line_with_a_debug_hint(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> object:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(cli, "open_store", broken)
    code, out, err = invoke("runs", "--db", str(db))
    assert code == 1
    assert "RuntimeError: disk on fire" in err
    assert "--debug" in err
    assert "Traceback" not in out + err
    result = runner.invoke(cli.app, ["--debug", "runs", "--db", str(db)])
    assert isinstance(result.exception, RuntimeError)


def test_python_dash_m_gpuscout_works() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpuscout", "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("validate", "plan", "local", "runs", "results", "report", "catalog", "compare", "delete"):
        assert command in proc.stdout
    # flags are shown as flags (not "--debug <bool>"), a manifest argument as FILE
    assert "<bool>" not in proc.stdout and "--debug    Show full tracebacks" in proc.stdout
    usage = subprocess.run([sys.executable, "-m", "gpuscout", "validate", "--help"], capture_output=True, text=True,
                           check=False, timeout=60).stdout  # fmt: skip
    assert "FILE" in usage and "{file}" not in usage and "<bool>" not in usage


def test_a_runs_dir_the_file_system_refuses_is_a_clear_error_and_no_database_is_made(tmp_path: Path) -> None:
    """/proc exists and, as root, is 'writable', yet nothing can be created in it: once an 'unexpected error'."""
    db = tmp_path / "g.db"
    code, out, err = invoke("local", str(QUICKSTART), "--runs-dir", "/proc/gpuscout-nope", "--db", str(db))
    assert code == 1 and "--runs-dir /proc/gpuscout-nope: cannot create it" in " ".join(err.split())
    assert "unexpected error" not in out + err and not db.exists()


def test_an_invalid_manifest_creates_no_database(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nvariants: 3\n")
    db = tmp_path / "g.db"
    code, _, err = invoke("local", str(bad), "--db", str(db))
    assert code == 2 and "variants" in err and not db.exists()


def test_validate_lists_what_this_machine_refuses_for_a_local_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given this machine is a CPU, and a quickstart asking for bf16 with a variant on flex attention (both passed
    # `validate` before; bf16 was refused only by `plan`, flex failed every job after data preparation)
    from gpuscout.domain import catalog

    cpu = catalog.LocalHardware(device="cpu", cpu_model="test cpu", cpu_count=2, memory_gib=16)
    monkeypatch.setattr(catalog, "detect_local_hardware", lambda: cpu)
    data = yaml.safe_load(QUICKSTART.read_text())
    data["training"]["precision"] = "bf16"
    data["variants"][1]["attention"] = "flex"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    # When it is validated
    result = CliRunner(env={"COLUMNS": "200"}).invoke(cli.app, ["validate", str(path)])
    # Then both are listed with their field paths, exit 3 as `plan` refuses
    assert result.exit_code == 3, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"error: {path}: 2 refusal(s): `gpuscout plan` and `gpuscout local` refuse them"
    assert lines[1].startswith("  - training.precision: bf16 is not supported by targets[0] local")
    assert lines[2].startswith("  - variants[1]: 'b4-a1' on targets[0] local: attention flex has no backward pass")
    # and a manifest this machine can run still validates
    assert CliRunner().invoke(cli.app, ["validate", str(QUICKSTART)]).exit_code == 0
