"""prepare_model: verified assembly, all-or-nothing cache entries, and a real SmolLM2 conversion."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from model_runtime.prepare import (
    MANIFEST_NAME,
    WeightConversionError,
    WeightIntegrityError,
    cache_root,
    cached_path,
    prepare_model,
)
from model_runtime.registry import KNOWN_MODELS, LocalParts, MissingWeightsError, ModelSource
from model_runtime.weights_assemble import assemble_verified

PART_BYTES = [b"GGUF" + bytes(range(256)) * 3, b"\x01" * 1000, b"tail-of-the-file"]


def write_parts(directory: Path, contents: list[bytes] = PART_BYTES) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, content in enumerate(contents, start=1):
        path = directory / f"part{index:02d}.bin"
        path.write_bytes(content)
        paths.append(path)
    return paths


def fake_source(parts: list[Path], whole: bytes = b"".join(PART_BYTES)) -> ModelSource:
    return ModelSource(
        name="fake-model",
        upstream="nobody/fake",
        role="test",
        parameters="0",
        quantization="none",
        sha256=hashlib.sha256(whole).hexdigest(),
        size_bytes=len(whole),
        gguf_name="fake.gguf",
        parts=LocalParts(tuple(parts)),
    )


def assert_cache_holds(cache: Path, entries: tuple[str, ...] = ()) -> None:
    """Leak check: exactly these complete entries, no staging dir (empty lock files may stay)."""
    names = sorted(path.name for path in cache.iterdir() if not path.name.endswith(".lock"))
    assert names == sorted(entries)


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "specserve"


def test_assembly_concatenates_parts_in_order(tmp_path: Path) -> None:
    parts = write_parts(tmp_path)
    source = fake_source(parts)
    dest = tmp_path / "assembled.gguf"
    assemble_verified("fake", parts, source.sha256, source.size_bytes, dest, progress=False)
    assert dest.read_bytes() == b"".join(PART_BYTES)


def test_parts_out_of_order_fail_the_hash(tmp_path: Path) -> None:
    parts = write_parts(tmp_path)
    source = fake_source(parts)
    with pytest.raises(WeightIntegrityError, match="SHA-256 mismatch"):
        assemble_verified("fake", parts[::-1], source.sha256, source.size_bytes, None, progress=False)


def test_hash_mismatch_leaves_no_cache_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupted = [PART_BYTES[0], b"\x02" * 1000, PART_BYTES[2]]  # same size, different bytes
    source = fake_source(write_parts(tmp_path / "parts", corrupted))
    cache = tmp_path / "cache"
    with pytest.raises(WeightIntegrityError, match=f"fake-model: SHA-256 mismatch.*expected {source.sha256}"):
        prepare_model(source, cache_dir=cache, progress=True)
    assert "assemble fake-model" in capsys.readouterr().err  # the progress bar goes to stderr
    assert cached_path(source, cache) is None
    assert_cache_holds(cache)


def test_truncated_part_set_leaves_no_cache_entry(tmp_path: Path) -> None:
    full = write_parts(tmp_path / "parts")
    source = fake_source(full)
    full[-1].write_bytes(PART_BYTES[-1][:-5])  # last chunk cut short after registration
    cache = tmp_path / "cache"
    with pytest.raises(WeightIntegrityError, match=f"truncated: 3 part.* {source.size_bytes - 5} bytes"):
        prepare_model(source, cache_dir=cache, progress=False)
    assert_cache_holds(cache)


def test_missing_part_leaves_no_cache_entry(tmp_path: Path) -> None:
    parts = write_parts(tmp_path / "parts")
    parts[1].unlink()
    cache = tmp_path / "cache"
    with pytest.raises(MissingWeightsError, match="part02.bin"):
        prepare_model(fake_source(parts), cache_dir=cache, progress=False)
    assert_cache_holds(cache)


def test_conversion_failure_cleans_staging_including_a_killed_runs(tmp_path: Path) -> None:
    source = fake_source(write_parts(tmp_path / "parts"))  # verifies, but is no GGUF
    cache = tmp_path / "cache"
    stale = cache / ".fake-model.staging-killed"
    stale.mkdir(parents=True)
    (stale / "fake.gguf").write_bytes(b"half")
    with pytest.raises(WeightConversionError, match="fake.gguf"):
        prepare_model(source, cache_dir=cache, progress=False)
    assert_cache_holds(cache)


def test_entry_counts_as_cached_only_with_a_matching_manifest(tmp_path: Path) -> None:
    source = fake_source([])
    entry = tmp_path / source.name
    entry.mkdir()
    (entry / "config.json").write_text("{}")
    assert cached_path(source, tmp_path) is None  # no manifest: unfinished
    (entry / MANIFEST_NAME).write_text(json.dumps({"source_sha256": "0" * 64}))
    assert cached_path(source, tmp_path) is None  # built from other weights
    (entry / MANIFEST_NAME).write_text(json.dumps({"source_sha256": source.sha256}))
    assert cached_path(source, tmp_path) == entry


def test_local_checkpoint_dir_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert prepare_model(str(tmp_path), cache_dir=tmp_path / "unused") == tmp_path.resolve()
    assert not (tmp_path / "unused").exists()


@pytest.fixture(scope="module")
def smollm2_fresh(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache dir, entry) of a from-scratch SmolLM2 preparation in a temporary cache."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, prepare_model("smollm2-135m", cache_dir=cache, progress=False)


def test_smollm2_entry_is_a_complete_hf_checkpoint(smollm2_fresh: tuple[Path, Path]) -> None:
    cache, entry = smollm2_fresh
    assert entry == cache / "smollm2-135m"
    assert_cache_holds(cache, ("smollm2-135m",))
    expected_files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    for name in [*expected_files, "chat_template.jinja", MANIFEST_NAME]:
        assert (entry / name).is_file(), name
    manifest = json.loads((entry / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == KNOWN_MODELS["smollm2-135m"].sha256
    assert (manifest["name"], manifest["architecture"], manifest["dtype"]) == (
        "smollm2-135m",
        "LlamaForCausalLM",
        "float32",
    )
    config = json.loads((entry / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    with safe_open(str(entry / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        assert "lm_head.weight" not in names  # tied: stored once, as the embedding
        assert weights.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


def test_smollm2_cached_checkpoint_generates_like_the_gguf(smollm2_fresh: tuple[Path, Path]) -> None:
    _, entry = smollm2_fresh
    tokenizer = AutoTokenizer.from_pretrained(entry)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    cached = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()
    gguf = KNOWN_MODELS["smollm2-135m"].parts.paths()[0]
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(cached(input_ids).logits, direct(input_ids).logits, rtol=0, atol=1e-5)
        new_tokens = cached.generate(input_ids, max_new_tokens=8, do_sample=False)[0, input_ids.shape[1] :]
        expected = direct.generate(input_ids, max_new_tokens=8, do_sample=False)[0, input_ids.shape[1] :]
    assert new_tokens.tolist() == expected.tolist()
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip() != ""


def test_second_prepare_returns_the_cache_without_converting(smollm2_fresh: tuple[Path, Path]) -> None:
    cache, entry = smollm2_fresh
    weights_mtime = (entry / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert prepare_model("smollm2-135m", cache_dir=cache, progress=False) == entry
    assert time.monotonic() - started < 1.0
    assert (entry / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_smollm2_entry_holds_its_quantized_linears_exactly(smollm2_fresh: tuple[Path, Path]) -> None:
    """`--dtype q4`'s packed linears: written at prepare, each weight the float32 checkpoint's value (so the llama
    q/k row order and the tied lm_head are right), and made again from the GGUF when an older entry lacks them."""
    from model_runtime import quant_kernels
    from model_runtime.config import ModelConfig
    from model_runtime.prepare import prepare_quant
    from model_runtime.quant_weights import QUANT_FILE, load_quant_linears

    _, entry = smollm2_fresh
    manifest = json.loads((entry / MANIFEST_NAME).read_text())
    assert manifest["quant_formats"] == ["Q4_1", "Q8_0"]
    module = quant_kernels.active()
    assert module is not None, quant_kernels.describe()
    config = ModelConfig.from_dir(entry)
    layers, lm_head = load_quant_linears(entry, config, module)
    with safe_open(str(entry / "model.safetensors"), framework="pt") as weights:
        qkv = torch.cat([weights.get_tensor(f"model.layers.0.self_attn.{x}_proj.weight") for x in "qkv"])
        assert torch.equal(layers[0]["qkv"].unpack(), qkv)
        assert torch.equal(layers[5]["down"].unpack(), weights.get_tensor("model.layers.5.mlp.down_proj.weight"))
        assert torch.equal(lm_head.unpack(), weights.get_tensor("model.embed_tokens.weight"))
    def contents() -> tuple[dict[str, str], dict[str, torch.Tensor]]:  # the file's bytes order its header freely
        with safe_open(str(entry / QUANT_FILE), framework="pt") as f:
            return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}

    meta, tensors = contents()
    (entry / QUANT_FILE).unlink()
    superseded = entry / "quant-v2.safetensors"  # an earlier layout's file goes once the current one is written
    superseded.write_bytes(b"an earlier packing")
    assert prepare_quant(entry, progress=False) == entry / QUANT_FILE
    assert not superseded.exists()
    meta_again, tensors_again = contents()
    assert meta_again == meta and tensors_again.keys() == tensors.keys()
    assert all(torch.equal(tensors_again[name], tensors[name]) for name in tensors)


def test_q4_of_a_local_checkpoint_is_refused(tmp_path: Path) -> None:
    from model_runtime.prepare import prepare_quant
    from model_runtime.quant_formats import UnsupportedQuantError

    with pytest.raises(UnsupportedQuantError, match="known model's GGUF"):
        prepare_quant(tmp_path)
