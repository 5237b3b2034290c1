"""Validate (state "Validate manifest"): a manifest's bytes -> a valid Manifest, or a ManifestError with every
problem and its field path. Both drivers read the bytes (a local file, an S3 object) and pass their own checks: what
a manifest valid anywhere still cannot do on that face (a local run cannot read its job's code from S3; a cloud
run's parsed manifest must fit the state machine's payload). Nothing is planned, stored or run here."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuscout.domain.catalog import Catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import parse_manifest
from gpuscout.errors import ManifestError

# A face's check: the manifest as that face will use it (paths resolved against its file, say), or a ManifestError.
Check = Callable[[Manifest], Manifest]


def validate(data: bytes | str, source: str, *, catalog: Catalog, checks: Sequence[Check] = ()) -> Manifest:
    """Parse and validate ``data`` (YAML or JSON; ``source`` names it in messages), then apply ``checks`` in order;
    the first that refuses raises its ManifestError, with the manifest's name."""
    manifest = parse_manifest(data, source, catalog)
    for check in checks:
        try:
            manifest = check(manifest)
        except ManifestError as err:  # valid, but not here: the error names the manifest (a rejected run's id)
            raise ManifestError(err.source, err.problems, manifest_name=manifest.name) from err
    return manifest
