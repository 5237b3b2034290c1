"""A canary reads only its layers' part of an S3 or hub checkpoint (gpuscout_train/partial_checkpoint.py): over moto's
S3 and over HTTP from a local server that answers as the Hugging Face Hub does (resolve URLs, a redirect for weight
files, byte ranges); what it writes loads with from_pretrained and holds exactly the full checkpoint's tensors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from gpuscout_data import dataset as ds
from gpuscout_train import args as train_args
from gpuscout_train import model as train_model
from gpuscout_train import partial_checkpoint as pc
from moto import mock_aws

BUCKET = "gpuscout-data-123456789012"
PREFIX = "raw/models/tiny"
LAYERS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """An 8-layer Qwen2 with an untied head, saved in bf16 as several safetensors shards and their index (as the hub's
    large models are), and its full state dict."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config).bfloat16()
    folder = tmp_path_factory.mktemp("ckpt") / "tiny"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / pc.INDEX).is_file() and len(list(folder.glob("*.safetensors"))) >= 4
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


class Recorder:
    """A RangeSource wrapper that keeps every read: (file, start, end)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.description = inner, inner.description
        self.reads: list[tuple[str, int | None, int | None]] = []

    def read(self, name: str, start: int | None = None, end: int | None = None) -> bytes | None:
        self.reads.append((name, start, end))
        return self.inner.read(name, start, end)


def _loads_the_first_layers(fetched: pc.PartialFetch, full: dict[str, torch.Tensor], layers: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fetched.directory, dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == layers == fetched.layers and fetched.of_layers == LAYERS
    state = model.state_dict()
    expected = {k: v for k, v in full.items() if pc.keeps(k, layers)}
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def _files_holding_only_later_layers(folder: Path, layers: int) -> set[str]:
    import json

    weight_map = json.loads((folder / pc.INDEX).read_text())["weight_map"]
    files = set(weight_map.values())
    return {f for f in files if not any(pc.keeps(n, layers) for n, g in weight_map.items() if g == f)}


def _upload(s3: Any, folder: Path, prefix: str = PREFIX) -> None:
    s3.create_bucket(Bucket=BUCKET)
    for path in folder.iterdir():
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import boto3

    for key, value in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with mock_aws():
        yield boto3.client("s3")


def test_keeps_names_only_later_decoder_layers_out() -> None:
    assert pc.keeps("model.embed_tokens.weight", 2) and pc.keeps("lm_head.weight", 2)
    assert pc.keeps("model.norm.weight", 2)
    assert pc.keeps("model.layers.1.mlp.up_proj.weight", 2) and not pc.keeps("model.layers.2.mlp.up_proj.weight", 2)
    assert not pc.keeps("model.layers.10.self_attn.q_proj.bias", 2) and pc.keeps("model.layers.0.input_layernorm.w", 1)


def test_an_s3_checkpoint_is_read_in_part(
    aws: Any, checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, full = checkpoint
    _upload(aws, folder)
    source = Recorder(pc.S3Source(f"s3://{BUCKET}/{PREFIX}/"))

    fetched = pc.fetch_first_layers(source, 2, tmp_path / "part")

    _loads_the_first_layers(fetched, full, 2)
    untouched = _files_holding_only_later_layers(folder, 2)
    assert untouched and not untouched & {name for name, _, _ in source.reads}
    whole = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert fetched.bytes_read < 0.8 * whole and fetched.checkpoint_bytes and fetched.files_opened < fetched.files_total
    # every weight read is a byte range (no whole weight file), and adjacent tensors came in one request
    weight_reads = [r for r in source.reads if r[0].endswith(".safetensors")]
    assert all(start is not None for _, start, _ in weight_reads)
    assert len(weight_reads) < 2 * fetched.files_opened + fetched.tensors
    assert "2 of 8 decoder layers" in fetched.summary(source.description)


def test_weights_not_named_by_layer_say_why_they_cannot_be_cut(aws: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "falcon-like"
    folder.mkdir()
    (folder / pc.CONFIG).write_text('{"num_hidden_layers": 4}')
    save_file({f"transformer.h.{i}.mlp.weight": torch.ones(2, 2) for i in range(4)}, str(folder / pc.SINGLE),
              metadata={"format": "pt"})  # fmt: skip
    _upload(aws, folder, "raw/models/falcon-like")
    with pytest.raises(pc.CannotReadInPartError, match=r"no tensor is named like '<prefix>\.layers\.<i>\.'"):
        pc.fetch_first_layers(pc.S3Source(f"s3://{BUCKET}/raw/models/falcon-like"), 2, tmp_path / "part")


def test_a_bin_checkpoint_says_why_it_cannot_be_read_in_part(aws: Any, tmp_path: Path) -> None:
    aws.create_bucket(Bucket=BUCKET)
    aws.put_object(Bucket=BUCKET, Key="raw/models/old/config.json", Body=b'{"num_hidden_layers": 4}')
    aws.put_object(Bucket=BUCKET, Key="raw/models/old/pytorch_model.bin", Body=b"\x80\x02pickle")
    with pytest.raises(pc.CannotReadInPartError, match=r"pytorch_model\.bin, not safetensors: .* pickle"):
        pc.fetch_first_layers(pc.S3Source(f"s3://{BUCKET}/raw/models/old"), 2, tmp_path / "part")


def _a_canary_job_without_a_model_channel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """train.py's environment in a canary job with network: no "model" channel (sagemaker_requests gives it none),
    the machine's shared canary-model folder under ``tmp_path``."""
    monkeypatch.setattr(train_model, "MODEL_CHANNEL_DIR", str(tmp_path / "no-channel"))
    monkeypatch.delenv("SM_CHANNEL_MODEL", raising=False)
    monkeypatch.setenv("GPUSCOUT_CANARY_MODEL_DIR", str(tmp_path / "shared"))


def test_a_canary_of_an_s3_model_loads_only_its_layers(
    aws: Any,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an S3 model and no "model" channel (a canary with network gets none: sagemaker_requests)
    folder, full = checkpoint
    _upload(aws, folder)
    _a_canary_job_without_a_model_channel(monkeypatch, tmp_path)
    monkeypatch.setattr(train_model, "_download_s3_model", lambda *_a: pytest.fail("downloaded the whole model"))
    hp = train_args.Hyperparameters(model_name_or_path=f"s3://{BUCKET}/{PREFIX}/", canary_layers=2)

    # When train.py builds the canary's model
    model, arch, name = train_model.build_model(hp, ds.load_summary(dataset), tmp_path / "work")

    # Then it has the first two layers with the checkpoint's own weights, and the log says what was read
    assert model.config.num_hidden_layers == 2 and arch.num_hidden_layers == 2 and name == hp.model_name_or_path
    state = model.state_dict()
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(state[down], full[down].float())
    assert torch.equal(state["lm_head.weight"], full["lm_head.weight"].float())
    assert "train: canary: read " in capsys.readouterr().out
    # and another rank on the same machine loads the same files without reading S3 again
    again, _, _ = train_model.build_model(hp, ds.load_summary(dataset), tmp_path / "work-rank1")
    out = capsys.readouterr().out
    assert "read by another rank" in out and "train: canary: read " not in out
    assert torch.equal(again.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_a_canary_of_a_bin_checkpoint_loads_it_whole_and_says_why(
    aws: Any,
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    folder, full = checkpoint
    old = tmp_path / "old"  # a checkpoint as older tools saved it: torch.save's pickle
    old.mkdir()
    shutil.copy(folder / pc.CONFIG, old / pc.CONFIG)
    torch.save(full, old / "pytorch_model.bin")
    _upload(aws, old, "raw/models/old")
    _a_canary_job_without_a_model_channel(monkeypatch, tmp_path)
    hp = train_args.Hyperparameters(model_name_or_path=f"s3://{BUCKET}/raw/models/old", canary_layers=2)

    model, _, _ = train_model.build_model(hp, ds.load_summary(dataset), tmp_path / "work")

    assert model.config.num_hidden_layers == 2
    assert list((tmp_path / "shared").glob("*/*/whole/pytorch_model.bin"))  # the whole checkpoint, downloaded once
    assert "loading the whole checkpoint: s3://" in capsys.readouterr().out


class _HubHandler(BaseHTTPRequestHandler):
    """``/<repo>/resolve/main/<file>`` as the hub answers it: small files directly, weight files by a 302 to another
    path (the hub's CDN), byte ranges as 206, a missing file as 404. ``honour_ranges`` False: a server that ignores
    Range (200 with the whole file)."""

    root: Path
    repo: str
    honour_ranges = True
    failures_left = 0  # answer this many requests with 503 first (a busy CDN)
    requests: list[tuple[str, str | None]]

    def log_message(self, *_: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.requests.append((self.path, self.headers.get("range")))
        if type(self).failures_left > 0:
            type(self).failures_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        prefix = f"/{self.repo}/resolve/main/"
        if self.path.startswith(prefix) and self.path.endswith(".safetensors"):
            self.send_response(302)
            self.send_header("Location", "/cdn/" + self.path.removeprefix(prefix))
            self.end_headers()
            return
        name = self.path.removeprefix(prefix).removeprefix("/cdn/")
        path = self.root / name
        if not path.is_file() or not (self.path.startswith(prefix) or self.path.startswith("/cdn/")):
            self.send_response(404)
            self.end_headers()
            return
        data = path.read_bytes()
        wanted = self.headers.get("range")
        if wanted and self.honour_ranges:
            start, end = (int(x) for x in wanted.removeprefix("bytes=").split("-"))
            body = data[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> Iterator[type[_HubHandler]]:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # the conftest's offline switch
    handler = type("Handler", (_HubHandler,), {"root": checkpoint[0], "repo": "acme/tiny", "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    handler.endpoint = f"http://127.0.0.1:{server.server_port}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()
    server.server_close()


def test_a_hub_checkpoint_is_read_in_part_through_redirects(
    hub: type[_HubHandler], checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    folder, full = checkpoint
    source = pc.HubSource("acme/tiny", endpoint=hub.endpoint)  # type: ignore[attr-defined]

    fetched = pc.fetch_first_layers(source, 1, tmp_path / "part")

    _loads_the_first_layers(fetched, full, 1)
    cdn = [(path, wanted) for path, wanted in hub.requests if path.startswith("/cdn/")]
    assert cdn and all(wanted and wanted.startswith("bytes=") for _, wanted in cdn)  # the range survived the redirect
    untouched = _files_holding_only_later_layers(folder, 1)
    assert untouched and not any(path.endswith(tuple(untouched)) for path, _ in hub.requests)


def test_a_server_that_ignores_ranges_is_named(hub: type[_HubHandler], tmp_path: Path) -> None:
    hub.honour_ranges = False
    source = pc.HubSource("acme/tiny", endpoint=hub.endpoint)  # type: ignore[attr-defined]
    with pytest.raises(pc.CannotReadInPartError, match="HTTP 200, not 206"):
        pc.fetch_first_layers(source, 1, tmp_path / "part")


def test_a_busy_hub_is_retried(
    hub: type[_HubHandler], checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(pc.time, "sleep", lambda _s: None)
    hub.failures_left = 2
    fetched = pc.fetch_first_layers(pc.HubSource("acme/tiny", endpoint=hub.endpoint), 1, tmp_path / "part")  # type: ignore[attr-defined]
    _loads_the_first_layers(fetched, checkpoint[1], 1)
    assert hub.failures_left == 0
