"""Which precisions the CPU multiplies natively (gpuscout.domain.cpu), and what gpuscout local does with it: the
planner's refusal of a 16-bit local CPU job says why, and a user's script asked for bf16 on a CPU without native bf16
is warned about before anything is timed."""

from __future__ import annotations

import pytest

from gpuscout.domain.catalog import LocalHardware, detect_local_hardware, load_catalog
from gpuscout.domain.cpu import bf16_support, cpu_flags, cpuinfo_field, half_precision_argument
from gpuscout.domain.manifest_loader import load_manifest, validate_manifest_data
from gpuscout.errors import PlanError
from gpuscout.local.planning import half_precision_warnings
from gpuscout.paths import REPO_DIR
from gpuscout.plan.planner import plan

CATALOG = load_catalog()
EPYC = {"fpu", "avx", "avx2", "fma"}  # the AVX2-only AMD EPYC of the pool
XEON = EPYC | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
SAPPHIRE = XEON | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "cap", "native"),
    [
        (EPYC, None, False),
        (EPYC, "ALL", False),
        (XEON, None, True),
        (XEON, "avx2", False),  # the test suite's setting: the Xeon runs the EPYC's kernels
        (XEON, "AVX512_CORE", False),
        (XEON, "AVX512_CORE_BF16", True),
        (XEON, "DEFAULT", True),
        (SAPPHIRE, "AVX512_CORE_BF16", True),  # AMX capped off, avx512_bf16 still allowed
        (SAPPHIRE, "AVX512_CORE_VNNI", False),
        (EPYC | {"avx_ne_convert"}, "AVX2_VNNI_2", True),
        (EPYC | {"avx_ne_convert"}, "AVX2", False),
    ],
)
def test_native_bf16_needs_the_instructions_and_onednns_permission(flags, cap, native):
    support = bf16_support(flags, cap)
    assert support.bf16_native is native
    if cap and not native and flags != EPYC:
        assert f"ONEDNN_MAX_CPU_ISA={cap}" in support.reason


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert cpuinfo_field("model name", cpuinfo=info) == "AMD EPYC"
    assert cpuinfo_field("cpu mhz", cpuinfo=info) is None


def test_under_the_suites_kernels_this_machine_has_no_native_bf16():
    """make test caps oneDNN at AVX2 (tests/unit/test_suite_environment.py), so detection says what torch will do
    here, whichever kind of CPU this is."""
    hw = detect_local_hardware()
    if hw.device == "cpu":
        assert hw.cpu_bf16_native is False and hw.cpu_bf16_reason


def test_a_16_bit_local_cpu_job_is_refused_with_the_reason():
    data = {
        "name": "cpu-bf16", "model": {"preset": "qwen2-tiny"}, "tokenizer": {"kind": "bpe"}, "sequence_length": 128,
        "dataset": {"source": "bundled:hebrew-bible"}, "training": {"max_steps": 10, "precision": "bf16"},
        "targets": [{"instance_type": "local", "price_per_hour_usd": 0.2}], "variants": [{"name": "cpu"}],
        "constraints": {"budget_usd": 1},
    }  # fmt: skip
    m = validate_manifest_data(data, "test", CATALOG)
    epyc = LocalHardware(device="cpu", cpu_count=2, memory_gib=16, **_support(EPYC))
    with pytest.raises(PlanError) as info:
        plan(m, CATALOG, run_id="r", local_hardware=epyc)
    text = str(info.value)
    assert "precision bf16 is not supported here (fp32)" in text and "trains in fp32 on a CPU" in text
    assert "no bf16 instructions" in text and "1 % of fp32 speed" in text and "use precision auto or fp32" in text
    xeon = LocalHardware(device="cpu", cpu_count=2, memory_gib=16, **_support(XEON))
    with pytest.raises(PlanError) as info:
        plan(m, CATALOG, run_id="r", local_hardware=xeon)
    assert "trains in fp32 on a CPU" in str(info.value) and "1 %" not in str(info.value)


@pytest.mark.parametrize(
    ("arguments", "asked"),
    [
        ({"bf16": "true"}, "bf16=true"),
        ({"bf16": "auto"}, None),
        ({"bf16": "false"}, None),
        ({"precision": "bf16"}, "precision=bf16"),
        ({"mixed_precision": "fp16"}, "mixed_precision=fp16"),
        ({"mixed_precision": "no"}, None),
        ({"dtype": "float16"}, "dtype=float16"),
        ({"batch_size": 64, "lr": "1e-3"}, None),
    ],
)
def test_a_scripts_16_bit_arguments_are_recognised(arguments, asked):
    assert half_precision_argument(arguments) == asked


def test_a_job_asked_for_bf16_on_a_cpu_without_it_is_warned_about():
    m = load_manifest(REPO_DIR / "examples" / "hf-trainer" / "local.yaml", CATALOG)
    assert m.job is not None
    asked = m.model_copy(update={"job": m.job.model_copy(update={"arguments": {**m.job.arguments, "bf16": "true"}})})
    epyc = LocalHardware(device="cpu", cpu_count=2, memory_gib=16, **_support(EPYC))
    warnings = half_precision_warnings(asked, epyc)
    assert len(warnings) == len(m.variants)
    assert "bf16=true" in warnings[0] and "no bf16 instructions" in warnings[0] and "1 % of fp32" in warnings[0]
    assert half_precision_warnings(m, epyc) == []  # the example passes bf16=auto: the script decides (GPU only)
    xeon = LocalHardware(device="cpu", cpu_count=2, memory_gib=16, **_support(XEON))
    assert half_precision_warnings(asked, xeon) == []


def _support(flags: set[str]) -> dict:
    s = bf16_support(flags, None)
    return {"cpu_bf16_native": s.bf16_native, "cpu_bf16_reason": s.reason}
