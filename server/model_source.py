"""`ember serve MODEL`: a local checkpoint directory, or a Hugging Face model id (`ORG/NAME[@REVISION]`) resolved
to a snapshot folder in the Hugging Face cache (downloading it when needed).

Downloads go through `huggingface_hub.snapshot_download`, so its progress bars, `HF_HOME` / `HF_HUB_CACHE`,
`HF_HUB_OFFLINE=1` and `HF_TOKEN` work as with every other tool; only the files the engine reads are fetched. Every
failure is a `ModelSourceError` whose message is one line: what was tried and how to fix it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ember.engine.args import split_hub_id

# What the engine and tokenizer read: weights, configs (config.json, generation_config.json, tokenizer_config.json,
# the safetensors index, quantization configs), tokenizer files and chat templates.
ALLOW_PATTERNS: tuple[str, ...] = (
    "*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja",
)

TOKENIZER_PATTERNS: tuple[str, ...] = tuple(p for p in ALLOW_PATTERNS if p != "*.safetensors")
"""What `--tokenizer` fetches from the hub: everything the engine reads but the weights."""

class ModelSourceError(Exception):
    """The model could not be found or fetched; the message is one line saying what was tried and the fix."""


@dataclass(frozen=True)
class ModelRef:
    """A parsed model argument: a local directory or a hub id with an optional revision."""

    path: Path | None = None
    repo_id: str | None = None
    revision: str | None = None


def parse_model_ref(value: str, revision: str | None = None) -> ModelRef:
    """`value` as `ember serve` reads it: an existing path wins; otherwise `ORG/NAME[@REVISION]`. `revision` is
    `--revision`, which must agree with an `@REVISION` suffix."""
    p = Path(value).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelSourceError(f"{value} is a file; MODEL must be a checkpoint directory or a Hugging Face model "
                                   f"id (ORG/NAME)")
        if revision is not None:
            raise ModelSourceError(f"--revision {revision} applies to Hugging Face model ids, not to the local "
                                   f"directory {value}")
        return ModelRef(path=p)
    hub = split_hub_id(value)
    if hub is None:
        raise ModelSourceError(f"{value}: no such directory, and not a Hugging Face model id (ORG/NAME[@REVISION])")
    repo_id, suffix = hub
    if suffix and revision is not None and suffix != revision:
        raise ModelSourceError(f"{value} names revision {suffix!r} but --revision is {revision!r}; give one")
    return ModelRef(repo_id=repo_id, revision=suffix or revision)


def _cache_dir(download_dir: Path | None) -> str:
    from huggingface_hub import constants

    return str(download_dir) if download_dir is not None else constants.HF_HUB_CACHE


def download(ref: ModelRef, download_dir: Path | None = None,
             patterns: tuple[str, ...] = ALLOW_PATTERNS, token: str | None = None, *, what: str = "model",
             local: str = "a local checkpoint directory") -> Path:
    """The snapshot folder of `ref.repo_id` at `ref.revision` (default branch when None), downloading the engine's
    files (``patterns``) unless the cache already has them (or `HF_HUB_OFFLINE=1` forbids the network), with
    ``token`` (`--hf-token`) or else `HF_TOKEN` or the saved login. Errors call the repository ``what`` and offer
    ``local`` instead."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    assert ref.repo_id is not None
    name = ref.repo_id + (f"@{ref.revision}" if ref.revision else "")
    cache = _cache_dir(download_dir)
    fix = f"run `hf download {ref.repo_id}" + (f" --revision {ref.revision}" if ref.revision else "") + (
        f" --cache-dir {download_dir}" if download_dir is not None else "") + f"` or pass {local}"
    try:
        folder = snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=download_dir,
                                   allow_patterns=list(patterns), token=token or os.environ.get("HF_TOKEN") or None)
    except hf.GatedRepoError:
        raise ModelSourceError(f"{what} {name} is gated on the Hugging Face hub: accept its licence on "
                               f"huggingface.co/{ref.repo_id} and set HF_TOKEN") from None
    except hf.RevisionNotFoundError:
        raise ModelSourceError(f"{what} {ref.repo_id} has no revision {ref.revision!r} on the Hugging Face hub "
                               f"(--revision)") from None
    except hf.RepositoryNotFoundError:
        raise ModelSourceError(f"{what} {name} was not found on the Hugging Face hub (a private model needs HF_TOKEN); "
                               f"check the id or pass {local}") from None
    except hf.LocalEntryNotFoundError:
        why = "downloads are off (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise ModelSourceError(f"{what} {name} is not in the Hugging Face cache ({cache}) and {why}: {fix}") from None
    except (OSError, ValueError, hf.HfHubHTTPError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSourceError(f"could not download {name} into {cache}: {first}; {fix}") from None
    return Path(folder)


def resolve_model(value: str | os.PathLike | None, *, revision: str | None = None,
                  download_dir: Path | None = None, token: str | None = None) -> Path | None:
    """The checkpoint directory to load for `ember serve MODEL` (None: the built-in demo model)."""
    if value is None:
        if revision is not None:
            raise ModelSourceError("--revision needs a Hugging Face model id (ember serve ORG/NAME --revision REV)")
        return None
    ref = parse_model_ref(os.fspath(value), revision)
    folder = ref.path if ref.path is not None else download(ref, download_dir, token=token)
    if not (folder / "config.json").is_file():
        what = ref.repo_id or str(value)
        raise ModelSourceError(f"{what}: no config.json in {folder}; MODEL must be a Hugging Face transformers "
                               f"checkpoint (config.json, *.safetensors, tokenizer files)")
    return folder


def resolve_tokenizer(value: str, model: str | os.PathLike | None, model_dir: Path, *,
                      download_dir: Path | None = None, token: str | None = None) -> Path:
    """The folder of `--tokenizer`: the model's own when it names the model, a local folder, or a Hugging Face id
    (its tokenizer files only are fetched); ModelSourceError when it holds no tokenizer."""
    if model is not None and value == os.fspath(model):
        return model_dir
    ref = parse_model_ref(value)
    folder = ref.path if ref.path is not None else download(ref, download_dir, TOKENIZER_PATTERNS, token,
                                                            what="--tokenizer", local="a local tokenizer folder")
    if not any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ModelSourceError(f"--tokenizer {value}: no tokenizer files (tokenizer.json, tokenizer_config.json) in "
                               f"{folder}")
    return folder


def served_name(value: str | os.PathLike | None, folder: Path) -> str:
    """The name clients send when `--served-model-name` is not given: the hub id (without revision) for a
    downloaded model, the directory's own name for a local one, however it was spelled (`.`, `..`, `model/`)."""
    if value is not None:
        text = os.fspath(value)
        if not Path(text).expanduser().exists():
            return text.partition("@")[0]
    return Path(os.path.abspath(folder)).name
