"""Hugging Face datasets, read by name or from a folder written by `save_to_disk`: what the
text corpus 'hf' (`memattn.data.corpus`) and parallel text (`memattn.data.parallel`) share.

    dataset = load_hf_dataset("wikitext:wikitext-103-raw-v1")   # name[:config]
    dataset = load_hf_dataset("saved/")                        # a save_to_disk folder
    dataset.splits                  # {'train': Dataset, 'validation': Dataset, 'test': Dataset}
    dataset.pick_splits()           # {'train': ('train', Dataset), 'val': ('validation', ...), ...}
    dataset.key(picked)             # JSON-ready: changes when the dataset does (for a cache key)

A folder is read with `datasets.load_from_disk`; anything else with
`datasets.load_dataset(name, config)`, which reads its local cache or downloads. A dataset
saved as a single Dataset counts as one split, 'train'.

`datasets` is imported only here, when a dataset is read, so memattn works without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memattn.errors import ConfigError

# Our split -> the names a Hugging Face dataset may give it, in order of preference.
HF_SPLITS = {"train": ("train",), "val": ("validation", "val", "valid", "dev"), "test": ("test",)}
INSTALL_HINT = "pip install datasets (or the extra: pip install 'memattn[hf]')"


def require_datasets(arg: str = "name") -> Any:
    """The `datasets` module; ConfigError naming `arg` and the install command when it is
    missing."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{arg}: reading a Hugging Face dataset needs the package datasets, which is "
                          f"not installed: {INSTALL_HINT}") from None
    return datasets


@dataclass(eq=False)
class HFDataset:
    """A loaded dataset: `splits` maps the dataset's own split names to `datasets.Dataset`s;
    `where` names it in messages ("the dataset <folder>" or "the dataset '<name>'");
    `local`: read from a folder."""

    name: str
    where: str
    local: bool
    splits: dict[str, Any]

    def pick_splits(self, arg: str = "name") -> dict[str, tuple[str, Any]]:
        """Our split ('train', 'val', 'test') -> (the dataset's name for it, its Dataset), by
        HF_SPLITS; just 'train' when the dataset has neither validation nor test. ConfigError
        naming `arg` when train, or one of the other two, is missing."""
        found = {}
        for split, names in HF_SPLITS.items():
            for n in names:
                if n in self.splits:
                    found[split] = (n, self.splits[n])
                    break
        have = ", ".join(self.splits) or "none"
        if "train" not in found:
            raise ConfigError(f"{arg}: {self.where} has no 'train' split (it has {have})")
        if ("val" in found) != ("test" in found):
            missing = "test" if "val" in found else "validation"
            raise ConfigError(f"{arg}: {self.where} has no {missing} split (it has {have}); expected train, "
                              f"validation and test, or train alone to be cut 90/5/5")
        return found

    def key(self, picked: dict[str, Any]) -> dict[str, Any] | None:
        """What changes when the dataset does, JSON-ready: a folder's path and the names,
        sizes and modification times of its files; else the fingerprints of the Datasets in
        `picked` (any mapping to Datasets, or to (name, Dataset) pairs). None when a
        fingerprint is unknown: the dataset cannot say whether it changed."""
        if self.local:
            root = Path(self.name)
            files = sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
            stats = []
            for f in files:
                st = f.stat()
                stats.append([f.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
            return {"root": str(root.resolve()), "files": stats}
        prints = {}
        for split, ds in picked.items():
            ds = ds[1] if isinstance(ds, tuple) else ds
            prints[split] = getattr(ds, "_fingerprint", None)
        if None in prints.values():
            return None
        return {"fingerprints": prints}


def load_hf_dataset(name: str, arg: str = "name") -> HFDataset:
    """The dataset `name`: a folder written by `save_to_disk`, or "<name>" / "<name>:<config>"
    for `datasets.load_dataset`. Returns an HFDataset; ConfigError naming `arg` when datasets
    is not installed or the dataset cannot be loaded."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{arg}: expected a dataset name or folder, got {name!r}")
    datasets = require_datasets(arg)
    local = Path(name).is_dir()
    where = f"the dataset {name}" if local else f"the dataset {name!r}"
    try:
        if local:
            loaded = datasets.load_from_disk(name)
        else:
            repo, _, config = name.partition(":")
            loaded = datasets.load_dataset(repo, config or None)
    except (OSError, ValueError, ConnectionError) as e:
        raise ConfigError(f"{arg}: could not load {where} ({type(e).__name__}: {e})") from None
    if isinstance(loaded, datasets.Dataset):
        loaded = {"train": loaded}
    elif not isinstance(loaded, (dict, datasets.DatasetDict)):
        raise ConfigError(f"{arg}: {where} is a {type(loaded).__name__}, not a Dataset or DatasetDict")
    return HFDataset(name, where, local, dict(loaded))
