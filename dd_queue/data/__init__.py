"""Training data for learners: text and image sources, disjoint shards, resumable iterators.

Nothing is downloaded at run time. The default corpus is the byte-level text of the running
Python's standard library; ``ddq prepare`` (``prepare.py``) turns your own text into token
shards with a manifest, read back by the ``prepared`` source (``prepared.py``). See
``loader.py`` for the entry points and ``shards.py`` for how examples are split, dealt to
learners and ordered. The settings (``spec.py``) and the shards import at once; the loaders,
which need torch, and the manifest reader on first use (``dd_queue._lazy``).

The prepare step itself is ``dd_queue.data.prepare.prepare``: it is not re-exported here, since
the package attribute ``prepare`` is (and must stay) the submodule of that name.
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports
from dd_queue.data.shards import ShardCursor, ShardSpec, hash_permutation, holdout_split
from dd_queue.data.spec import PATH_SOURCES, TEXT_SOURCES, DataSpec, Source

if TYPE_CHECKING:
    from dd_queue.data.batch import Batch
    from dd_queue.data.loader import (
        Dataset,
        ShardLoader,
        build_dataset,
        build_loader,
        load_corpus,
    )
    from dd_queue.data.manifest import Manifest, read_manifest
    from dd_queue.data.prepared import PreparedDataset
    from dd_queue.data.text import (
        TextDataset,
        TokenCorpus,
        glob_text_files,
        list_text_files,
        load_text_files,
        load_token_bin,
        stdlib_root,
    )
    from dd_queue.data.vision import (
        ImageDataset,
        ImageSet,
        image_set_from_arrays,
        load_digits,
        load_npz,
    )

__getattr__ = lazy_exports(
    __name__,
    {
        "Batch": "batch",
        **dict.fromkeys(
            ("Dataset", "ShardLoader", "build_dataset", "build_loader", "load_corpus"), "loader"
        ),
        **dict.fromkeys(("Manifest", "read_manifest"), "manifest"),
        "PreparedDataset": "prepared",
        **dict.fromkeys(
            (
                "TextDataset",
                "TokenCorpus",
                "glob_text_files",
                "list_text_files",
                "load_text_files",
                "load_token_bin",
                "stdlib_root",
            ),
            "text",
        ),
        **dict.fromkeys(
            ("ImageDataset", "ImageSet", "image_set_from_arrays", "load_digits", "load_npz"),
            "vision",
        ),
    },
)

__all__ = [
    "PATH_SOURCES",
    "TEXT_SOURCES",
    "Batch",
    "DataSpec",
    "Dataset",
    "ImageDataset",
    "ImageSet",
    "Manifest",
    "PreparedDataset",
    "ShardCursor",
    "ShardLoader",
    "ShardSpec",
    "Source",
    "TextDataset",
    "TokenCorpus",
    "build_dataset",
    "build_loader",
    "glob_text_files",
    "hash_permutation",
    "holdout_split",
    "image_set_from_arrays",
    "list_text_files",
    "load_corpus",
    "load_digits",
    "load_npz",
    "load_text_files",
    "load_token_bin",
    "read_manifest",
    "stdlib_root",
]
