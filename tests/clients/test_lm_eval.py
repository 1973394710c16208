"""lm-evaluation-harness (``lm-eval`` from PyPI) against a live server, with tasks this test
writes itself from held-out text (nothing is downloaded): a ``multiple_choice`` task (lm-eval
scores each choice by ``loglikelihood``: ``echo`` + ``logprobs`` on /v1/completions) and a
``generate_until`` task with 6 stop strings; and lm-eval's loglikelihood of held-out text
against ``nodraft eval``'s loss on the same tokens."""

from __future__ import annotations

import json
import os

import pytest

from nodraft.micro.checkpoint import load_model, load_tokenizer
from nodraft.micro.corpus import split_documents
from nodraft.micro.eval import evaluate_loss
from nodraft.micro.export import export



STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n\n\n"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, serve_checkpoints):
    # lm-eval tokenises with a Hugging Face tokenizer: the export's (no download)
    return export(tmp_path_factory.mktemp("hf"), "micro", serve_checkpoints)


@pytest.fixture(scope="module")
def lm(live, tokenizer_dir):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval.api.registry import get_model

    return get_model("local-completions")(
        model="micro", base_url=live.url + "/v1/completions", tokenizer_backend="huggingface",
        tokenizer=str(tokenizer_dir), max_length=1024, max_gen_toks=32, num_concurrent=1,
        max_retries=1)


def _functions(n: int) -> list[str]:
    """The first lines of held-out functions (never trained on)."""
    out = []
    for d in split_documents("heldout"):
        for block in d.text.split("\ndef ")[1:]:
            lines = ("def " + block).split("\n")
            if len(lines) >= 3 and len(lines[1].strip()) > 8:
                out.append("\n".join(lines[:3]))
            if len(out) == n:
                return out
    return out


def _write_tasks(directory) -> None:
    functions = _functions(12)
    mc, gen = [], []
    for i, f in enumerate(functions):
        head, body = f.split("\n", 1)
        other = functions[(i + 1) % len(functions)].split("\n", 1)[1]
        mc.append({"question": head + "\n", "choices": [body, other], "answer": 0})
        gen.append({"prompt": head + "\n", "target": body})
    (directory / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mc))
    (directory / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gen))
    (directory / "nodraft_mc.yaml").write_text(f"""task: nodraft_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (directory / "nodraft_gen.yaml").write_text(f"""task: nodraft_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: {json.dumps(STOPS)}
  max_gen_toks: 32
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


def test_lm_eval_runs_a_loglikelihood_and_a_generate_until_task(lm, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    out = simple_evaluate(model=lm, tasks=["nodraft_mc", "nodraft_gen"],
                          task_manager=TaskManager(include_path=str(tmp_path)),
                          log_samples=True)
    acc = out["results"]["nodraft_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert out["results"]["nodraft_gen"]["exact_match,none"] >= 0.0
    # every generation stopped before any of the 6 stop strings
    for sample in out["samples"]["nodraft_gen"]:
        text = sample["resps"][0][0]
        assert isinstance(text, str) and not any(s in text for s in STOPS)
    # each multiple-choice answer was scored by two loglikelihoods, both finite
    for sample in out["samples"]["nodraft_mc"]:
        assert len(sample["resps"]) == 2
        assert all(r[0][0] < 0 for r in sample["resps"])


def test_its_loglikelihood_is_nodraft_evals_loss(lm, serve_checkpoints):
    """On held-out text, lm-eval's summed logprob over the API is ``nodraft eval``'s mean
    loss (micro/eval.py ``evaluate_loss``) times the tokens scored, within float32
    rounding."""
    from lm_eval.api.instance import Instance

    tok = load_tokenizer()
    text = next(d.text for d in split_documents("heldout") if len(d.text) > 4000)[:1500]
    context = text.split("\n", 1)[0]  # lm-eval moves a context's trailing spaces onward
    ids = tok.encode(text)
    assert tok.encode(context) == ids[:len(tok.encode(context))]  # a token boundary
    n_ctx = len(tok.encode(context))
    ids = ids[:400]
    continuation = tok.decode(ids[n_ctx:])
    assert tok.encode(context + continuation) == ids
    [(ll, _)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)],
                                 disable_tqdm=True)
    model = load_model("micro", serve_checkpoints)
    scored = len(ids) - n_ctx
    # the loss over the whole window, minus that of the context's own predictions
    full = evaluate_loss(model, ids, T=len(ids) - 1, max_tokens=len(ids) - 1)[4] * (len(ids) - 1)
    head = (evaluate_loss(model, ids[:n_ctx], T=n_ctx - 1, max_tokens=n_ctx - 1)[4] * (n_ctx - 1)
            if n_ctx > 1 else 0.0)
    print(f"lm-eval {-ll:.5f} nats, nodraft eval {full - head:.5f} nats over {scored} tokens")
    assert -ll == pytest.approx(full - head, rel=1e-4), (ll, full - head, scored)
