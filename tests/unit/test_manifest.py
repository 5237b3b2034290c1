import json
from pathlib import Path

import pytest
import yaml

from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import MAX_MANIFEST_BYTES, load_manifest, parse_manifest
from gpuscout.errors import ManifestError
from gpuscout.paths import MANIFESTS_DIR

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "manifests"
CATALOG = load_catalog()


def base() -> dict:
    return yaml.safe_load((FIXTURES / "local-and-p3.yaml").read_text())


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(data), "m.json", CATALOG)
    assert info.value.source == "m.json"
    return {p.path: p.message for p in info.value.problems}


@pytest.mark.parametrize("path", sorted(MANIFESTS_DIR.glob("*.yaml")) + sorted(FIXTURES.glob("*.*")))
def test_examples_validate(path):
    m = load_manifest(path, CATALOG)
    assert isinstance(m, Manifest)


def test_json_and_yaml_agree():
    y = load_manifest(FIXTURES / "local-and-p3.yaml", CATALOG)
    j = load_manifest(FIXTURES / "local.json", CATALOG)
    assert y.model_dump(exclude={"name"}) == j.model_dump(exclude={"name"})
    sniffed = parse_manifest((FIXTURES / "local.json").read_bytes(), "s3://bucket/manifests/x", CATALOG)
    assert sniffed.name == "json-demo"


def test_defaults():
    m = parse_manifest(json.dumps(base()), "m.json", CATALOG)
    assert m.tokenizer.resolved_vocab_size == 4096
    assert m.dataset.min_characters == 20 and m.dataset.validation_fraction == 0.05
    assert m.training.stop_rule.kind == "fixed" and m.training.stop_rule.ci_tolerance == 0.02
    assert m.repetitions == 1 and m.objective == "cheapest_per_token" and m.network_isolation is False
    v = m.variants[0]
    assert (v.deepspeed_stage, v.packing, v.attention, v.fused_adamw) == (0, True, "sdpa", False)


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (lambda d: d.update(name="Has Space"), "name", "lowercase"),
        (lambda d: d.update(name="x" * 41), "name", "1-40"),
        (lambda d: d.update(surprise=1), "surprise", "allowed: name, description"),
        (lambda d: d["model"].update(hf_id="Qwen/Qwen2.5-7B"), "model", "exactly one of preset, hf_id, path"),
        (lambda d: d.update(model={}), "model", "exactly one"),
        (lambda d: d.update(model={"path": "s3://my-bucket/models/m/"}), "model", "set model.architecture"),
        (lambda d: d["model"].update(preset="gpt-5"), "model.preset", "allowed: qwen2-tiny"),
        (lambda d: d["tokenizer"].update(kind="hf"), "tokenizer", "needs path"),
        (lambda d: d["tokenizer"].update(kind="sentencepiece"), "tokenizer.kind", "'qwen', 'bpe' or 'hf'"),
        (lambda d: d["dataset"].update(source="bundled:wiki"), "dataset.source", "bundled:hebrew-bible"),
        (lambda d: d["dataset"].update(source="s3://"), "dataset.source", "s3://bucket/prefix"),
        (lambda d: d["dataset"].update(format="csv"), "dataset.format", "'jsonl'"),
        (lambda d: d["dataset"].update(validation_fraction=0.7), "dataset.validation_fraction", "less than 0.5"),
        (lambda d: d.update(sequence_length=0), "sequence_length", "greater than or equal to 16"),
        (lambda d: d.update(sequence_length=8192), "sequence_length", "max_position_embeddings"),
        (lambda d: d["training"].update(max_tokens=1000), "training", "exactly one of max_steps, max_tokens"),
        (lambda d: d["training"].pop("max_steps"), "training", "exactly one of max_steps, max_tokens"),
        (lambda d: d["training"].update(warmup_steps=30), "training", "warmup_steps at most 28"),
        # a job whose warm-up leaves fewer than 2 timed steps passes nothing (train.py and the analysis refuse it)
        (lambda d: d["training"].update(max_steps=1), "training", "leaves 1 timed (the automatic warm-up"),
        (lambda d: d["training"].update(max_steps=4), "training", "give max_steps 5 or more"),
        (lambda d: d["training"].update(learning_rate=-1), "training.learning_rate", "greater than 0"),
        (lambda d: d["training"].update(precision="bf16"), "training.precision", "ml.p3.2xlarge"),
        (lambda d: d["targets"][1].update(instance_type="ml.p9.xlarge"), "targets[1].instance_type", "ml.p5.48xlarge"),
        (lambda d: d["targets"][1].update(instance_type="ml.m5.xlarge"), "targets[1].instance_type", "processing"),
        (lambda d: d["targets"][0].pop("price_per_hour_usd"), "targets[0].price_per_hour_usd", "costs per hour"),
        (lambda d: d["targets"][0].update(spot=True), "targets[0].spot", "cannot be spot"),
        (lambda d: d["targets"][1].update(max_wait_hours=3), "targets[1].max_wait_hours", "spot: true"),
        (lambda d: d["targets"].append({"instance_type": "ml.p3.2xlarge"}), "targets[2]", "same instance_type"),
        (lambda d: d.update(targets=[]), "targets", "at least 1"),
        (lambda d: d["variants"].append({"name": "base"}), "variants[1].name", "duplicate"),
        (lambda d: d["variants"][0].update(per_device_batch_size=0), "variants[0].per_device_batch_size", ">= 1"),
        (lambda d: d["variants"][0].update(deepspeed_stage=1), "variants[0].deepspeed_stage", "0, 2 or 3"),
        (lambda d: d["variants"][0].update(deepspeed_stage=3), "variants[0].deepspeed_stage", "1 GPU"),
        (lambda d: d["constraints"].update(budget_usd=0), "constraints.budget_usd", "greater than 0"),
        (lambda d: d.pop("constraints"), "constraints", "required"),
        (lambda d: d.update(objective="cheapest_within_deadline"), "constraints.deadline_hours", "deadline"),
        (lambda d: d.update(objective="vibes"), "objective", "'fastest'"),
        (lambda d: d.update(repetitions=0), "repetitions", "greater than or equal to 1"),
        (lambda d: d.update(model={"preset": "qwen2.5-0.5b"}, tokenizer={"kind": "hf", "path": "x"}), None, None),
        (lambda d: d.update(model={"hf_id": "Qwen/Qwen2.5-0.5B"}), "tokenizer.kind", "random-init"),
    ],
)
def test_each_rule(mutate, path, fragment):
    data = base()
    mutate(data)
    if path is None:
        parse_manifest(json.dumps(data), "m.json", CATALOG)
        return
    found = problems(data)
    assert path in found, found
    assert fragment.replace(">= 1", "greater than or equal to 1") in found[path]


def test_three_mistakes_reported_together():
    data = base()
    data["name"] = "Bad Name"
    data["targets"][1]["instance_type"] = "ml.p7.nope"
    data["variants"][0]["gradient_accumulation_steps"] = -2
    found = problems(data)
    assert {"name", "targets[1].instance_type", "variants[0].gradient_accumulation_steps"} <= set(found)
    err = ManifestError("m.json", [])
    assert err.exit_code == 2


def test_error_message_lists_every_problem():
    data = base()
    data["training"]["precision"] = "bf16"
    data["variants"].append({"name": "base"})
    with pytest.raises(ManifestError) as info:
        parse_manifest(json.dumps(data), "manifests/x.json", CATALOG)
    text = str(info.value)
    assert text.startswith("manifests/x.json: 2 problem(s)")
    assert "training.precision" in text and "variants[1].name" in text
    assert info.value.to_dict()["problems"][0]["path"]


def test_resolved_precision():
    m = parse_manifest(json.dumps(base()), "m.json", CATALOG)
    local, p3 = m.targets
    assert m.resolved_precision(p3, CATALOG) == "fp16"
    assert m.resolved_precision(local, CATALOG) == "fp32"
    gpu = LocalHardware(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", gpu_sku="H100-SXM5-80GB", gpu_count=1)
    assert m.resolved_precision(local, CATALOG, gpu) == "bf16"
    data = base()
    data["targets"][1]["instance_type"] = "ml.g5.8xlarge"
    g5 = parse_manifest(json.dumps(data), "m.json", CATALOG)
    assert g5.resolved_precision(g5.targets[1], CATALOG) == "bf16"
    data["training"]["precision"] = "fp32"
    explicit = parse_manifest(json.dumps(data), "m.json", CATALOG)
    assert explicit.resolved_precision(explicit.targets[1], CATALOG) == "fp32"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"a: &x [1]\nb: *x\n", "anchors and aliases"),
        (b"name: a\nname: b\n", "duplicate key 'name'"),
        (b"1: a\n", "plain strings"),
        (b"? [a, b]\n: c\n", "plain strings"),
        (b'"na\\x07me": a\n', "control character"),
        (b"name: caf\xe9\n", "offset 9"),
        (b"- a\n- b\n", "not list"),
        (b"", "not empty"),
        (b"name: [unclosed\n", "invalid YAML at line"),
        (b'{"name": "a", "name": "b"}', "duplicate key"),
        (b'{"budget": Infinity}', "Infinity"),
        (b"[" * 100 + b"]" * 100, "nesting"),
    ],
)
def test_unsafe_or_broken_input(raw, fragment):
    with pytest.raises(ManifestError) as info:
        parse_manifest(raw, "bad.yaml" if not raw.startswith(b"{") else "bad.json", CATALOG)
    assert fragment in str(info.value)


def test_size_limit(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * MAX_MANIFEST_BYTES + b"\n")
    with pytest.raises(ManifestError, match="at most"):
        load_manifest(big, CATALOG)
    with pytest.raises(ManifestError, match="at most"):
        parse_manifest("#" * (MAX_MANIFEST_BYTES + 1), "s3://b/k", CATALOG)


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "nope.yaml", CATALOG)


def test_a_relative_dataset_source_resolves_against_the_manifest_folder(tmp_path, monkeypatch):
    # Given a manifest in project/ naming data/corpus.jsonl beside it, run from another folder
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "corpus.jsonl").write_text('{"text": "hello"}\n')
    data = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    data["dataset"]["source"] = "data/corpus.jsonl"
    (project / "m.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    # Then the source is found there
    manifest = load_manifest(project / "m.yaml")
    assert manifest.dataset.source == str((project / "data" / "corpus.jsonl").resolve())
    # and a missing one fails validation with the field path and where it looked
    data["dataset"]["source"] = "data/missing.jsonl"
    (project / "m.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ManifestError) as err:
        load_manifest(project / "m.yaml")
    assert "dataset.source: data/missing.jsonl: no such file or folder" in str(err.value)
    assert f"resolved against the manifest's folder {project}" in str(err.value)


def test_a_whole_number_written_as_text_is_refused_and_a_decimal_in_yaml_exponent_form_is_not():
    # Given max_steps and a micro-batch quoted (text in YAML), and a learning rate YAML 1.1 reads as text (1e-3)
    data = base()
    data["training"]["max_steps"] = "12"
    data["variants"][0]["per_device_batch_size"] = "4"
    data["training"]["learning_rate"] = "1e-3"
    found = problems(data)
    # Then both whole numbers are named, with what to do, and nothing else is
    assert found == {
        "training.max_steps": "a whole number, not the text '12' (remove the quotes)",
        "variants[0].per_device_batch_size": "a whole number, not the text '4' (remove the quotes)",
    }
    del data["training"]["max_steps"], data["variants"][0]["per_device_batch_size"]
    data["training"]["max_steps"] = 12
    assert parse_manifest(json.dumps(data), "m.json", CATALOG).training.learning_rate == pytest.approx(1e-3)


def test_an_unreadable_file_inside_a_source_folder_fails_validate(tmp_path, monkeypatch):
    import os

    from gpuscout.domain import manifest_loader

    # Given a source folder with two readable files, one this user cannot read, and files data preparation skips
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.jsonl", "sub/b.txt", "sub/locked.jsonl", "notes.md", ".hidden.jsonl"):
        (folder / name).write_text('{"text": "x"}\n')
    locked = folder / "sub" / "locked.jsonl"
    real_access = os.access
    # (the suite may run as root, whom chmod does not stop: the permission is what os.access answers)
    monkeypatch.setattr(manifest_loader.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode))
    data = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    data["dataset"] = {"source": str(folder)}
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(data))
    # Then validate names the field and the file, not a failure minutes later in data preparation
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest)
    (problem,) = info.value.problems
    assert problem.path == "dataset.source" and problem.message.endswith("not readable inside it: sub/locked.jsonl")
    # and once it is readable, the folder passes (the skipped .md and hidden files are not its concern)
    monkeypatch.setattr(manifest_loader.os, "access", real_access)
    assert load_manifest(manifest).dataset.source == str(folder)


def test_the_loader_reads_a_folder_as_data_preparation_does():
    from gpuscout_data import sources as data_sources

    from gpuscout.domain.manifest_loader import TEXT_SUFFIXES

    assert TEXT_SUFFIXES == data_sources.TEXT_SUFFIXES


@pytest.mark.parametrize(
    ("files", "text_field", "says"),
    [
        ({}, "text", "no .jsonl/.json/.txt/.parquet files in it"),
        ({"data.csv": "text,label\nshalom,1\n"}, "text", "no .jsonl/.json/.txt/.parquet files in it"),
        ({"a.jsonl": ""}, "text", "a.jsonl is empty"),
        ({"a.jsonl": '{"body": "shalom olam"}\n{"body": "boker tov"}\n'}, "text",
         "none of its first 2 record(s) has a string field 'text'; its records have: body; set dataset.text_field"),
        ({"a.jsonl": "shalom olam\nboker tov\n"}, "text", "its first 2 line(s) are not JSON"),
    ],
)  # fmt: skip
def test_validate_looks_into_a_local_source_before_anything_runs(
    tmp_path: Path, files: dict[str, str], text_field: str, says: str
) -> None:
    # Given a source folder data preparation could not use
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    data = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    data["dataset"] = {"source": str(folder), "text_field": text_field}
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(data))
    # Then validate (and plan, and local: the same loader) names it, before a run exists
    with pytest.raises(ManifestError) as info:
        load_manifest(manifest)
    (problem,) = info.value.problems
    assert problem.path == "dataset.source" and says in problem.message, problem.message


def test_a_suffixless_file_is_refused_and_a_good_source_passes(tmp_path: Path) -> None:
    data = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    bare = tmp_path / "corpus"
    bare.write_text('{"text": "shalom olam"}\n')
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump({**data, "dataset": {"source": str(bare)}}))
    with pytest.raises(ManifestError, match=r"cannot tell its format from the suffix '\(none\)'"):
        load_manifest(manifest)
    # with the format stated it is read as such, and a record with the field passes
    manifest.write_text(yaml.safe_dump({**data, "dataset": {"source": str(bare), "format": "jsonl"}}))
    assert load_manifest(manifest).dataset.format == "jsonl"
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 1}\n{"text": "shalom olam"}\n')  # one record with the field is enough to go on
    manifest.write_text(yaml.safe_dump({**data, "dataset": {"source": str(good)}}))
    assert load_manifest(manifest).dataset.source == str(good)
