"""A variant's method (full, lora, qlora) from the manifest to train.py: validation with field paths, the refusals a
device makes, the hyperparameters a job receives and train.py reads back, a search over method and rank, and a
variant limited to some targets (docs/manifest.md "Methods")."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from gpuscout_train.args import parse_hyperparameters

from gpuscout.domain.adapters import DEFAULT_TARGET_MODULES, Adapter, adapter_params
from gpuscout.domain.candidates import candidate_name, parse_candidate_name
from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.manifest_loader import parse_manifest, validate_manifest_data
from gpuscout.domain.models import PRESETS
from gpuscout.errors import JobsRefusedError, ManifestError
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.plan.device_fit import QLORA_ON_CPU, device_refusal
from gpuscout.plan.planner import local_refusals, plan

CATALOG = load_catalog()
CPU = LocalHardware(device="cpu", cpu_model="test cpu", cpu_count=2, memory_gib=16, startup_s=1.0)
QUICKSTART = MANIFESTS_DIR / "quickstart.yaml"


def _quickstart(variants: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["variants"] = variants
    data.update(over)
    return data


def _pretrained(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """The quickstart from a pretrained model's folder (QLoRA quantizes pretrained weights, not a preset's)."""
    return _quickstart(variants, model={"path": "models/tiny", "architecture": "qwen2-tiny"},
                       tokenizer={"kind": "hf", "path": "models/tiny"})  # fmt: skip


def _problems(data: dict[str, Any]) -> str:
    with pytest.raises(ManifestError) as err:
        parse_manifest(yaml.safe_dump(data), "m.yaml")
    return " ".join(str(err.value).split())


def test_adapter_settings_are_checked_with_field_paths() -> None:
    text = _problems(_quickstart([
        {"name": "a", "lora": {"rank": 8}},
        {"name": "b", "method": "lora", "deepspeed_stage": 2},
        {"name": "c", "method": "lora", "lora": {"rank": 0, "target_modules": ["q_proj", "q_proj", "lm_head"]}},
        {"name": "d", "method": "dora"},
    ]))  # fmt: skip
    assert "variants[0]: lora: adapter settings need method lora or qlora (method is full)" in text
    assert "method lora trains only the adapters, which ZeRO does not need to shard; use deepspeed_stage 0" in text
    assert "variants[2].lora.rank" in text and "variants[2].lora.target_modules" in text
    assert "variants[3].method" in text
    text = _problems(_quickstart([{"name": "e", "instance_types": ["ml.g6e.xlarge"]}]))
    assert "variants[0].instance_types[0]: ml.g6e.xlarge is not a target; targets: local" in text


def test_a_variant_with_defaults_trains_every_linear_layer_at_rank_16() -> None:
    manifest = parse_manifest(yaml.safe_dump(_quickstart([{"name": "l", "method": "lora"}])), "m.yaml")
    adapter = manifest.variants[0].adapter()
    assert adapter == Adapter("lora", rank=16, alpha=32, dropout=0.0, target_modules=DEFAULT_TARGET_MODULES)
    assert manifest.model_copy().variants[0].adapter() == adapter
    # rank x (in + out) per adapted layer: the tiny preset's 2 blocks, h 64, i 176, 4 heads of 16, 2 kv heads
    per_block = 16 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 176) + (176 + 64))
    assert adapter_params(PRESETS["qwen2-tiny"], adapter) == 2 * per_block


def test_qlora_is_refused_on_a_cpu_by_validate_and_plan() -> None:
    assert device_refusal(deepspeed_stage=0, attention="sdpa", device="cpu", world=1, method="qlora") == QLORA_ON_CPU
    assert device_refusal(deepspeed_stage=0, attention="sdpa", device="cuda", world=1, method="qlora") is None
    manifest = parse_manifest(
        yaml.safe_dump(_pretrained([{"name": "q", "method": "qlora"}, {"name": "l", "method": "lora"}])), "m.yaml"
    )
    assert [(p.path, p.message) for p in local_refusals(manifest, CATALOG, CPU)] == [
        ("variants[0]", f"'q' on targets[0] local: {QLORA_ON_CPU}")
    ]
    with pytest.raises(JobsRefusedError, match="variant 'q': method qlora stores the frozen base in 4 bits"):
        plan(manifest, CATALOG, run_id="r", local_hardware=CPU)


def test_the_adapter_reaches_train_py_as_hyperparameters_and_back() -> None:
    variant = {"name": "l", "method": "lora", "lora": {"rank": 8, "alpha": 16, "dropout": 0.05,
                                                     "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
    manifest = parse_manifest(yaml.safe_dump(_quickstart([variant, {"name": "f"}])), "m.yaml")
    jobs = {j.variant_name: j for j in plan(manifest, CATALOG, run_id="r", local_hardware=CPU).jobs}
    hp = jobs["l"].hyperparameters
    assert {k: hp[k] for k in hp if k.startswith(("method", "lora_"))} == {
        "method": "lora", "lora_rank": "8", "lora_alpha": "16", "lora_dropout": "0.05",
        "lora_target_modules": "q_proj,v_proj",
    }  # fmt: skip
    assert not any(k.startswith(("method", "lora_")) for k in jobs["f"].hyperparameters)  # full: as before
    parsed = parse_hyperparameters([], environ={"SM_HPS": __import__("json").dumps(hp)})
    assert parsed.adapter() == Adapter("lora", rank=8, alpha=16, dropout=0.05, target_modules=("q_proj", "v_proj"))
    full = parse_hyperparameters([], environ={"SM_HPS": __import__("json").dumps(jobs["f"].hyperparameters)})
    assert full.adapter() is None


def test_a_variant_runs_only_on_its_instance_types() -> None:
    data = {
        "name": "lora-vs-full",
        "model": {"preset": "qwen2.5-0.5b"},
        "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 1024,
        "training": {"max_steps": 20},
        "targets": [{"instance_type": "ml.p5.48xlarge"}, {"instance_type": "ml.g6e.xlarge"}],
        "variants": [
            {"name": "full-z3", "deepspeed_stage": 3, "instance_types": ["ml.p5.48xlarge"]},
            {"name": "lora", "method": "lora", "per_device_batch_size": 1, "instance_types": ["ml.g6e.xlarge"]},
        ],
        "constraints": {"budget_usd": 100},
    }
    # ZeRO-3 on the one-GPU g6e would be refused; the variant is not planned there
    jobs = plan(validate_manifest_data(data, "m", CATALOG), CATALOG, run_id="r").jobs
    assert sorted((j.instance_type, j.variant_name) for j in jobs) == [("ml.g6e.xlarge", "lora"),
                                                                       ("ml.p5.48xlarge", "full-z3")]  # fmt: skip


def test_a_search_tries_methods_and_ranks() -> None:
    data = _pretrained([{"name": "base", "dataloader_workers": 0, "lora": {"rank": 4, "alpha": 8}, "method": "lora"}])
    data["search"] = {"space": {"per_device_batch_size": [4], "method": ["full", "lora", "qlora"],
                                "lora_rank": [4, 16]}, "sequences_per_step": 4}  # fmt: skip
    # a token of LoRA training is not a token of full training: only compared at a target loss, never pruned per token
    assert "search.space.method: methods and ranks differ in what a token of training does" in _problems(data)
    data["constraints"]["target_loss"] = 4.0
    assert "and search.pruning.enabled: false" in _problems(data)
    data["search"]["pruning"] = {"enabled": False}
    manifest = parse_manifest(yaml.safe_dump(data), "m.yaml")
    the_plan = plan(manifest, CATALOG, run_id="r", local_hardware=CPU)
    [target] = the_plan.search.targets
    # one full candidate (no rank), two LoRA ranks; QLoRA skipped on the CPU with the reason
    assert target.candidates == ["b4-a1-w0", "b4-a1-lora-r4-w0", "b4-a1-lora-r16-w0"]
    assert [(s.name, s.reason) for s in target.skipped] == [("b4-a1-qlora-r4-w0", QLORA_ON_CPU),
                                                            ("b4-a1-qlora-r16-w0", QLORA_ON_CPU)]  # fmt: skip
    jobs = {j.variant_name: j.hyperparameters for j in the_plan.jobs}
    assert jobs["b4-a1-lora-r16-w0"]["lora_rank"] == "16" and jobs["b4-a1-lora-r16-w0"]["lora_alpha"] == "8"
    assert "method" not in jobs["b4-a1-w0"]
    # a tuning trial reads its settings back from the name
    for name in target.candidates:
        settings = parse_candidate_name(name)
        assert candidate_name(settings, settings["gradient_accumulation_steps"]) == name
    assert parse_candidate_name("b4-a1-lora-r16-w0")["lora_rank"] == 16
    with pytest.raises(ValueError, match="never writes it so"):
        parse_candidate_name("b4-a1-r16-w0")  # a rank without a method


def test_what_adapters_cannot_be_asked_for_is_refused_with_the_reason() -> None:
    # QLoRA quantizes pretrained weights (a preset's are random) and is not measured under torch.compile
    text = _problems(_quickstart([{"name": "q", "method": "qlora", "torch_compile": True}]))
    assert "variants[0].method: qlora quantizes pretrained weights: give model.hf_id or model.path" in text
    assert "variants[0].torch_compile: not with method qlora" in text
    # a target no variant runs on
    data = _quickstart([{"name": "l", "method": "lora", "instance_types": ["local"]}])
    data["targets"].append({"instance_type": "ml.g6e.xlarge"})
    assert "targets[1]: no variant runs on ml.g6e.xlarge (no variant's instance_types name it)" in _problems(data)


def test_qlora_on_this_machines_gpu_needs_bitsandbytes_installed_here() -> None:
    import importlib.util

    refusal = device_refusal(deepspeed_stage=0, attention="sdpa", device="cuda", world=1, method="qlora", local=True)
    if importlib.util.find_spec("bitsandbytes") is None:  # the dev environment: the training image has it
        assert (
            refusal == "method qlora needs bitsandbytes, which is not installed here: pip install bitsandbytes==0.50.2"
        )
    else:
        assert refusal is None
    assert device_refusal(deepspeed_stage=0, attention="sdpa", device="cuda", world=1, method="qlora") is None


def test_lora_under_fp16_keeps_an_fp32_base_and_the_plan_counts_it() -> None:
    from gpuscout.plan.memory import StepSettings, estimate

    seven_b, adapter = PRESETS["qwen2.5-7b"], Adapter("lora")
    bf16, fp16 = (estimate(seven_b, seq=2048, batch=1, world=1, settings=StepSettings(
        precision=p, gradient_checkpointing=True, adapter=adapter)) for p in ("bf16", "fp16"))  # fmt: skip
    assert fp16.frozen_weights == 2 * bf16.frozen_weights  # 4 bytes per weight, not 2
    assert fp16.weight_copies > bf16.weight_copies  # and autocast's 16-bit copies of it
