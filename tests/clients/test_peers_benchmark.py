"""``benchmarks/peers.py``'s suite part: each category's ratios pool its prompts' per-round
ratios, and the table shows both regimes of each row (a dash where a run has none)."""

from benchmarks import peers


def _key(mode: str, prompt: str, system: str, model: str) -> str:
    name, method = peers.SUITE_SYSTEMS[system]
    return peers.case_key(("suite", name, model, method, prompt), mode)


def test_a_category_pools_its_prompts_ratios_round_by_round():
    runs = {}
    for mode in peers.SUITE_MODES:
        # two rounds of two prompts: nodraft 2, 4 and 3, 6 tokens/s against llama-server's
        # 1, 2 and 3, 3; its n-gram drafter 1, 1 and 6, 6
        runs[_key(mode, "code0", "nodraft none", "micro")] = [2.0, 4.0]
        runs[_key(mode, "code1", "nodraft none", "micro")] = [3.0, 6.0]
        runs[_key(mode, "code0", "llama-server", "micro")] = [1.0, 2.0]
        runs[_key(mode, "code1", "llama-server", "micro")] = [3.0, 3.0]
        runs[_key(mode, "code0", "llama-server ngram-simple", "micro")] = [1.0, 1.0]
        runs[_key(mode, "code1", "llama-server ngram-simple", "micro")] = [6.0, 6.0]
    got = peers.suite_ratios(runs, {"code": ["code0", "code1"], "long": ["long0"]})
    assert set(got) == {f"micro/code/{mode}" for mode in peers.SUITE_MODES}  # no long runs
    row = got["micro/code/greedy"]
    assert row["none_over_llama_server"] == {"median": 2.0, "min": 1.0, "max": 2.0, "n": 4}
    assert row["llama_server_ngram_over_plain"] == {"median": 1.5, "min": 0.5, "max": 2.0,
                                                    "n": 4}


def test_the_suite_table_shows_sampled_then_greedy_for_each_ratio():
    r = {"median": 1.5, "min": 1.2, "max": 1.9, "n": 4}
    d = {"suite": {"micro/code/greedy": {"none_over_llama_server": r,
                                         "llama_server_ngram_over_plain": r},
                   "micro/code/t0.7": {"none_over_llama_server": {**r, "median": 1.4}}}}
    lines = peers.markdown(d).strip().splitlines()
    assert lines[0].startswith("| model | category | served `none` / llama-server, t=0.7 |")
    assert lines[2] == ("| micro | code | 1.40 (1.20-1.90) | 1.50 (1.20-1.90) | -- | "
                        "1.50 (1.20-1.90) |")
