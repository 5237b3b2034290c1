"""The manifest's safe loader: ``parse_manifest`` / ``load_manifest`` never let anything but a
:class:`~gpuscout.domain.manifest.Manifest` or a :class:`~gpuscout.errors.ManifestError` out. The error carries every
problem found, each with a field path (``targets[1].instance_type``) and a message that says what is allowed.

Loading is defensive because manifests arrive from an S3 bucket: at most 256 KiB, strict UTF-8, YAML through a
SafeLoader subclass that refuses anchors/aliases (alias bombs), duplicate keys, non-string keys, keys with control
characters and deep nesting; JSON is accepted by extension or content.

May import: gpuscout.domain's catalog, dataset_checks, manifest and manifest_* section modules, PyYAML, pydantic."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import BaseModel, ValidationError
from yaml.events import AliasEvent

from gpuscout.domain.catalog import Catalog, load_catalog
from gpuscout.domain.dataset_checks import source_content_problems
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_fields import CONTROL_RE, ManifestProblemsError
from gpuscout.errors import ManifestError, Problem

MAX_MANIFEST_BYTES = 256 * 1024
MAX_NESTING = 32


_YAML_BASE: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available


def _mark(event: yaml.Event) -> yaml.Mark | None:
    """libyaml's marks are their own type; convert so ConstructorError formats line and column."""
    mark: Any = event.start_mark
    if mark is None or isinstance(mark, yaml.Mark):
        return mark
    return yaml.Mark("", 0, mark.line, mark.column, None, 0)


def _scan_yaml_events(text: str) -> None:
    """Refuse anchors/aliases and deep nesting from the event stream, before anything is composed or expanded."""
    depth = 0
    for event in yaml.parse(text, Loader=_YAML_BASE):
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.constructor.ConstructorError(
                None, None, "YAML anchors and aliases (&name, *name) are not allowed in a manifest", _mark(event)
            )
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_NESTING:
                raise yaml.constructor.ConstructorError(
                    None, None, f"nesting deeper than {MAX_NESTING} levels", _mark(event)
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _ManifestLoader(_YAML_BASE):  # type: ignore[valid-type,misc]
    """Safe loader that refuses duplicate, merge, non-string and control-character keys (anchors, aliases and
    nesting are refused earlier by :func:`_scan_yaml_events`)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise yaml.constructor.ConstructorError(None, None, "expected a mapping", node.start_mark)
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None, None, "YAML merge keys (<<) are not allowed in a manifest", key_node.start_mark
                )
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "mapping keys must be plain strings (quote numbers, booleans and null)",
                    key_node.start_mark,
                )
            key = key_node.value
            if CONTROL_RE.search(key):
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} contains a control character", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=True)
        return mapping


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if CONTROL_RE.search(key):
            raise ValueError(f"key {key!r} contains a control character")
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a valid number in a manifest")


def _json_depth_ok(text: str) -> bool:
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _decode(data: bytes | str, source: str) -> str:
    raw = data.encode("utf-8", errors="surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            source, [Problem("", f"file is {len(raw):,} bytes; a manifest may be at most {MAX_MANIFEST_BYTES:,}")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(
            source, [Problem("", f"not valid UTF-8: byte 0x{raw[err.start]:02x} at offset {err.start} ({err.reason})")]
        ) from err
    return text.removeprefix("\ufeff")


def _is_json(text: str, source: str) -> bool:
    suffix = Path(source).suffix.lower()
    if suffix == ".json":
        return True
    if suffix in (".yaml", ".yml"):
        return False
    return text.lstrip().startswith("{")


def _parse_document(text: str, source: str) -> object:
    if _is_json(text, source):
        if not _json_depth_ok(text):
            raise ManifestError(source, [Problem("", f"JSON nesting deeper than {MAX_NESTING} levels")])
        try:
            return json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
        except json.JSONDecodeError as err:
            raise ManifestError(
                source, [Problem("", f"invalid JSON at line {err.lineno}, column {err.colno}: {err.msg}")]
            ) from err
        except (ValueError, RecursionError) as err:
            raise ManifestError(source, [Problem("", f"invalid JSON: {err}")]) from err
    try:
        _scan_yaml_events(text)
        return yaml.load(text, Loader=_ManifestLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = err.problem or err.context or "YAML error"
        raise ManifestError(source, [Problem("", f"invalid YAML{where}: {what}")]) from err
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as err:
        raise ManifestError(source, [Problem("", f"invalid YAML: {err}")]) from err


def format_loc(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A field's location as a problem path: ``targets[1].instance_type``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for listing the allowed keys)."""
    model: type[BaseModel] | None = Manifest
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or (ann,)
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def _problems_from(err: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ManifestProblemsError):
            prefix = format_loc(loc)
            for p in ctx_err.problems:
                sep = "" if not prefix or not p.path or p.path.startswith("[") else "."
                problems.append(Problem(f"{prefix}{sep}{p.path}", p.message))
            continue
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            allowed = ", ".join(owner.model_fields) if owner else ""
            msg = f"unknown field{'; allowed: ' + allowed if allowed else ''}"
        elif e["type"] == "string_pattern_mismatch" and loc and loc[-1] == "name":
            msg = "must be 1-40 lowercase letters, digits and inner hyphens (e.g. 'qwen7b-p5')"
        elif e["type"] == "missing":
            msg = "required field is missing"
        problems.append(Problem(format_loc(loc), msg))
    return problems


def validate_manifest_data(data: Any, source: str, catalog: Catalog | None = None) -> Manifest:
    """Validate already-parsed data (a dict) as a manifest; ManifestError lists every problem."""
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise ManifestError(source, [Problem("", f"a manifest is a mapping of fields at the top level, not {kind}")])
    catalog = catalog or load_catalog()
    try:
        return Manifest.model_validate(data, context={"catalog": catalog})
    except ValidationError as err:
        raise ManifestError(source, _problems_from(err)) from err


def parse_document(data: bytes | str, source: str) -> object:
    """A manifest file's data (YAML or JSON, the rules of parse_manifest), not yet validated."""
    return _parse_document(_decode(data, source), source)


def parse_manifest(data: bytes | str, source: str, catalog: Catalog | None = None) -> Manifest:
    """Parse manifest text (YAML or JSON) from ``source`` (a file name or S3 URI used in messages)."""
    text = _decode(data, source)
    return validate_manifest_data(_parse_document(text, source), source, catalog)


def read_manifest_file(path: Path | str) -> bytes:
    """A manifest file's bytes: a regular file within MAX_MANIFEST_BYTES, or a ManifestError saying why not."""
    p = Path(path)
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
            raise ManifestError(str(p), [Problem("", f"{what}; a manifest is a YAML or JSON file")])
        size = info.st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(
                str(p), [Problem("", f"file is {size:,} bytes; a manifest may be at most {MAX_MANIFEST_BYTES:,}")]
            )
        return p.read_bytes()
    except OSError as err:
        raise ManifestError(str(p), [Problem("", f"cannot read file: {err.strerror or err}")]) from err


def resolve_paths(manifest: Manifest, path: Path | str) -> Manifest:
    """A manifest's local paths (a job's source_dir, a local dataset source) resolved against its file's folder
    and checked: ManifestError when one is missing, unreadable or unusable."""
    p = Path(path)
    if manifest.job is not None:
        return _resolve_job(manifest, p)
    return _resolve_local_source(manifest, p)


def load_manifest(path: Path | str, catalog: Catalog | None = None) -> Manifest:
    """Read and validate a manifest file."""
    return resolve_paths(parse_manifest(read_manifest_file(path), str(path), catalog), path)


def _resolve_job(manifest: Manifest, path: Path) -> Manifest:
    """A job's source_dir is resolved against the manifest's folder and must hold the entry point (and the
    requirements file when named): a typo fails ``validate``, not a job seconds into ``local``."""
    job = manifest.job
    assert job is not None
    if job.in_s3:  # already uploaded: the cloud's Validate step checks the entry point in S3
        return manifest
    source = Path(job.source_dir).expanduser()
    resolved = source if source.is_absolute() else (path.parent / source).resolve()
    problems: list[Problem] = []
    if not resolved.is_dir():
        problems.append(Problem("job.source_dir", f"{job.source_dir}: no such folder (resolved to {resolved})"))
    else:
        for field in ("entry_point", "requirements"):
            name = getattr(job, field)
            if name is not None and not (resolved / name).is_file():
                problems.append(Problem(f"job.{field}", f"{name}: no such file in {resolved}"))
    if problems:
        raise ManifestError(str(path), problems)
    return manifest.model_copy(update={"job": job.model_copy(update={"source_dir": str(resolved)})})


TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")  # what data preparation reads from a folder (format auto)


def _source_files(root: Path, fmt: str) -> tuple[list[Path], list[Path]]:
    """The files data preparation would read (training/gpuscout_data/sources.py ``_files``: ``root`` itself, or under it
    those not hidden with a known suffix, any suffix with ``dataset.format`` set), sorted; and, of those, the files
    this user cannot read with the folders it cannot list. One walk of the folder serves both."""
    if root.is_file():
        return [root], []
    wanted: list[Path] = []
    bad: list[Path] = []
    for folder, subfolders, files in os.walk(root, onerror=lambda err: bad.append(Path(err.filename))):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for name in files:
            file = Path(folder) / name
            if name.startswith(".") or (fmt == "auto" and file.suffix not in TEXT_SUFFIXES):
                continue
            if not os.access(file, os.R_OK):
                bad.append(file)
            elif file.is_file():
                wanted.append(file)
    return sorted(wanted), sorted(bad)


def _resolve_local_source(manifest: Manifest, path: Path) -> Manifest:
    """A local ``dataset.source`` is resolved against the manifest's folder (not the current directory) and must
    exist: a missing file fails ``validate`` and ``plan``, not a data preparation seconds into ``local``."""
    if manifest.dataset is None or manifest.dataset.kind != "local":
        return manifest
    source = Path(manifest.dataset.source).expanduser()
    resolved = source if source.is_absolute() else (path.parent / source).resolve()
    if not resolved.exists():
        where = (
            ""
            if source.is_absolute()
            else f" (relative paths are resolved against the manifest's folder {path.parent})"
        )
        raise ManifestError(
            str(path), [Problem("dataset.source", f"{manifest.dataset.source}: no such file or folder{where}")]
        )
    if resolved.is_file() and not os.access(resolved, os.R_OK):
        raise ManifestError(str(path), [Problem("dataset.source", f"{resolved}: not readable")])
    files, unreadable = _source_files(resolved, manifest.dataset.format)
    if unreadable:
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        names = ", ".join(str(p.relative_to(resolved)) for p in unreadable[:3])
        raise ManifestError(
            str(path), [Problem("dataset.source", f"{resolved}: not readable inside it: {names}{more}")]
        )
    problems = source_content_problems(
        files, fmt=manifest.dataset.format, text_field=manifest.dataset.text_field, suffixes=TEXT_SUFFIXES
    )
    if problems:
        raise ManifestError(str(path), [Problem("dataset.source", f"{resolved}: {p}") for p in problems])
    dataset = manifest.dataset.model_copy(update={"source": str(resolved)})
    return manifest.model_copy(update={"dataset": dataset})
