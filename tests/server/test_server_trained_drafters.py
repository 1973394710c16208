"""Trained drafters (Medusa, EAGLE) need weights beside the checkpoint: a model without them
is a 400 that says how to train them, before anything is queued; ``auto`` does without."""

import json
import shutil

import httpx

from nodraft.micro.checkpoint import CHECKPOINT_DIR
from nodraft.server.settings import Settings
from server_testing import LiveServer


def test_missing_heads_are_a_400_and_auto_does_without(tmp_path):
    for f in ("micro.safetensors", "micro.json", "tokenizer.json"):
        shutil.copy(CHECKPOINT_DIR / f, tmp_path / f)  # micro alone, no drafter weights
    with LiveServer(Settings(checkpoints=tmp_path, threads=1)) as server:
        url = server.url + "/v1/completions"
        body = {"model": "micro", "prompt": "def f(x):\n    return", "max_tokens": 8,
                "temperature": 0}
        for method, command in (("medusa", "nodraft train medusa --model micro"),
                                ("eagle", "nodraft train eagle --model micro")):
            r = httpx.post(url, json={**body, "speculation": method}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert command in err["message"] and err["param"].startswith("speculation")
        r = httpx.post(url, json={**body, "speculation": {"method": "medusa", "num_heads": 9}},
                       timeout=60)
        assert r.status_code == 400
        r = httpx.post(url, json=body, timeout=60)  # the default, auto
        assert r.status_code == 200, r.text
        assert r.json()["speculation"]["method"] == "auto"
        assert r.json()["usage"]["completion_tokens"] == 8


def test_medusa_top_k_beyond_the_measured_ranks_is_a_400(live, serve_checkpoints):
    """The tree is built from the rank accuracies measured at training (the record's
    heldout.top_k): a larger top_k would silently act as that many."""
    measured = json.loads((serve_checkpoints / "micro-medusa.json").read_text())
    k = measured["heldout"]["top_k"]
    url = live.url + "/v1/completions"
    body = {"model": "micro", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    r = httpx.post(url, json={**body, "speculation": {"method": "medusa", "top_k": k + 1}},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculation.top_k"
    assert f"at most {k}" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "speculation": {"method": "medusa", "top_k": k}}, timeout=60)
    assert r.status_code == 200, r.text
