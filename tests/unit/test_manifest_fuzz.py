"""Issue 6 item 4: fuzz the manifest loader. Whatever the input, the outcome is a Manifest or a ManifestError whose
problems each carry a path (str) and a non-empty message; no other exception escapes."""

import copy
import json
import random
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuscout.domain.catalog import load_catalog
from gpuscout.domain.manifest import Manifest
from gpuscout.domain.manifest_loader import MAX_MANIFEST_BYTES, parse_manifest
from gpuscout.errors import ManifestError
from gpuscout.paths import MANIFESTS_DIR

CATALOG = load_catalog()
EXAMPLES = sorted(MANIFESTS_DIR.glob("*.yaml"))
EXAMPLE_TEXTS = [p.read_bytes() for p in EXAMPLES]
EXAMPLE_DATA = [yaml.safe_load(t) for t in EXAMPLE_TEXTS]
FIELD_NAMES = sorted(
    {"name", "model", "preset", "hf_id", "path", "dataset", "source", "targets", "variants", "instance_type",
     "training", "max_steps", "max_tokens", "precision", "constraints", "budget_usd", "sequence_length",
     "tokenizer", "kind", "stop_rule", "deepspeed_stage", "spot", "objective", "repetitions", "\u05e9\u05dd"}
)  # fmt: skip


def fuzz(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )


def check(raw: bytes | str, source: str = "fuzz.yaml") -> object:
    try:
        result = parse_manifest(raw, source, CATALOG)
    except ManifestError as err:
        assert err.problems, "a ManifestError must carry at least one problem"
        for p in err.problems:
            assert isinstance(p.path, str) and isinstance(p.message, str) and p.message
        assert err.source == source and str(err).startswith(source)
        json.dumps(err.to_dict())  # serialisable for rejected/<name>.error.json
        return err
    assert isinstance(result, Manifest)
    return result


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars | st.sampled_from(["ml.p5.48xlarge", "local", "bundled:hebrew-bible", "qwen2-tiny", "auto"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8),
                                                                inner, max_size=5),
    max_leaves=10,
)  # fmt: skip


@fuzz(300)
@given(st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=10), json_values, max_size=10))
def test_schema_fuzz_json(data):
    check(json.dumps(data, allow_nan=True), "fuzz.json")


@fuzz(200)
@given(st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=8))
def test_schema_fuzz_yaml(data):
    check(yaml.safe_dump(data, allow_unicode=True), "fuzz.yaml")


def _set_path(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


# Values a mutation plants anywhere in a real manifest: wrong types, boundaries, hostile strings.
NASTY = [
    None, True, False, 0, -1, 1, 2**63, -(2**70), 0.5, -0.0, 1e308, 1e-308, "", " ", "0", "true", "null",
    "ml.p5.48xlarge", "local", "ml.m5.xlarge", "ml.p3.2xlarge", "bf16", "fp16", "auto", "s3://", "s3://b",
    "bundled:hebrew-bible", "bundled:x", "qwen2-tiny", "\x00", "\u202e", "\u05e9\u05dc\u05d5\u05dd", "a" * 300,
    [], {}, [1, 2], {"name": "x"}, [{"instance_type": "local"}], {"kind": "steady_state"}, {"unknown": 1},
    [{"name": "v", "deepspeed_stage": 3}], {"preset": "qwen2.5-7b", "hf_id": "a/b"},
]  # fmt: skip
STRUCTURAL_CASES = 2400
BYTE_CASES = 2400


def test_structural_mutations_of_examples():
    """Seeded random mutations of the real examples (fast, reproducible): replace, delete or add fields."""
    rng = random.Random(20260201)
    outcomes = {"ok": 0, "error": 0}
    for case in range(STRUCTURAL_CASES):
        doc = copy.deepcopy(EXAMPLE_DATA[case % len(EXAMPLE_DATA)])
        for _ in range(rng.randint(1, 3)):
            paths = [p for p in _paths(doc) if p]
            path = rng.choice(paths)
            op = rng.random()
            try:
                if op < 0.6:
                    _set_path(doc, path, copy.deepcopy(rng.choice(NASTY)))
                elif op < 0.85:
                    parent = doc
                    for key in path[:-1]:
                        parent = parent[key]
                    del parent[path[-1]]
                else:
                    parent = doc
                    for key in path[:-1]:
                        parent = parent[key]
                    if isinstance(parent, dict):
                        parent[rng.choice(FIELD_NAMES)] = copy.deepcopy(rng.choice(NASTY))
            except (KeyError, IndexError, TypeError):
                continue
        as_json = rng.random() < 0.5
        raw = json.dumps(doc) if as_json else yaml.safe_dump(doc, allow_unicode=True)
        result = check(raw, "case.json" if as_json else "case.yaml")
        outcomes["ok" if isinstance(result, Manifest) else "error"] += 1
    assert outcomes["ok"] > 0 and outcomes["error"] > STRUCTURAL_CASES // 2, outcomes


def test_byte_mutations_of_examples():
    """Seeded random byte-level damage to the real example files: inserts, deletes, overwrites, truncation."""
    rng = random.Random(6)
    tokens = [b"&a ", b"*a", b"\t", b": ", b"- ", b"{", b"]", b"\xff", b"\xc3", b"\x00", b"!!python/name:os ", b"<<: "]
    for case in range(BYTE_CASES):
        raw = bytearray(EXAMPLE_TEXTS[case % len(EXAMPLE_TEXTS)])
        for _ in range(rng.randint(1, 4)):
            pos = rng.randint(0, len(raw))
            chunk = rng.choice(tokens) if rng.random() < 0.5 else bytes(rng.randrange(256) for _ in range(3))
            op = rng.random()
            if op < 0.4:
                raw[pos:pos] = chunk
            elif op < 0.7:
                del raw[pos : pos + rng.randint(1, 8)]
            elif op < 0.95:
                raw[pos : pos + len(chunk)] = chunk
            else:
                del raw[pos:]
        check(bytes(raw))


def test_examples_themselves_are_valid():
    for raw, path in zip(EXAMPLE_TEXTS, EXAMPLES, strict=True):
        assert isinstance(check(raw, path.name), Manifest)


def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_billion_laughs_rejected_fast():
    start = time.perf_counter()
    err = check(billion_laughs())
    assert isinstance(err, ManifestError)
    assert "anchors and aliases" in err.problems[0].message
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"name: x\n" + b"#" * MAX_MANIFEST_BYTES, "at most 262,144"),
        (b"name: \xc3\x28\n", "not valid UTF-8: byte 0xc3 at offset 6"),
        (b"\xef\xbb\xbfname: \xff", "offset"),
        (b"name: x\n42: y\n", "plain strings"),
        (b"name: x\nnull: y\n", "plain strings"),
        (b"name: x\ntrue: y\n", "plain strings"),
        (b"name: x\n!!python/object:os.system ls: y\n", "plain strings"),
        (b'name: x\n"ke\\u0000y": y\n', "control character"),
        (b'name: x\n"ke\\ty": y\n', "control character"),
        (b"name: x\nmodel: {preset: a, preset: b}\n", "duplicate key 'preset'"),
        (b"name: !!python/object/apply:os.system [ls]\n", "invalid YAML"),
        (b"name: x\n<<: {a: 1}\n", "merge keys"),
    ],
)
def test_hostile_inputs_rejected_clearly(raw, fragment):
    err = check(raw)
    assert isinstance(err, ManifestError)
    assert fragment in str(err), str(err)
