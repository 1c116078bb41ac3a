"""Hypothesis over the bridge's inputs (tests/fuzz_targets.py): job scripts, attached estimates and
the request lines job_submit.lua sends. Every input gets a decision or a clear error; a few thousand
cases here, scripts/fuzz.py for long runs."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from fuzz_targets import TARGETS, check_attached, check_jobscript, check_protocol, decode_line_directly

FAST = settings(max_examples=800, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FAST
@given(TARGETS["jobscript"][0])
def test_job_scripts_parse_or_fail_clearly(text):
    check_jobscript(text)


@FAST
@given(TARGETS["attached"][0])
def test_attached_estimates_decode_or_are_refused_with_a_reason(text):
    check_attached(text)


@settings(max_examples=1500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(TARGETS["protocol"][0])
def test_every_request_line_gets_an_answer_the_lua_accepts(data):
    check_protocol(data)


def test_the_targets_reach_every_outcome():
    """The generators are not one-sided: each target sees its inputs decided and refused."""
    seen: dict[str, set] = {}

    def collector(name, strategy, check):
        @settings(max_examples=400, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(strategy)
        def collect(x):
            seen[name].add(check(x).split(":")[0])
        return collect

    for name, (strategy, check) in TARGETS.items():
        seen[name] = set()
        collector(name, strategy, check)()
    assert seen["jobscript"] == {"parsed", "error"}, seen
    assert {"none", "estimate"} <= seen["attached"] and any(s.startswith("refused-") for s in seen["attached"]), seen
    assert {"allow", "modify", "refuse", "error"} <= seen["protocol"], seen
    assert {"lua-decided", "lua-left"} <= seen["lua"], seen
    assert decode_line_directly("#VEST-ESTIMATE v2 x") == "version"
