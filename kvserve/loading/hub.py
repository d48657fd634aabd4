"""Models by name, from the Hugging Face cache: `ORG/NAME` (an HF model folder) or `ORG/NAME:QUANT`
(the one .gguf file of a repository whose name holds QUANT, case-insensitive, as llama-server's
`-hf`). The cache is huggingface_hub's own: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`, read when a name is resolved. Nothing is downloaded unless the caller
allows it (`--allow-download`); then huggingface_hub fetches what the name needs (an HF folder's
config, tokenizer and safetensors; a GGUF repository's one matching file) into that cache.

A local path always wins: a name is looked up only when no file or folder of that name exists
(kvserve/loading/loader.py `resolve_model_path`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
from huggingface_hub.errors import LocalEntryNotFoundError

from kvserve.loading.errors import ModelLoadError

# A repository id (each part starting with a letter or digit, so ./x and ../x are never names)
# and an optional quantization tag.
_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[A-Za-z0-9][\w.-]*))?", re.ASCII)
# What an HF model folder needs: the config, tokenizer and chat template files, the weights.
HF_FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja"]
DOWNLOAD_HINT = "pass --allow-download (LLM(..., allow_download=True)) to download it"


@dataclass(frozen=True)
class HubName:
    repo_id: str
    tag: str | None  # a GGUF quantization such as Q4_K_M; None: an HF model folder

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.tag}" if self.tag else self.repo_id


def parse_hub_name(model: str) -> HubName | None:
    """`ORG/NAME` or `ORG/NAME:QUANT`; None for anything else (a path)."""
    m = _NAME.fullmatch(str(model))
    return HubName(m["repo"], m["tag"]) if m else None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder from the environment as it is now (huggingface_hub reads it
    once, at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def find_hub_model(name: HubName, allow_download: bool = False) -> Path:
    """The cached (or, if allowed, downloaded) file or folder `name` stands for; a ModelLoadError
    saying where it looked otherwise."""
    cache = hub_cache_dir()
    patterns = [f"*{_any_case(name.tag)}*.gguf"] if name.tag else HF_FOLDER_FILES
    folder = _snapshot(name, cache, patterns, allow_download)
    if name.tag:
        return _pick_gguf(name, folder, allow_download)
    if (folder / "config.json").is_file():
        return folder
    ggufs = _ggufs(folder)
    if len(ggufs) == 1:
        return ggufs[0]
    listed = ", ".join(p.name for p in ggufs) if ggufs else "none"
    raise ModelLoadError(name, f"the cached snapshot {folder} holds no config.json (not an HF model folder); its "
                               f".gguf files: {listed}. For a GGUF repository name the file's quantization: "
                               f"{name.repo_id}:Q4_K_M")


def _snapshot(name: HubName, cache: Path, patterns: list[str], allow_download: bool) -> Path:
    try:
        return Path(huggingface_hub.snapshot_download(name.repo_id, cache_dir=cache, allow_patterns=patterns,
                                                      local_files_only=not allow_download))
    except (OSError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
        if allow_download:
            raise ModelLoadError(name, f"cannot be fetched from the Hugging Face Hub into {cache} ({problem})") from None
        if type(e) is not LocalEntryNotFoundError:  # e.g. a snapshot known to be incomplete
            raise ModelLoadError(name, f"in the Hugging Face cache {cache}, but not usable ({problem})") from None
        where = cache / f"models--{name.repo_id.replace('/', '--')}"
        raise ModelLoadError(name, f"no such file or folder, and not in the Hugging Face cache: looked for {where} "
                                   f"(the cache is $HF_HUB_CACHE, else $HF_HOME/hub); {DOWNLOAD_HINT}") from None


def _pick_gguf(name: HubName, folder: Path, allow_download: bool) -> Path:
    """The one .gguf file in the snapshot whose name holds the tag (case-insensitive)."""
    ggufs = _ggufs(folder)
    matches = [p for p in ggufs if name.tag.lower() in p.name.lower()]
    if len(matches) == 1:
        return matches[0]
    listed = ", ".join(str(p.relative_to(folder)) for p in ggufs) or "none"
    if matches:
        raise ModelLoadError(name, f"{len(matches)} .gguf files in {folder} hold {name.tag!r}: "
                                   f"{', '.join(p.name for p in matches)}; give a longer tag that names one")
    hint = "" if allow_download else f"; if the repository has it, {DOWNLOAD_HINT}"
    raise ModelLoadError(name, f"no .gguf file in {folder} holds {name.tag!r} in its name; the .gguf files "
                               f"there: {listed}{hint}")


def _ggufs(folder: Path) -> list[Path]:
    """The snapshot's model files (a vision projector, mmproj-*.gguf, is not a model)."""
    return sorted(p for p in folder.rglob("*.gguf") if not p.name.lower().startswith("mmproj"))


def _any_case(tag: str) -> str:
    """A glob matching `tag` in any case (huggingface_hub's patterns are case-sensitive)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in tag)
