"""What crosses the process boundary survives the trip: requests as plain data (their
drafter's parameters rebuilt by the engine's registry), events with their figures."""

from nodraft.drafters.registry import Registry
from nodraft.engine import messages
from nodraft.engine.core import Event, GenerationRequest
from nodraft.engine.sequence import StepResult
from nodraft.engine.stats import SpecStats
from nodraft.engine.verify import SamplingParams


def test_a_request_is_data_and_its_parameters_come_back_the_same():
    registry = Registry()
    for spec in ({"method": "early_exit", "exit_layer": 3, "num_speculative_tokens": 2},
                 {"method": "suffix", "min_token_prob": 0.25}, {"method": "none"}):
        method, params = registry.parse(spec)
        request = GenerationRequest("micro-layerskip", [5, 6, 7], 9,
                                    SamplingParams(0.8, 0.9, 40, 2**63 + 5), method, params,
                                    (11, 12))
        raw = messages.encode(messages.Add(3, messages.Request.of(request)))
        got = messages.decode_input(raw)
        assert isinstance(got, messages.Add) and got.rid == 3
        r = got.request
        assert (r.model, r.prompt, r.max_tokens, r.sampling, r.stop_token_ids) == (
            "micro-layerskip", [5, 6, 7], 9, request.sampling, [11, 12])
        assert registry.parse({"method": r.method, **r.params}) == (method, params)
    assert messages.decode_input(messages.encode(messages.Abort([1, 2]))) == messages.Abort([1, 2])
    assert isinstance(messages.decode_input(messages.encode(messages.Shutdown())),
                      messages.Shutdown)


def test_events_and_their_figures_come_back_equal():
    stats = SpecStats("auto", drafted=9, accepted=4, target_passes=5, draft_cost=0.75,
                      accepted_by_position=[3, 1], drafter_errors=1)
    events = [
        (1, Event("admit")),
        (1, Event("step", step=StepResult([4, 5, 6], 2, [4, 5, 9], [9], "suffix", 0.0, None,
                                          2, 1))),
        (2, Event("finish", finish_reason="length", stats=stats,
                  stats_by_method={"suffix": SpecStats("suffix", 9, 4, 3),
                                   "none": SpecStats("none", target_passes=2)})),
        (3, Event("error", error="RuntimeError: boom", stats=SpecStats("none"),
                  stats_by_method={})),
    ]
    out = messages.Outputs(events, running=2, waiting=1, compiled="warming")
    assert messages.decode_outputs(messages.encode(out)) == out
