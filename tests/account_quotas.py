"""The account's SageMaker training quotas as Service Quotas would list them, for tests on moto (which does not
implement ListServiceQuotas; gpuscout/cloud/quotas.py's listing itself is tested on the real API shapes with botocore's
Stubber in tests/unit/test_quotas.py)."""

from __future__ import annotations

import zlib

from gpuscout.cloud.quotas import Quota, training_quota_name
from gpuscout.domain.catalog import load_catalog

DEFAULT_INSTANCES = 10.0  # an account whose quotas were raised: 10 on-demand and 10 spot instances of every type


def account_quotas(values: dict[str, float] | None = None) -> dict[str, Quota]:
    """Every training type's two quotas at DEFAULT_INSTANCES, except those ``values`` names (quota name -> value)."""
    values = values or {}
    types = load_catalog().training_types
    names = [training_quota_name(t, spot=spot) for t in types for spot in (False, True)] + list(values)
    return {n: Quota(n, f"L-{zlib.crc32(n.encode()):08X}", values.get(n, DEFAULT_INSTANCES)) for n in names}
