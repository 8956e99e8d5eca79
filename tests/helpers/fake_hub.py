"""dflash-generate against a fake Hugging Face hub, as one rank of a multi-rank test:
``python fake_hub.py HUB OUT -- ARGS...``. A repository ``org/name`` is the folder
``HUB/org--name``; this rank's downloads go to its own ``OUT/rank{r}-hub`` (as on a machine of
its own), and each download's files are logged, one JSON line each, to ``OUT/rank{r}-downloads.jsonl``.
Nothing reaches the network."""

import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path

import huggingface_hub


def main() -> None:
    hub, out = Path(sys.argv[1]), Path(sys.argv[2])
    assert sys.argv[3] == "--", sys.argv
    rank = os.environ.get("MLX_RANK", "0")
    local, log = out / f"rank{rank}-hub", out / f"rank{rank}-downloads.jsonl"

    def fetch(repo_id: str, names: list[str], into: Path) -> None:
        into.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(hub / repo_id.replace("/", "--") / name, into / name)
        with open(log, "a") as f:
            f.write(json.dumps({"repo": repo_id, "files": names}) + "\n")

    def snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs):
        names = sorted(p.name for p in (hub / repo_id.replace("/", "--")).iterdir()
                       if allow_patterns is None or any(fnmatch.fnmatch(p.name, a) for a in allow_patterns))  # fmt: skip
        folder = local / "snapshots" / repo_id.replace("/", "--")
        fetch(repo_id, names, folder)
        return str(folder)

    def hf_hub_download(repo_id, filename, revision=None, **kwargs):
        if not (hub / repo_id.replace("/", "--") / filename).is_file():
            from huggingface_hub.errors import EntryNotFoundError

            raise EntryNotFoundError(f"no {filename} in {repo_id}")
        folder = local / "files" / repo_id.replace("/", "--")
        fetch(repo_id, [filename], folder)
        return str(folder / filename)

    huggingface_hub.snapshot_download = snapshot_download
    huggingface_hub.hf_hub_download = hf_hub_download

    from dflash_mlx.tools.cli.generate import main as generate

    generate(sys.argv[4:])


if __name__ == "__main__":
    main()
