"""Training data for learners: text and image sources, disjoint shards, resumable iterators.

Nothing is downloaded at run time. The default corpus is the byte-level text of the running
Python's standard library. See ``loader.py`` for the entry points and ``shards.py`` for how
examples are split, dealt to learners and ordered. The settings (``spec.py``) and the shards
import at once; the loaders, which need torch, on first use (``dd_queue._lazy``).
"""

from typing import TYPE_CHECKING

from dd_queue._lazy import lazy_exports
from dd_queue.data.shards import ShardCursor, ShardSpec, hash_permutation, holdout_split
from dd_queue.data.spec import TEXT_SOURCES, DataSpec, Source

if TYPE_CHECKING:
    from dd_queue.data.batch import Batch
    from dd_queue.data.loader import (
        Dataset,
        ShardLoader,
        build_dataset,
        build_loader,
        load_corpus,
    )
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
    "TEXT_SOURCES",
    "Batch",
    "DataSpec",
    "Dataset",
    "ImageDataset",
    "ImageSet",
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
    "stdlib_root",
]
