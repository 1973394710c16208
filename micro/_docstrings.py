"""Print [[module, docstrings text], ...] as JSON for every built-in and extension module.

Run by ``micro.corpus`` as ``python -I -S _docstrings.py`` so the text depends on the
interpreter alone, never on what the calling process imported or patched.
"""

import importlib
import io
import json
import sys
import sysconfig
import warnings
from pathlib import Path


def docstrings_of(module) -> str:
    """Module, class and function docstrings of a module without Python source."""
    out = io.StringIO()
    name = module.__name__
    if module.__doc__:
        out.write(f"Help on module {name}:\n\n{module.__doc__.strip()}\n")
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = getattr(module, attr)
        doc = getattr(obj, "__doc__", None)
        if not isinstance(doc, str) or getattr(obj, "__module__", name) != name:
            continue
        if isinstance(obj, type):
            out.write(f"\nclass {attr}:\n    {doc.strip()}\n")
            for meth in sorted(vars(obj)):
                mdoc = getattr(vars(obj)[meth], "__doc__", None)
                if meth.startswith("_") or not isinstance(mdoc, str) or not mdoc.strip():
                    continue
                out.write(f"\n    {attr}.{meth}:\n        {mdoc.strip()}\n")
        elif callable(obj) and doc.strip():
            out.write(f"\n{attr}:\n    {doc.strip()}\n")
    return out.getvalue()


def main() -> None:
    names = set(sys.builtin_module_names)
    dynload = Path(sysconfig.get_paths()["stdlib"]) / "lib-dynload"
    if dynload.is_dir():
        names |= {p.name.split(".")[0] for p in dynload.iterdir() if p.suffix == ".so"}
    docs = []
    for name in sorted(names):
        if "test" in name:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # an extension this build lacks (e.g. _tkinter): not part of it
            continue
        text = docstrings_of(module)
        if text.strip():
            docs.append([name, text])
    json.dump(docs, sys.stdout)


if __name__ == "__main__":
    main()
