"""Where kvserve keeps and finds files, each through one setting.

- `KVSERVE_CACHE`: converted models and compiled kernels (default ~/.cache/kvserve).
- `KVSERVE_DATA`: the datasets (WikiText-2 as `wikitext2/wiki.test.raw` and
  `wikitext2/wiki.valid.tokens`). Nothing assumes a folder beside the checkout; a command that
  needs a file it cannot find says which setting or flag supplies it."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVSERVE_CACHE"
DATA_ENV = "KVSERVE_DATA"
WIKITEXT2_TEST = "wiki.test.raw"  # evaluation (perplexity, streaming NLL, benchmark prompts)
WIKITEXT2_VALID = "wiki.valid.tokens"  # calibration and training text


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "kvserve"


def data_dir(flag: str | None = None) -> Path:
    """$KVSERVE_DATA; `flag` names the option that passes a file instead (for the error)."""
    instead = f", or pass {flag} FILE" if flag else ""
    value = os.environ.get(DATA_ENV, "").strip()
    if not value:
        raise ValueError(f"{DATA_ENV} is not set: set it to the folder holding wikitext2/{WIKITEXT2_TEST} and "
                         f"wikitext2/{WIKITEXT2_VALID}{instead}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ValueError(f"{DATA_ENV}={value}: no such folder (it should hold wikitext2/{WIKITEXT2_TEST}){instead}")
    return path


def wikitext2_file(name: str, flag: str | None = None) -> Path:
    """A WikiText-2 file under $KVSERVE_DATA/wikitext2, checked to exist."""
    path = data_dir(flag) / "wikitext2" / name
    if not path.is_file():
        instead = f", or pass {flag} FILE" if flag else ""
        raise ValueError(f"{path} not found ({DATA_ENV}={os.environ[DATA_ENV]}): put WikiText-2 there{instead}")
    return path
