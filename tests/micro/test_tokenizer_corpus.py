import json

from hypothesis import given, settings
from hypothesis import strategies as st

from nodraft.micro.checkpoint import load_tokenizer
from nodraft.micro.corpus import SPLITS, compare_manifest, documents, manifest, split_of
from nodraft.micro.tokenizer import CHAT_MARKERS, EOT

TOK = load_tokenizer()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_tokenizer_round_trips_any_unicode(text):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert TOK.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < TOK.vocab_size for i in ids)


def test_vocabulary_and_special_tokens():
    assert TOK.vocab_size == 4096
    for s in (EOT, *CHAT_MARKERS):
        assert TOK.encode(s, allow_special=True) == [TOK.special_ids[s]]
    # typed by a user, a marker is plain text: it cannot end generation early
    assert TOK.eot_id not in TOK.encode("x <|endoftext|> y")
    assert TOK.decode(TOK.encode("x <|endoftext|> y")) == "x <|endoftext|> y"


def test_splits_are_disjoint_by_module_and_heldout_is_large_enough():
    m = manifest()
    units = [set(m["splits"][s]["units"]) for s in SPLITS]
    assert not (units[0] & units[1]) and not (units[0] & units[2]) and not (units[1] & units[2])
    total = sum(m["splits"][s]["bytes"] for s in SPLITS)
    assert m["splits"]["heldout"]["bytes"] >= 0.05 * total
    assert all(split_of(d.unit) in SPLITS for d in documents())


def test_corpus_leaves_out_tests_generated_tables_and_site_packages():
    units = {d.unit for d in documents()}
    assert "json" in units and "asyncio.events" in units  # source
    assert any(u.startswith("pydoc_data.topics.") for u in units)  # reference topics
    assert "math" in units  # docstrings of an extension module
    bad = [u for u in units if u.startswith(("test.", "encodings", "idlelib.idle_test"))
           or ".test." in u or u.startswith("lib2to3.tests") or "site-packages" in u
           or u in ("stringprep", "html.entities")]
    assert not bad


def test_manifest_comparison_names_the_difference():
    m = manifest()
    assert compare_manifest(m, m) == []
    other = json.loads(json.dumps(m))
    other["splits"]["heldout"]["sha256"] = "0" * 64
    other["splits"]["heldout"]["units"].append("not_a_module")
    notes = compare_manifest(other, m)
    assert len(notes) == 1 and "heldout split differs" in notes[0] and "missing here" in notes[0]


def test_committed_manifest_matches_this_python(checkpoint_dir):
    recorded = json.loads((checkpoint_dir / "manifest.json").read_text())
    assert set(recorded["splits"]) == set(SPLITS)
    # Not asserted equal: another Python may have another library; eval says so plainly.
    if recorded["python"] == manifest()["python"]:
        assert compare_manifest(recorded) == []
