"""The installed PyTorch against the planner's device rules (gpuscout.plan.device_fit): a rule that stops holding
(a torch that trains FlexAttention on a CPU) fails here, so the refusal is lifted instead of kept on faith."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from gpuscout.plan.device_fit import FLEX_ON_CPU, device_refusal


def test_flex_attention_cannot_train_on_a_cpu_as_the_planner_says() -> None:
    # Given a query that needs gradients (training), on the CPU
    q = torch.randn(1, 1, 16, 8, requires_grad=True)
    # Then the installed torch refuses it, as the rule the planner refuses flex on a CPU with says
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, q, q).sum().backward()
    assert device_refusal(deepspeed_stage=0, attention="flex", device="cpu", world=1) == FLEX_ON_CPU
    assert device_refusal(deepspeed_stage=0, attention="flex", device="cuda", world=1) is None
