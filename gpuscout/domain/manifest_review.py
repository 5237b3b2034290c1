"""Every problem of a manifest in one pass, for ``gpuscout validate``.

pydantic reports every field error of one validation, but a section's own rules (a warm-up that leaves no timed
step) wait until the section's fields are valid, and the manifest's cross-section rules (a sequence length over the
model's positions, ZeRO on one GPU) wait until every section is. So a manifest with faults at several levels would
need several rounds of fix-and-validate. Instead, each round's faulty fields are set aside and the rest validated
again: an unknown key is dropped, an invalid field is removed (its default applies, if it has one), and a target or
variant whose own fields are wrong is left out; the rounds stop when the rest validates or nothing new is found.
Paths are always the file's own (a target left out does not renumber the ones after it).

The result is the problems, each once, and the manifest the rest makes (None when nothing valid is left), which
``validate`` then also plans: what the planner and this machine would refuse comes in the same report.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from gpuscout.domain.catalog import Catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import format_loc, validate_manifest_data
from gpuscout.errors import ManifestError, Problem

MAX_ROUNDS = 8
ITEM_LISTS = ("targets", "variants")  # a problem inside one of these leaves the item out of the next round
_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
MISSING = "required field is missing"
# Required top-level fields replaced, not removed, when faulty, so that the other sections' rules still run. Only
# what no later check measures with: the planner's memory and time figures would depend on them, so ``validate``
# does not plan a manifest with anything set aside.
LENGTH_FIELDS = ("max_steps", "max_tokens", "warmup_steps")
STAND_INS: dict[str, Any] = {"training": {"max_steps": 100}, "sequence_length": 256}


def _stand_in(name: str, current: object) -> object:
    """The stand-in for a faulty required field; a training section keeps its other settings (its precision is
    what this machine's checks look at) and gets a length that validates."""
    if name == "training" and isinstance(current, dict):
        return {**{k: v for k, v in current.items() if k not in LENGTH_FIELDS}, **STAND_INS["training"]}
    return copy.deepcopy(STAND_INS[name])


@dataclass
class Review:
    problems: list[Problem] = field(default_factory=list)
    manifest: Manifest | None = None  # what the fields without problems make (None: nothing valid left)
    set_aside: bool = False  # whether the manifest is the rest of the file, not all of it


def _parts(path: str) -> list[str | int]:
    return [name if name else int(index) for name, index in _PART.findall(path)]


@dataclass
class _Working:
    data: dict[str, Any]
    # for each item list, the file's index of each item still in ``data``
    origin: dict[str, list[int]]
    removed: set[str] = field(default_factory=set)  # file paths of the fields set aside

    def in_file(self, problem: Problem) -> Problem:
        """The problem with the file's indices, in its path and in its message (which may name another item)."""

        def renumber(match: re.Match[str]) -> str:
            indices = self.origin.get(match.group(1), [])
            index = int(match.group(2))
            return f"{match.group(1)}[{indices[index] if index < len(indices) else index}]"

        message = re.sub(rf"\b({'|'.join(ITEM_LISTS)})\[(\d+)\]", renumber, problem.message)
        return Problem(self.to_file(problem.path), message)

    def to_file(self, path: str) -> str:
        parts = _parts(path)
        if len(parts) >= 2 and parts[0] in self.origin and isinstance(parts[1], int):
            indices = self.origin[str(parts[0])]
            if parts[1] < len(indices):
                parts[1] = indices[parts[1]]
        return format_loc(parts)

    def set_aside(self, problems: list[Problem]) -> bool:
        """Remove what each problem (paths as in ``data``) is about; False when nothing could be (a root problem, or
        a required field already removed)."""
        dropped: dict[str, set[int]] = {}
        changed = False
        for problem in problems:
            parts = _parts(problem.path)
            if not parts:
                return False
            in_item = len(parts) >= 2 and parts[0] in ITEM_LISTS and isinstance(parts[1], int)
            if in_item and not (problem.message.startswith("unknown field") and len(parts) > 2):
                dropped.setdefault(str(parts[0]), set()).add(int(parts[1]))
                changed = True
                continue
            if problem.message == MISSING:
                continue  # a required field already set aside: nothing more to remove for it
            if len(parts) == 1 and parts[0] in STAND_INS:
                name = str(parts[0])
                replacement = _stand_in(name, self.data.get(name))
                changed |= self.data.get(name) != replacement
                self.data[name] = replacement
                continue
            changed |= self._remove(parts)
            self.removed.add(self.to_file(problem.path))
        for name, indices in dropped.items():
            items = self.data.get(name)
            if not isinstance(items, list):
                return False
            keep = [i for i in range(len(items)) if i not in indices]
            if not keep:
                return False
            self.data[name] = [items[i] for i in keep]
            self.origin[name] = [self.origin[name][i] for i in keep]
        return changed

    def _remove(self, parts: list[str | int]) -> bool:
        node: Any = self.data
        for part in parts[:-1]:
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    return False
            elif not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        leaf = parts[-1]
        if isinstance(node, dict) and leaf in node:
            del node[leaf]
            return True
        if isinstance(node, list) and isinstance(leaf, int) and leaf < len(node):
            del node[leaf]
            return True
        return False


def review_manifest(data: Any, source: str, catalog: Catalog) -> Review:
    """Validate ``data`` round after round with each round's faulty fields set aside (module docstring)."""
    if not isinstance(data, dict):
        try:
            validate_manifest_data(data, source, catalog)
        except ManifestError as err:
            return Review(problems=list(err.problems))
    working = _Working(
        data=copy.deepcopy(data),
        origin={n: list(range(len(data[n]))) for n in ITEM_LISTS if isinstance(data.get(n), list)},
    )
    review = Review()
    for _ in range(MAX_ROUNDS):
        try:
            review.manifest = validate_manifest_data(working.data, source, catalog)
            return review
        except ManifestError as err:
            found = [working.in_file(p) for p in err.problems]
            new = [
                p
                for p in found
                if p not in review.problems and not (p.message == MISSING and p.path in working.removed)
            ]
            review.problems += new
            review.set_aside = True
            if not new or not working.set_aside(list(err.problems)):
                return review
    return review
