"""Models by name: `ORG/NAME` (a folder's files) or `ORG/NAME:FILE` (one file, e.g. a GGUF
or an mmproj) through `huggingface_hub`: downloaded when online, from the local cache
offline (`offline=True` or HF_HUB_OFFLINE=1), and an error naming the fix when neither
works. A path that exists is used as it is."""

from __future__ import annotations

import os
import re
from pathlib import Path

from streamgrok.errors import ModelLoadError

# what a model folder needs (weights, configs, tokenizer, templates), not other formats
FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_name(name: str) -> bool:
    """ORG/NAME or ORG/NAME:FILE that is not a local path."""
    repo = name.split(":", 1)[0]
    return bool(_REPO.fullmatch(repo)) and not Path(name).exists()


def resolve(name: str | None, offline: bool = False) -> Path | None:
    """A local path for `name` (None stays None: the default model)."""
    if name is None:
        return None
    if not is_hub_name(name):
        return Path(name)
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    repo, _, filename = name.partition(":")
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        if filename:
            return Path(hf_hub_download(repo, filename, local_files_only=offline))
        return Path(snapshot_download(repo, allow_patterns=FOLDER_FILES,
                                      local_files_only=offline))
    except LocalEntryNotFoundError as exc:
        how = ("you are offline (--offline or HF_HUB_OFFLINE=1): run once online, or "
               f"`hf download {repo}{' ' + filename if filename else ''}`, to fill the cache"
               if offline else "the download failed and the local cache has no copy: "
               "check the network, or give a local path")
        raise ModelLoadError(f"model {name!r} is not in the Hugging Face cache; {how}") \
            from exc
    except (RepositoryNotFoundError, EntryNotFoundError) as exc:
        raise ModelLoadError(f"model {name!r} was not found on the Hugging Face Hub "
                             f"(check the name{' and the file' if filename else ''})") from exc
    except HfHubHTTPError as exc:
        raise ModelLoadError(f"model {name!r} could not be downloaded: {exc}") from exc
