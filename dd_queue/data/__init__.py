"""Training data for learners: text and image sources, disjoint shards, resumable iterators.

Nothing is downloaded at run time. The default corpus is the byte-level text of the running
Python's standard library. See ``loader.py`` for the entry points and ``shards.py`` for how
examples are split, dealt to learners and ordered.
"""

from dd_queue.data.batch import Batch
from dd_queue.data.loader import (
    TEXT_SOURCES,
    Dataset,
    DataSpec,
    ShardLoader,
    Source,
    build_dataset,
    build_loader,
    load_corpus,
)
from dd_queue.data.shards import ShardCursor, ShardSpec, hash_permutation, holdout_split
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
