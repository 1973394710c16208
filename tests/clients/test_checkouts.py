"""The A/B benchmarks run each checkout's own code (benchmarks/checkouts.py): an editable
install would otherwise answer for both."""

from pathlib import Path

from benchmarks.checkouts import checkout_env, imported_from

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkout_runs_its_own_code(tmp_path):
    other = tmp_path / "other"
    (other / "server").mkdir(parents=True)
    (other / "server" / "__init__.py").write_text("")
    (other / "server" / "cli.py").write_text("")
    assert imported_from(checkout_env(other)) == (other / "server" / "cli.py").resolve()
    assert imported_from(checkout_env(ROOT)) == ROOT / "server" / "cli.py"


WORKER = """import json, os, sys
if os.environ.get("FAIL"):
    print(json.dumps({"error": "cannot serve"}), flush=True)
    sys.exit(0)
print(json.dumps({"ready": True}), flush=True)
for i, _ in enumerate(sys.stdin):
    print(json.dumps({"round": i, "pid": os.getpid()}), flush=True)
"""


def test_alternate_asks_each_checkout_every_round(tmp_path, monkeypatch):
    import sys

    import pytest

    from benchmarks.checkouts import alternate

    got = alternate([sys.executable, "-c", WORKER], {"a": ROOT, "b": tmp_path}, 3)
    assert [x["round"] for x in got["a"]] == [0, 1, 2] == [x["round"] for x in got["b"]]
    assert len({x["pid"] for x in got["a"]}) == 1 and got["a"][0]["pid"] != got["b"][0]["pid"]
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(SystemExit, match="a: cannot serve"):
        alternate([sys.executable, "-c", WORKER], {"a": ROOT}, 1)
