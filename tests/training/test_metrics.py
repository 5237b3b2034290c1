"""Step statistics, the steady-state stop rule, metric lines and the FLOPs convention."""

from __future__ import annotations

import re

import pytest
from gpuscout_train.metrics import StepRecord, StepStats, default_warmup_steps, percentile

from gpuscout.domain import flops
from gpuscout.domain.metric_lines import METRIC_DEFINITIONS, format_metric_line, parse_metric_line
from gpuscout.domain.models import PRESETS


def _stats(rates: list[float], warmup: int = 3) -> StepStats:
    stats = StepStats(warmup_steps=warmup)
    for i, rate in enumerate(rates, start=1):
        stats.add(StepRecord(i, 1.0, int(rate), 4, 0.0, 1.0, timed=not stats.is_warmup(i)))
    return stats


def test_warmup_default() -> None:
    assert default_warmup_steps(20) == 3
    assert default_warmup_steps(100) == 10
    assert default_warmup_steps(101) == 11
    assert default_warmup_steps(3) == 2  # always one timed step


def test_throughput_interval_uses_the_t_quantile() -> None:
    # Equal step times: the ratio estimator is the plain mean. R = 36 / 3 = 12; residuals -2, 0, 2;
    # s = sqrt(8 / 2) = 2, se = 2 / sqrt(3) / mean(t) = 2 / sqrt(3); half-width = t(0.975, 2) = 4.302653 x se.
    stats = StepStats(warmup_steps=0)
    for i, tokens in enumerate([10, 12, 14], start=1):
        stats.add(StepRecord(i, 1.0, tokens, 4, 0.0, 1.0))
    mean, _low, high = stats.tokens_per_s_ci95()
    assert mean == 12.0 and high - mean == pytest.approx(4.302653 * 2 / 3**0.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)


def test_steady_state_stops_on_a_steady_series_only() -> None:
    steady = _stats([50.0, 70.0, 90.0] + [1000.0 + (7 * i % 5) for i in range(30)])
    stopped_at = None
    for n in range(1, len(steady.records) + 1):
        part = StepStats(warmup_steps=3, records=steady.records[:n])
        done, reason = part.steady_state_reached(ci_tolerance=0.01, min_timed_steps=10)
        if done:
            stopped_at, why = n, reason
            break
    assert stopped_at == 13  # 3 warmup steps + min_timed_steps; the warmup outliers never count
    assert "within +-" in why
    noisy = _stats([1000.0 * (1 + 0.5 * (-1) ** i) for i in range(30)])
    assert noisy.steady_state_reached(ci_tolerance=0.01, min_timed_steps=10) == (False, "")

    # one-second steps: steady after 10 timed steps, yet not before 25 s of timed work when a floor asks for it
    for n in range(1, len(steady.records) + 1):
        part = StepStats(warmup_steps=3, records=steady.records[:n])
        if part.steady_state_reached(ci_tolerance=0.01, min_timed_steps=10, min_timed_seconds=25.0)[0]:
            break
    assert n == 3 + 25


def test_throughput_interval_is_centred_on_the_reported_throughput() -> None:
    # Given noisy step times (one slow step), total tokens / total time is far from the mean of per-step rates;
    # the interval must still contain the reported figure (it is built around that same estimator).
    stats = StepStats(warmup_steps=0)
    for i, seconds in enumerate([1.0, 1.0, 1.0, 5.0, 1.0, 1.0], start=1):
        stats.add(StepRecord(i, seconds, 1000, 4, 0.0, 1.0))
    s = stats.summary()
    assert s["tokens_per_s"] == pytest.approx(6000 / 10)
    low, high = s["tokens_per_s_ci95"]
    assert low < s["tokens_per_s"] < high


def test_summary_excludes_warmup() -> None:
    s = _stats([1.0, 1.0, 1.0, 100.0, 300.0]).summary()
    assert s["timed_steps"] == 2 and s["tokens_per_s"] == 200.0 and s["tokens_timed"] == 400
    assert s["train_time_s"] == 5.0


def test_metric_lines_match_the_sagemaker_regexes() -> None:
    line = format_metric_line({"step": 12, "loss": 4.1234, "tokens_per_s": 1234567.5, "lr": 3e-4, "grad_norm": None})
    assert line == "gpuscout_metric step=12 loss=4.1234 tokens_per_s=1234567.5 lr=0.0003"
    val = format_metric_line({"step": 12, "val_loss": 3.5})
    summary = format_metric_line({"tokens_per_s": 99.5, "mfu": 0.41}, summary=True)
    by_name = {d["Name"]: re.compile(d["Regex"]) for d in METRIC_DEFINITIONS}
    assert float(by_name["train:loss"].search(line).group(1)) == 4.1234  # type: ignore[union-attr]
    assert by_name["train:loss"].search(val) is None  # "val_loss=" is not "loss="
    assert float(by_name["validation:loss"].search(val).group(1)) == 3.5  # type: ignore[union-attr]
    assert float(by_name["train:tokens_per_s"].search(line).group(1)) == 1234567.5  # type: ignore[union-attr]
    assert float(by_name["train:learning_rate"].search(line).group(1)) == 3e-4  # type: ignore[union-attr]
    assert by_name["summary:mfu"].search(line) is None
    assert float(by_name["summary:mfu"].search(summary).group(1)) == 0.41  # type: ignore[union-attr]
    assert by_name["train:tokens_per_s"].search(summary) is None
    assert parse_metric_line(line) == {"step": 12.0, "loss": 4.1234, "tokens_per_s": 1234567.5, "lr": 0.0003}
    assert parse_metric_line("Epoch 1 loss=3") is None
    assert all(len(d["Name"]) <= 255 and len(d["Regex"]) <= 500 for d in METRIC_DEFINITIONS)


@pytest.mark.parametrize(
    ("preset", "n_matmul"),
    [
        # per layer: q h*h + k,v 2*h*(kv*d) + o h*h + MLP 3*h*I; plus lm_head h*V (tied or not, the matmul runs)
        ("qwen2.5-0.5b", 24 * (896 * 896 + 2 * 896 * 128 + 896 * 896 + 3 * 896 * 4864) + 896 * 151936),
        ("qwen2.5-1.5b", 28 * (1536 * 1536 + 2 * 1536 * 256 + 1536 * 1536 + 3 * 1536 * 8960) + 1536 * 151936),
        ("qwen2.5-7b", 28 * (3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + 3 * 3584 * 18944) + 3584 * 152064),
    ],
)
def test_flops_per_token_by_hand(preset: str, n_matmul: int) -> None:
    arch = PRESETS[preset]
    assert flops.matmul_params(arch) == n_matmul
    # 0.5B: 24 layers x (802,816 + 229,376 + 802,816 + 13,074,432) = 357,826,560 + 136,134,656 lm_head
    if preset == "qwen2.5-0.5b":
        assert n_matmul == 493_961_216
    t_eff = 1234.5
    attention = 12 * arch.num_hidden_layers * arch.num_attention_heads * (arch.hidden_size // arch.num_attention_heads)
    assert flops.model_flops_per_token(arch, t_eff) == pytest.approx(6 * n_matmul + attention * t_eff)
    # 7B: 28 layers x (12,845,056 + 3,670,016 + 12,845,056 + 203,685,888) = 6,525,288,448 + lm_head 544,997,376
    if preset == "qwen2.5-7b":
        assert n_matmul == 7_070_285_824
        # at T_eff = 4096: 6 x 7,070,285,824 + 12 x 28 x 28 x 128 x 4096 = 42,421,714,944 + 4,932,501,504
        assert flops.model_flops_per_token(arch, 4096) == pytest.approx(47_354_216_448)
