"""``benchmarks/auto_idle.py``: its pairs are ``none`` against ``auto`` on the same text
(seeded where sampled), and it refuses a regime the suite does not have."""

import pytest

from benchmarks import auto_idle
from nodraft.micro.checkpoint import CHECKPOINT_DIR, load_model


@pytest.mark.parametrize("name,regime", [("micro", "t1.0"), ("micro-layerskip", "greedy")])
def test_pairs_time_none_against_auto_on_the_same_text(name, regime):
    model = load_model(name, CHECKPOINT_DIR)
    prompts = [{"ids": [10, 11, 12, 13]}, {"ids": [40, 41, 42], "stop_ids": [0]}]
    ratios = auto_idle.pairs(model, prompts, regime, repeats=2, tokens=6, name=name)
    assert len(ratios) == 4 and all(r > 0 for r in ratios)


def test_workers_price_passes_with_the_table_they_are_given():
    from nodraft.clients.measure import decode
    from nodraft.drafters import costs

    model = load_model("micro", CHECKPOINT_DIR)  # a model object of its own: none timed yet
    table = {1: 1e-3, 2: 1.1e-3, 3: 1.2e-3, 5: 1.5e-3, 9: 2.5e-3, 17: 4.5e-3}
    auto_idle.use_costs(model, table)
    decode(model, [10, 11, 12, 13], 8, "auto")  # its steps price, and learn, with it
    assert [costs.current(model).table(r) for r in table] == list(table.values())


def test_an_unknown_regime_is_refused():
    with pytest.raises(SystemExit):
        auto_idle.main(["--regime", "t0.3"])


@pytest.mark.parametrize("sampling", [None, 1.0])
def test_asked_at_every_step_auto_asks_at_each_and_sends_nothing(monkeypatch, sampling):
    # ``--ask-every-step``: every step pays for auto's whole ask -- greedy on a prompt whose
    # copies auto would draft, and sampled where a fresh server's request would rest its
    # whole length -- and decodes plain decoding's text
    from nodraft.clients.measure import decode
    from nodraft.drafters import auto
    from nodraft.engine.verify import SamplingParams

    model = load_model("micro", CHECKPOINT_DIR)
    asks = []
    propose = auto.Auto.propose

    def counted(self, ctx, budget):
        got = propose(self, ctx, budget)
        asks.append(self.asks)
        return got

    monkeypatch.setattr(auto.Auto, "propose", counted)  # restored after the test
    auto_idle.ask_every_step()
    sp = None if sampling is None else SamplingParams(temperature=sampling, seed=3)
    prompt, n = [5, 6, 7, 8] * 8, 24
    run = decode(model, prompt, n, "auto", sampling=sp)
    plain = decode(model, prompt, n, "none", sampling=sp)
    assert run.tokens == plain.tokens
    assert run.stats.drafted == 0 and run.stats.target_passes == plain.stats.target_passes
    # one ask a step after the first token, which the prompt's pass gives
    assert max(asks) == plain.stats.target_passes - 1
