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
