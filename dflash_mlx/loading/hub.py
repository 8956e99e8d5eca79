"""Files from the Hugging Face hub, failing fast and in one line when the hub cannot be reached.

``huggingface_hub`` retries a download it has no cached copy of five times with backoff, about
25 seconds of "Retrying in 8s" lines before the error. Here one request without retries checks
the hub first: when it cannot be reached, a cached copy is used (said once), and without one
the error says so at once.

A pair's names become local folders here (:func:`fetch_pair`): a local path is taken as it is,
a hub id downloaded, a hub target only after its config alone has been vetted by the caller.
"""

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import DFlashError
from .pairs import PAIR_ALIASES, TINY_PAIR, PairNames

log = logging.getLogger("dflash_mlx")
# An endpoint found unreachable is not asked again for this long: a load asks for a target's
# config, its snapshot and a drafter, and each would wait for the same timeout.
RECHECK_S = 60.0
# endpoint -> [when it was found unreachable, why, whether the fallback to the cache was said]
_DOWN: dict[str, list] = {}
# The files a model folder needs; nothing else is fetched from the hub.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model", "*.tiktoken"]
FOLDER_PATTERNS = [p for p in ALLOW_PATTERNS if p != "*.safetensors"]  # all but the weights

# A check of a hub target from its config alone, before its weights are downloaded:
# ``vet(repo, known, config, weight_names)`` gets the registry's entry (or None) and two
# functions that fetch the config (a dict, or None if it is no JSON object) and the tensor
# names of a sharded checkpoint's index; it raises to refuse, and returns the config it read.
Vet = Callable[[str, Any, Callable[[], Any], Callable[[], list[str]]], dict[str, Any] | None]
# The weight files this process needs of a hub target, from its snapshot without weights (config,
# index, tokenizer): their names, or None for all. Several ranks of a pipeline each need their own.
Select = Callable[[Path], list[str] | None]


@dataclass(frozen=True)
class PairFolders:
    """A pair's local folders, after any download; ``target_config`` is the hub target's config
    as its check read it (None for a local folder)."""

    target: Path
    draft: Path | None
    target_config: dict[str, Any] | None = None


def fetch_pair(names: PairNames, *, revision: str | None, vet: Vet, select: Select | None = None) -> PairFolders:
    """Local folders for a pair: local paths as they are, hub ids downloaded (the target only
    after ``vet`` accepted its config, and only the weight files ``select`` names)."""
    target, config = target_folder(names.target, known=names.known, revision=revision, vet=vet, select=select)
    if names.draft is None:
        return PairFolders(target, None, config)
    draft = local_folder(names.draft, what="drafter", revision=revision if names.draft_revision else None)
    return PairFolders(target, draft, config)


def target_folder(
    target: str | Path, *, known: Any, revision: str | None, vet: Vet, select: Select | None = None
) -> tuple[Path, dict[str, Any] | None]:
    """A target's local folder (see :func:`fetch_pair`), and the config ``vet`` read from the hub."""
    text = str(target)
    if Path(text).expanduser().exists() or not looks_like_hub_id(text):
        return local_folder(target, what="target", embedded=True), None
    config = vet(
        text,
        known,
        lambda: json.loads(hub_file(text, "config.json", what="target", revision=revision).read_text()),
        lambda: _weight_names(text, revision),
    )
    if select is not None:
        files = select(hub_snapshot(text, what="target", revision=revision, allow_patterns=FOLDER_PATTERNS))
        if files is not None:
            return hub_snapshot(text, what="target", revision=revision, allow_patterns=FOLDER_PATTERNS + files), config
    return local_folder(text, what="target", revision=revision), config


def _weight_names(repo: str, revision: str | None) -> list[str]:
    # The tensor names a sharded checkpoint's index lists; a single-file one has no index.
    try:
        index = json.loads(hub_file(repo, "model.safetensors.index.json", what="target", revision=revision).read_text())
    except (DFlashError, json.JSONDecodeError, UnicodeDecodeError):
        return []
    return list(index.get("weight_map", {})) if isinstance(index, dict) else []


def looks_like_hub_id(text: str) -> bool:
    """Whether a name that is not a local path reads as a Hugging Face id ('org/name')."""
    return not text.startswith((".", "/", "~")) and text.count("/") == 1


def local_folder(path_or_repo: str | Path, *, what: str, revision: str | None = None, embedded: bool = False) -> Path:
    """A local folder for ``path_or_repo``: the folder itself, or a hub snapshot.

    ``embedded`` says that an embedded pair's name was accepted too, so that the error for
    an unknown bare name lists them.

    Raises:
        DFlashError: If it is neither an existing folder nor a reachable hub repository.
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        if path.suffix.lower() == ".gguf":
            # A GGUF file is converted once into a pair folder, which every tool then loads.
            raise DFlashError(
                f"The {what} path {path} is a GGUF file; convert it first with dflash-convert --hf-path {path} "
                "--mlx-path FOLDER (add --draft DRAFTER for a target it does not know), then pass FOLDER."
            )
        raise DFlashError(f"The {what} path {path} is a file; pass the model's folder.")
    text = str(path_or_repo)
    if embedded and not any(c in text for c in "/\\~") and not text.startswith("."):  # a bare name
        raise DFlashError(
            f"The {what} {text!r} is neither an existing folder, a Hugging Face id like 'org/name', nor an "
            f"embedded pair ({', '.join([*PAIR_ALIASES, TINY_PAIR])}). Check the path; leaving --model out gives "
            "the default pair, SmolLM2-135M-Instruct."
        )
    if not looks_like_hub_id(text):
        raise DFlashError(
            f"The {what} {text!r} is neither an existing folder nor a Hugging Face id like 'org/name'. Check the path."
        )
    return hub_snapshot(text, what=what, revision=revision, allow_patterns=ALLOW_PATTERNS)


def hub_snapshot(repo: str, *, what: str, revision: str | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local snapshot of model repository ``repo``: downloaded, or from the hub cache.

    Raises:
        DFlashError: If the repository does not exist, or the hub cannot be reached and the
          cache has no copy.
    """
    from huggingface_hub import snapshot_download

    def fetch(endpoint: str, local_files_only: bool) -> str:
        return snapshot_download(repo, revision=revision, allow_patterns=allow_patterns, endpoint=endpoint,
                                 local_files_only=local_files_only)  # fmt: skip

    return Path(_fetch(repo, "config.json", "model", revision, what, fetch))


def hub_file(repo: str, filename: str, *, what: str, repo_type: str = "model", revision: str | None = None) -> Path:
    """One file of ``repo``, downloaded or from the hub cache (see :func:`hub_snapshot`)."""
    from huggingface_hub import hf_hub_download

    def fetch(endpoint: str, local_files_only: bool) -> str:
        return hf_hub_download(repo, filename, repo_type=repo_type, revision=revision, endpoint=endpoint,
                               local_files_only=local_files_only)  # fmt: skip

    return Path(_fetch(repo, filename, repo_type, revision, what, fetch))


def _fetch(repo: str, probe: str, repo_type: str, revision: str | None, what: str, fetch: Callable) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    endpoint = constants.ENDPOINT  # read now, so that HF_ENDPOINT set after import counts
    prefix = f"Could not get the {what} {repo!r} from the Hugging Face hub"
    unreachable = _unreachable(endpoint, repo, probe, repo_type, revision, prefix)
    if unreachable is None:
        try:
            return fetch(endpoint, False)
        except Exception as e:  # the hub client raises many types
            raise DFlashError(f"{prefix} ({type(e).__name__}: {_reason(e)}). Pass a local folder, or check the id "
                              "and your connection.") from e  # fmt: skip
    try:
        path = fetch(endpoint, True)
    except LocalEntryNotFoundError:
        fix = "Unset HF_HUB_OFFLINE to download it" if constants.HF_HUB_OFFLINE else "Connect to the network"
        raise DFlashError(f"{prefix}: {unreachable}, and it is not in the local hub cache {constants.HF_HUB_CACHE}. "
                          f"{fix}, or pass a local folder.") from None  # fmt: skip
    except Exception as e:  # a damaged cache, a full disk
        raise DFlashError(
            f"{prefix}: {unreachable}, and its copy in the local hub cache {constants.HF_HUB_CACHE} could not be "
            f"read ({type(e).__name__}: {_reason(e)}). Pass a local folder."
        ) from e
    down = _DOWN.get(endpoint)
    if down is not None and not down[2]:
        down[2] = True
        log.warning("The Hugging Face hub is unreachable (%s); using the cached %s %s.", unreachable, what, repo)
    return path


def _unreachable(endpoint: str, repo: str, probe: str, repo_type: str, revision: str | None, prefix: str) -> str | None:
    """Why the hub cannot be asked now, or None when one request without retries reached it.

    Raises:
        DFlashError: If the hub answered that the repository or revision does not exist.
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    down = _DOWN.get(endpoint)
    if down is not None and time.monotonic() - down[0] < RECHECK_S:
        return down[1]
    try:
        url = hf_hub_url(repo, probe, repo_type=repo_type, revision=revision, endpoint=endpoint)
        get_hf_file_metadata(url, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except RepositoryNotFoundError:  # gated and private repositories answer the same
        raise DFlashError(f"{prefix}: {endpoint} has no {repo_type} {repo!r}, or it is private (log in with "
                          "`hf auth login`). Check the id, or pass a local folder.") from None  # fmt: skip
    except RevisionNotFoundError:
        raise DFlashError(f"{prefix}: it has no revision {revision!r}. Check the revision.") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status is None or status >= 500 or status == 429:
            return _went_down(endpoint, f"{endpoint} answered HTTP {status}")
        # Reached (a missing probe file, say): the download itself says more.
    except Exception as e:  # no connection, DNS, timeout, TLS: the client raises many types
        return _went_down(endpoint, f"cannot reach {endpoint} ({_reason(e)})")
    _DOWN.pop(endpoint, None)
    return None


def _went_down(endpoint: str, reason: str) -> str:
    _DOWN[endpoint] = [time.monotonic(), reason, False]
    return reason


def _reason(e: Exception) -> str:
    # The first line of the deepest cause: "[Errno 111] Connection refused", not a wrapper's paragraph.
    for _ in range(8):
        if (inner := e.__cause__ or e.__context__) is None:
            break
        e = inner
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
