"""`gpuscout validate` in one pass (gpuscout.domain.manifest_review): each round's faulty fields set aside, the rest
validated again, every problem named with the file's own paths."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest_review import review_manifest
from gpuscout.paths import MANIFESTS_DIR

CATALOG = load_catalog()


def _quickstart() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((MANIFESTS_DIR / "quickstart.yaml").read_text())
    return data


def test_a_valid_manifest_is_one_round_with_nothing_set_aside() -> None:
    review = review_manifest(_quickstart(), "q.yaml", CATALOG)
    assert review.problems == [] and review.manifest is not None and not review.set_aside


def test_an_item_left_out_does_not_renumber_the_ones_after_it() -> None:
    # Given a bad first target, and a ZeRO-3 variant that a later 1-GPU target cannot run (a cross-section rule,
    # which runs only once every target is valid)
    data = _quickstart()
    data["targets"] = [{"instance_type": "ml.p9.huge"}, {"instance_type": "ml.p4d.24xlarge"},
                       {"instance_type": "ml.g5.8xlarge"}]  # fmt: skip
    data["variants"][0]["deepspeed_stage"] = 3
    original = copy.deepcopy(data)
    review = review_manifest(data, "m.yaml", CATALOG)
    # Then both are found, and the second names targets[2], the file's index, though targets[0] was left out
    assert [p.path for p in review.problems] == ["targets[0].instance_type", "variants[0].deepspeed_stage"]
    assert "targets[2] ml.g5.8xlarge" in review.problems[1].message, review.problems[1].message
    assert review.set_aside and review.manifest is not None and len(review.manifest.targets) == 2
    assert data == original  # the caller's data is not touched


def test_nothing_valid_left_stops_with_what_was_found() -> None:
    data = _quickstart()
    data["targets"] = [{"instance_type": "ml.p9.huge"}]
    data["model"] = {"preset": "gpt-9"}
    review = review_manifest(data, "m.yaml", CATALOG)
    assert {p.path for p in review.problems} == {"targets[0].instance_type", "model.preset"}
    assert review.manifest is None
    assert [str(p) for p in review_manifest(["a", "list"], "m.yaml", CATALOG).problems] == [
        "a manifest is a mapping of fields at the top level, not list"
    ]
