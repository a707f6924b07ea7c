"""Hugging Face Hub ids as models: `LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")`, as vLLM
takes them.

An id is looked up in the local Hugging Face cache first (HF_HUB_CACHE, else HF_HOME/hub, else
huggingface_hub's default), so a model downloaded once, by us or by transformers or vLLM, loads
without a network; only when the cache lacks it, and HF_HUB_OFFLINE is not set, is it
downloaded (config, safetensors weights and tokenizer files only: no other weight formats). The
environment is read at each call, not when huggingface_hub was imported, so a process that sets
it late is still obeyed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a Hub id looks like: "name" or "owner/name", letters, digits, '-', '_' and '.', not
# starting with a dot (huggingface_hub's own rule, without its length limit).
HUB_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")
# The files a model folder needs (runner/model/loader.py reads them): config and generation
# config, safetensors weights and their index, tokenizer files, chat templates.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_TRUE = {"1", "ON", "YES", "TRUE"}


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` could be a Hub id (a local path that does not exist may look like one)."""
    return HUB_ID.fullmatch(name) is not None and ".." not in name


def hub_cache_dir() -> str | None:
    """The cache the environment names now (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids the network now."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of Hub model `repo_id`: the cached one, else downloaded where the
    network is allowed. Raises ValueError naming the id, the cache looked in and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    where = cache or constants.HF_HUB_CACHE
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                allow_patterns=MODEL_FILES,
                local_files_only=True,
            )
        )
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
    except LocalEntryNotFoundError:
        pass  # not cached (or not whole): downloaded below where that is allowed
    if hub_offline():
        raise ValueError(
            f"model {repo_id!r} is not a local path, and the Hugging Face cache ({where}) does "
            "not hold it; HF_HUB_OFFLINE is set, so it is not downloaded. Download it where a "
            f"network exists (`hf download {repo_id}`) or pass a local folder"
        )
    try:
        folder = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=MODEL_FILES
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise ValueError(
            f"model {repo_id!r} is not a local path, not in the Hugging Face cache ({where}), "
            f"and could not be downloaded: {err}"
        ) from err
    return folder
