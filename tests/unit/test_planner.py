import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuscout.domain.catalog import LocalHardware, load_catalog
from gpuscout.domain.jobspec import JOB_NAME_RE
from gpuscout.domain.manifest_loader import load_manifest, validate_manifest_data
from gpuscout.errors import BudgetExceededError, PlanError
from gpuscout.paths import MANIFESTS_DIR
from gpuscout.plan.device_fit import FLEX_ON_CPU
from gpuscout.plan.jobs import MAX_RUNTIME_S, MIN_RUNTIME_S, make_run_id
from gpuscout.plan.planner import local_refusals, plan

CATALOG = load_catalog()
CPU = LocalHardware(device="cpu", cpu_model="test cpu", cpu_count=2, memory_gib=16)
H100 = LocalHardware(device="cuda", gpu_name="NVIDIA H100 80GB HBM3", gpu_sku="H100-SXM5-80GB", gpu_count=1,
                     gpu_memory_gb=79.6, cpu_count=16, memory_gib=128)  # fmt: skip
HP_KEYS = {
    "run_id", "job_name", "instance_type", "sequence_length", "per_device_train_batch_size",
    "gradient_accumulation_steps", "max_steps", "learning_rate", "weight_decay", "seed", "precision", "packing",
    "attention_implementation", "gradient_checkpointing", "torch_compile", "dataloader_num_workers",
    "deepspeed_stage", "fused_cross_entropy", "fused_adamw", "host_allocator", "stop_rule", "ci_tolerance",
    "min_timed_steps", "eval_interval", "checkpoint_interval", "checkpoint_keep", "validation_batches",
}  # fmt: skip


def manifest(**over):
    data = {
        "name": "sweep",
        "model": {"preset": "qwen2.5-1.5b"},
        "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 2048,
        "training": {"max_steps": 50, "precision": "bf16"},
        "targets": [{"instance_type": "ml.p5.48xlarge"}],
        "variants": [{"name": "b2-a8", "per_device_batch_size": 2, "gradient_accumulation_steps": 8}],
        "constraints": {"budget_usd": 100},
    }
    data.update(over)
    return validate_manifest_data(data, "test", CATALOG)


def test_prediction_hand_checked():
    # qwen2.5-1.5b: N_matmul = 28 x 46,792,704 + 1536 x 151,936 = 1,543,569,408;
    # FLOPs/token = 6 N + 12 x 28 x 12 x 128 x 2048 = 9,261,416,448 + 1,056,964,608 = 10,318,381,056.
    # tokens/s = 0.38 x 8 x 989.4e12 / 10,318,381,056 = 291,496.9
    job = plan(manifest(), CATALOG, run_id="r1").jobs[0]
    p = job.prediction
    assert p.tokens_per_s == pytest.approx(0.38 * 8 * 989.4e12 / 10_318_381_056, rel=1e-9)
    assert p.tokens_per_s == pytest.approx(291_496.9, rel=1e-6)
    assert p.mfu_assumed == pytest.approx(0.38)
    tokens_per_step = 2 * 8 * 8 * 2048
    assert p.training_seconds == pytest.approx(50 * tokens_per_step / p.tokens_per_s)
    assert p.training_seconds == pytest.approx(44.965, abs=1e-3)
    assert p.overhead_seconds == 360
    assert p.cost_usd == pytest.approx((44.965 + 360) / 3600 * 63.296, abs=1e-3)  # SageMaker training, post-cut
    assert job.price is not None and (job.price.kind, job.price.region) == ("snapshot", "us-east-1")
    assert job.max_runtime_seconds == MIN_RUNTIME_S
    assert job.precision == "bf16" and job.deepspeed_config is None and job.gpus_per_instance == 8


def test_hyperparameters_contract():
    m = manifest(training={"max_tokens": 10_000_000, "warmup_steps": 3, "precision": "auto"})
    job = plan(m, CATALOG, run_id="r1").jobs[0]
    hp = job.hyperparameters
    assert set(hp) == HP_KEYS | {"model_preset", "warmup_steps"}
    assert all(isinstance(v, str) for v in hp.values())
    assert hp["max_steps"] == str(-(-10_000_000 // (2 * 8 * 8 * 2048)))
    assert hp["packing"] == "true" and hp["deepspeed_stage"] == "0" and hp["warmup_steps"] == "3"
    auto = plan(manifest(), CATALOG, run_id="r1").jobs[0].hyperparameters
    assert "warmup_steps" not in auto
    hf = manifest(model={"hf_id": "Qwen/Qwen2.5-1.5B"}, tokenizer={"kind": "qwen"})
    assert plan(hf, CATALOG, run_id="r").jobs[0].hyperparameters["model_name_or_path"] == "Qwen/Qwen2.5-1.5B"
    assert "cross_entropy_kernel" not in auto  # auto: train.py's default (the chunked loss)
    torch_ce = manifest(variants=[{"name": "t", "fused_cross_entropy": True, "cross_entropy_kernel": "torch"}])
    assert plan(torch_ce, CATALOG, run_id="r").jobs[0].hyperparameters["cross_entropy_kernel"] == "torch"


def test_a_cross_entropy_kernel_without_the_fused_loss_is_refused():
    from gpuscout.errors import ManifestError

    with pytest.raises(ManifestError, match="cross_entropy_kernel: liger chooses a fused loss"):
        manifest(variants=[{"name": "l", "cross_entropy_kernel": "liger"}])


def test_zero3_spot_and_multi_node():
    m = manifest(
        targets=[{"instance_type": "ml.p4d.24xlarge", "instance_count": 2, "spot": True,
                  "spot_price_per_hour_usd": 12.0}],
        variants=[{"name": "z3", "deepspeed_stage": 3, "per_device_batch_size": 1, "gradient_accumulation_steps": 1}],
    )  # fmt: skip
    job = plan(m, CATALOG, run_id="r").jobs[0]
    assert job.deepspeed_config == "zero3.json" and job.spot and job.spot_price_per_hour_usd == 12.0
    p = job.prediction
    assert p.mfu_assumed == pytest.approx(0.40 * 0.9 * 0.9)
    assert p.cost_usd == pytest.approx((p.training_seconds + 360) / 3600 * 12.0 * 2)


def test_budget_refusal():
    p = plan(manifest(constraints={"budget_usd": 5}), CATALOG, run_id="r")
    with pytest.raises(BudgetExceededError, match=r"exceeds the budget of \$5\.00"):
        p.check_budget()
    plan(manifest(), CATALOG, run_id="r").check_budget()


def test_memory_refusal():
    m = manifest(model={"preset": "qwen2.5-7b"}, targets=[{"instance_type": "ml.g5.8xlarge"}])
    # one 24 GB GPU: 7B's states alone are 16 B x 7.6 G parameters; no ZeRO without a second GPU
    needs = r"needs ~\d+\.\d GB \(\+-\d+\.\d GB, the memory model's stated uncertainty\) per GPU"
    usable = r" but only 21.6 GB of its 24 GB is usable \(90%\).*nothing but a larger instance"
    with pytest.raises(PlanError, match=needs + usable) as info:
        plan(m, CATALOG, run_id="r")
    assert "deepspeed_stage" not in str(info.value)
    zero3_7b = manifest(
        model={"preset": "qwen2.5-7b"},
        targets=[{"instance_type": "ml.p4d.24xlarge"}],
        variants=[{"name": "z3", "deepspeed_stage": 3, "per_device_batch_size": 1, "gradient_checkpointing": True}],
    )
    assert plan(zero3_7b, CATALOG, run_id="r").jobs  # 7B fits on 8x 40 GB with ZeRO-3


def test_every_refusal_of_a_plan_comes_in_one_error():
    # Given 2 targets x 2 variants: the large micro-batch does not fit the 24 GB GPU, and on the H100 its steps are so
    # large that max_tokens makes 4 of them (1 timed); the small micro-batch can be planned on both
    m = manifest(
        model={"preset": "qwen2.5-0.5b"},
        sequence_length=2048,
        training={"max_tokens": 200_000},
        targets=[{"instance_type": "ml.g5.8xlarge"}, {"instance_type": "ml.p5.4xlarge"}],
        variants=[{"name": "b8", "per_device_batch_size": 8}, {"name": "b1", "per_device_batch_size": 1}],
    )
    # When it is planned, Then one PlanError names each refused job with its reason: a user fixes them in one round
    with pytest.raises(PlanError) as info:
        plan(m, CATALOG, run_id="r")
    text = str(info.value)
    lines = [line for line in text.splitlines() if line.startswith("  - ")]
    assert text.startswith("2 jobs cannot be planned:") and len(lines) == 2, text
    assert lines[0].startswith("  - targets[0] ml.g5.8xlarge, variant 'b8': needs ~")
    assert lines[1].startswith("  - targets[1] ml.p5.4xlarge, variant 'b8': training.max_tokens 200,000 is 4 step(s)")
    assert lines[1].endswith("give max_tokens 327,680 or more")


SINGLE_CHANGES = {
    "gradient_checkpointing: true": {"gradient_checkpointing": True},
    "fused_cross_entropy: true": {"fused_cross_entropy": True},
    "deepspeed_stage: 3": {"deepspeed_stage": 3},
}


def test_the_memory_refusal_says_what_would_fit_and_it_does():
    # an HF Trainer baseline: Qwen2.5-1.5B, micro-batch 4 x 4,096 tokens, plain loss, no checkpointing
    big = {"name": "b4", "per_device_batch_size": 4, "gradient_accumulation_steps": 4}

    def planned(**change):
        return plan(manifest(sequence_length=4096, variants=[{**big, **change}]), CATALOG, run_id="r")

    needs = r"needs ~\d+\.\d GB \(\+-\d+\.\d GB, the memory model's stated uncertainty\) per GPU"
    with pytest.raises(PlanError, match=needs + r" but only 72.0 GB of its 80 GB is usable.*would fit: ") as info:
        planned()
    text = " ".join(str(info.value).split())
    batch = int(re.search(r"would fit: per_device_batch_size (\d+) with (\d+)x", text).group(1))
    assert 1 <= batch < 4 and 4 % batch == 0
    assert planned(per_device_batch_size=batch, gradient_accumulation_steps=4 * 4 // batch).jobs
    with pytest.raises(PlanError):
        planned(per_device_batch_size=batch + 1)
    assert "gradient_checkpointing: true" in text
    for words, change in SINGLE_CHANGES.items():  # what it suggests fits, what it leaves out does not
        if words in text:
            assert planned(**change).jobs, words
        else:
            with pytest.raises(PlanError):
                planned(**change)


@pytest.mark.parametrize("path", sorted(MANIFESTS_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_manifest_plans(path):
    # `local` is the 2-core CPU box for the quickstart; hopper-h100.yaml is written for one rented H100
    local = H100 if path.name.startswith("hopper") else CPU
    assert plan(load_manifest(path, CATALOG), CATALOG, run_id="r", local_hardware=local).jobs


def test_local_cpu_prediction_is_measured():
    m = manifest(
        model={"preset": "qwen2-tiny"},
        tokenizer={"kind": "bpe"},
        sequence_length=256,
        training={"max_steps": 10},
        targets=[{"instance_type": "local", "price_per_hour_usd": 0.2}],
        variants=[{"name": "cpu"}],
    )
    job = plan(m, CATALOG, run_id="r", local_hardware=CPU).jobs[0]
    assert job.precision == "fp32" and job.gpus_per_instance == 0
    assert job.prediction.mfu_assumed is None and job.prediction.overhead_seconds == 0
    assert job.prediction.tokens_per_s > 0 and "measured" in job.prediction.method
    assert job.hyperparameters["per_device_train_batch_size"] == "8"  # local.json default


def test_make_run_id():
    a = make_run_id("My Run!", key="manifests/x.yaml", etag="abc")
    assert a == make_run_id("My Run!", key="manifests/x.yaml", etag="abc")
    assert a != make_run_id("My Run!", key="manifests/x.yaml", etag="abd")
    assert re.fullmatch(r"my-run-[0-9a-f]{12}", a)
    r1, r2 = make_run_id("demo"), make_run_id("demo")
    assert r1 != r2 and re.fullmatch(r"demo-\d{8}-\d{6}-[0-9a-f]{6}", r1)
    assert len(make_run_id("x" * 200)) <= 48


slugs = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", fullmatch=True)
# the types the FLOPs model can predict and that can be bought on demand (the others are refused: tests below)
TRAINING_TYPES = [
    t for t in CATALOG.training_types
    if t != "local" and (sku := CATALOG.get(t).sku) is not None and sku.plannable and CATALOG.get(t).on_demand
]  # fmt: skip


@st.composite
def manifests(draw):
    targets = draw(
        st.lists(
            st.tuples(st.sampled_from([*TRAINING_TYPES, "local"]), st.integers(1, 3), st.booleans()),
            min_size=1, max_size=6, unique=True,
        )
    )  # fmt: skip
    target_dicts = {}
    for itype, count, asked_spot in targets:
        if itype == "local":
            target_dicts["local"] = {"instance_type": "local", "price_per_hour_usd": 0.5}
        else:
            inst = CATALOG.get(itype)
            spot = asked_spot and inst.spot_offered
            target = {"instance_type": itype, "instance_count": count, "spot": spot}
            if inst.price is None:  # no published rate: the manifest states one
                target["price_per_hour_usd"] = 50.0
            target_dicts[(itype, count, spot)] = target
    names = draw(st.lists(slugs, min_size=1, max_size=5, unique=True))
    return {
        "name": draw(slugs),
        "model": {"preset": "qwen2-tiny"},
        "tokenizer": {"kind": "bpe"},
        "dataset": {"source": "bundled:hebrew-chatterbot"},
        "sequence_length": 128,
        "training": {"max_steps": draw(st.integers(5, 1000))},
        "targets": list(target_dicts.values()),
        "variants": [{"name": n, "per_device_batch_size": draw(st.integers(1, 8))} for n in names],
        "repetitions": draw(st.integers(1, 3)),
        "constraints": {"budget_usd": 1000},
    }


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests(), st.text(min_size=1, max_size=80))
def test_job_names_unique_and_valid(data, run_name):
    m = validate_manifest_data(data, "generated", CATALOG)
    run_id = make_run_id(run_name)
    p = plan(m, CATALOG, run_id=run_id, local_hardware=CPU)
    names = [j.job_name for j in p.jobs]
    assert len(names) == len(m.targets) * len(m.variants) * m.repetitions
    assert len(set(names)) == len(names)
    run_hash = names[0].split("-")[1]
    for job in p.jobs:
        assert JOB_NAME_RE.match(job.job_name) and len(job.job_name) <= 63
        assert job.job_name.startswith(f"gs-{run_hash}-t{job.target_index}v")
        assert f"r{job.repetition}" in job.job_name
        assert MIN_RUNTIME_S <= job.max_runtime_seconds <= MAX_RUNTIME_S
        assert job.prediction.cost_usd >= 0


def test_repetitions_run_interleaved_across_variants():
    # r0 of every target x variant, then r1: a slow period of a shared machine hits every variant, not one.
    variants = [
        {"name": "b8-a2", "per_device_batch_size": 8, "gradient_accumulation_steps": 2, "gradient_checkpointing": True},
        {"name": "b4-a4", "per_device_batch_size": 4, "gradient_accumulation_steps": 4, "fused_cross_entropy": True},
        {"name": "b2-a8", "per_device_batch_size": 2, "gradient_accumulation_steps": 8},
    ]
    jobs = plan(manifest(variants=variants, repetitions=2), CATALOG, run_id="r").jobs
    assert [(j.repetition, j.variant_name) for j in jobs] == [
        (0, "b8-a2"), (0, "b4-a4"), (0, "b2-a8"), (1, "b8-a2"), (1, "b4-a4"), (1, "b2-a8"),
    ]  # fmt: skip


def test_local_predictions_use_the_tokenizers_real_vocabulary_and_measured_start_up(monkeypatch):
    # Seen: a qwen tokenizer on qwen2-tiny predicted at 21,994 tok/s, measured 158: the 151,665-token output layer
    # was left out of the FLOPs. And a local prediction without the process start-up is seconds short.
    import gpuscout.plan.planner as planner_module

    monkeypatch.setattr(planner_module, "measure_matmul_flops", lambda *a, **k: 50e9)
    base = {
        "name": "tiny",
        "model": {"preset": "qwen2-tiny"},
        "dataset": {"source": "bundled:hebrew-bible"},
        "sequence_length": 256,
        "training": {"max_steps": 20, "precision": "fp32"},
        "targets": [{"instance_type": "local", "price_per_hour_usd": 0.096}],
        "variants": [{"name": "b4", "per_device_batch_size": 4}],
        "constraints": {"budget_usd": 1.0},
    }
    hw = CPU.model_copy(update={"startup_s": 4.2})
    bpe = plan(validate_manifest_data({**base, "tokenizer": {"kind": "bpe"}}, "t", CATALOG), CATALOG, run_id="r",
               local_hardware=hw).jobs[0]  # fmt: skip
    qwen = plan(validate_manifest_data({**base, "tokenizer": {"kind": "qwen"}}, "t", CATALOG), CATALOG, run_id="r",
                local_hardware=hw).jobs[0]  # fmt: skip
    assert bpe.prediction.tokens_per_s / qwen.prediction.tokens_per_s > 20
    assert qwen.prediction.overhead_seconds == 4.2 and "start-up 4.2 s (measured)" in qwen.prediction.method


def test_the_planner_and_train_py_agree_on_the_vocabulary():
    from gpuscout.domain.models import QWEN_TOKENIZER_VOCAB, training_vocab

    assert training_vocab("qwen2-tiny", 4096, QWEN_TOKENIZER_VOCAB) == QWEN_TOKENIZER_VOCAB
    assert training_vocab("qwen2.5-1.5b", 151_936, QWEN_TOKENIZER_VOCAB) == 151_936
    assert training_vocab("qwen2.5-1.5b", 151_936, None) == 151_936


def test_the_planners_memory_counts_gradients_at_the_loss_only_when_they_exist():
    """One GPU at accumulation 1 runs the loss before any gradient exists (set_to_none); accumulating, they exist."""
    from gpuscout.domain.flops import total_params
    from gpuscout.domain.manifest_training import Variant
    from gpuscout.domain.models import PRESETS
    from gpuscout.plan.planner import memory_per_gpu_gb

    a = PRESETS["qwen2.5-1.5b"]
    v = Variant(name="v", per_device_batch_size=2, fused_cross_entropy=True)
    args = dict(seq=4096, batch=2, precision="bf16", stage=0, variant=v)
    alone = memory_per_gpu_gb(a, world=1, accumulation=1, **args)
    accumulating = memory_per_gpu_gb(a, world=1, accumulation=4, **args)
    assert accumulating - alone == pytest.approx(4 * total_params(a) / 1e9)
    assert memory_per_gpu_gb(a, world=1, **args) == accumulating  # unknown accumulation: the larger estimate
    assert memory_per_gpu_gb(a, world=8, accumulation=1, **args) > accumulating  # DDP's buckets + NCCL


def test_settings_a_cpu_cannot_train_with_are_refused_before_anything_runs():
    # Given a local CPU target with a variant on flex attention (it failed every job with NotImplementedError)
    flex = manifest(
        model={"preset": "qwen2-tiny"}, sequence_length=256, training={"max_steps": 5, "precision": "auto"},
        targets=[{"instance_type": "local", "price_per_hour_usd": 0.1}],
        variants=[{"name": "plain"}, {"name": "flexed", "attention": "flex"}],
    )  # fmt: skip
    # Then the plan refuses it naming the variant and what to use instead; on a GPU it plans
    with pytest.raises(PlanError, match=r"targets\[0\] local, variant 'flexed': attention flex has no backward pass"):
        plan(flex, CATALOG, run_id="r", local_hardware=CPU)
    assert plan(flex, CATALOG, run_id="r", local_hardware=H100).jobs
    # and every such problem is listed at once with its field path (what `gpuscout validate` shows)
    bf16 = manifest(
        model={"preset": "qwen2-tiny"}, sequence_length=256, training={"max_steps": 5, "precision": "bf16"},
        targets=[{"instance_type": "local", "price_per_hour_usd": 0.1}],
        variants=[{"name": "plain"}, {"name": "flexed", "attention": "flex"}, {"name": "zero", "deepspeed_stage": 2}],
    )  # fmt: skip
    problems = [(p.path, p.message) for p in local_refusals(bf16, CATALOG, CPU)]
    assert [path for path, _ in problems] == ["training.precision", "variants[1]", "variants[2]"]
    assert problems[0][1].startswith(
        "bf16 is not supported by targets[0] local, which is this machine: a CPU (test cpu)"
    )
    assert problems[1][1] == f"'flexed' on targets[0] local: {FLEX_ON_CPU}"
    assert "ZeRO stage 2 shards across GPUs, not on a CPU; use deepspeed_stage 0" in problems[2][1]
    assert [p.path for p in local_refusals(bf16, CATALOG, H100)] == ["variants[2]"]  # ZeRO: one GPU
