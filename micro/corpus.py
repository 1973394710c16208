"""The course text: a corpus built at run time from the Python standard library.

Three kinds of document, each belonging to one *unit* (a module, or a pydoc topic):

- module source: every pure-Python module of the standard library;
- docstrings: module, class and function docstrings of the built-in and extension
  modules, which have no Python source to read;
- reference topics: the entries of ``pydoc_data.topics``.

Left out: tests (``test``, ``*tests``, ``idle_test``), generated tables (``encodings``,
``stringprep``, ``html.entities``, ``_sysconfigdata*``, ``pydoc_data`` itself as source),
the build's ``config-*`` folder and ``site-packages`` (not the standard library).

Units are split deterministically by the SHA-256 of their name into train, validation and
held-out, so a module is wholly in one split; the tokenizer and the training loop see only
the train split. The manifest records module lists, byte counts and a SHA-256 per split, so
``nodraft eval`` can say plainly when this interpreter's library differs from the one the
checkpoints were trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SPLITS = ("train", "validation", "heldout")
# Buckets of 1000 by SHA-256 of the unit name: [0, 80) held-out, [80, 140) validation.
HELDOUT_BUCKETS = 80
VALIDATION_BUCKETS = 60

EXCLUDED_PARTS = {"test", "tests", "idle_test", "encodings", "site-packages", "__pycache__",
                  "pydoc_data", "ensurepip", "lib2to3/tests"}
EXCLUDED_MODULES = {"stringprep", "html.entities", "this", "antigravity"}


@dataclass(frozen=True)
class Document:
    unit: str  # the module or topic the text belongs to; the split is decided by it
    kind: str  # "source" | "docstrings" | "topic"
    text: str


def split_of(unit: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(unit.encode()).digest()[:4], "big") % 1000
    if bucket < HELDOUT_BUCKETS:
        return "heldout"
    if bucket < HELDOUT_BUCKETS + VALIDATION_BUCKETS:
        return "validation"
    return "train"


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(rel: Path, module: str) -> bool:
    parts = set(rel.parts)
    if parts & EXCLUDED_PARTS or rel.parts[0].startswith("config-"):
        return True
    if any(p.startswith("test_") or p.endswith("_test") for p in rel.with_suffix("").parts):
        return True
    if rel.name.startswith("_sysconfigdata"):
        return True
    return module in EXCLUDED_MODULES or module.split(".")[0] in EXCLUDED_MODULES


def source_documents() -> list[Document]:
    root = _stdlib_dir()
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        if _excluded(rel, module):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append(Document(module, "source", text))
    return docs


def docstring_documents() -> list[Document]:
    """Docstrings of the built-in and extension modules, read in a fresh, isolated
    interpreter: the calling process may have replaced some of their functions (test
    runners patch ``sys`` hooks, for one), which would change the text."""
    script = Path(__file__).with_name("_docstrings.py")
    out = subprocess.run([sys.executable, "-I", "-S", str(script)], check=True,
                         capture_output=True, text=True, encoding="utf-8").stdout
    return [Document(name, "docstrings", text) for name, text in json.loads(out)
            if name not in EXCLUDED_MODULES]


def topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"pydoc_data.topics.{k}", "topic", topics[k]) for k in sorted(topics)]


@lru_cache(maxsize=1)
def documents() -> tuple[Document, ...]:
    return tuple(source_documents() + docstring_documents() + topic_documents())


def split_documents(split: str) -> list[Document]:
    assert split in SPLITS, split
    return [d for d in documents() if split_of(d.unit) == split]


def split_text(split: str) -> str:
    """One split's documents joined by blank lines (for byte counts, gzip, hashing)."""
    return "\n\n".join(d.text for d in split_documents(split))


def manifest() -> dict:
    """Module lists, byte counts and a SHA-256 per split, plus where the text came from."""
    out = {"python": sys.version.split()[0], "splits": {}}
    for split in SPLITS:
        docs = split_documents(split)
        text = "\n\n".join(d.text for d in docs).encode()
        out["splits"][split] = {
            "units": sorted({d.unit for d in docs}),
            "documents": len(docs),
            "bytes": len(text),
            "sha256": hashlib.sha256(text).hexdigest(),
        }
    return out


def compare_manifest(recorded: dict, current: dict | None = None) -> list[str]:
    """Plain-words differences between a recorded manifest and this interpreter's."""
    current = current or manifest()
    notes = []
    if recorded.get("python") != current["python"]:
        notes.append(f"trained on Python {recorded.get('python')}, this is Python {current['python']}")
    for split in SPLITS:
        r, c = recorded["splits"][split], current["splits"][split]
        if r["sha256"] != c["sha256"]:
            added = sorted(set(c["units"]) - set(r["units"]))
            removed = sorted(set(r["units"]) - set(c["units"]))
            notes.append(
                f"{split} split differs: {r['bytes']} bytes recorded, {c['bytes']} here"
                + (f"; {len(added)} units new here (e.g. {added[:3]})" if added else "")
                + (f"; {len(removed)} units missing here (e.g. {removed[:3]})" if removed else "")
            )
    return notes


def write_manifest(path: str | os.PathLike) -> dict:
    m = manifest()
    Path(path).write_text(json.dumps(m, indent=1) + "\n")
    return m


if __name__ == "__main__":
    m = manifest()
    total = sum(s["bytes"] for s in m["splits"].values())
    for k, s in m["splits"].items():
        print(f"{k:10s} {len(s['units']):5d} units {s['documents']:5d} docs {s['bytes']:9d} bytes "
              f"({100 * s['bytes'] / total:.1f}%)")
