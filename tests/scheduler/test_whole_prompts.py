"""An encoder's scheduler (`whole_prompts`): a prompt runs whole in one step or waits for the next one."""

from __future__ import annotations

import pytest

from metalserve.config import EngineConfig
from metalserve.pooling_params import PoolingParams
from metalserve.request import Request, RequestStatus
from metalserve.sampling_params import SamplingParams
from metalserve.scheduler.scheduler import Scheduler


@pytest.mark.parametrize("whole", [True, False])
def test_a_prompt_that_does_not_fit_the_rest_of_the_budget_waits_whole(whole: bool) -> None:
    config = EngineConfig(max_num_batched_tokens=150, block_size=16, enable_prefix_caching=False)
    scheduler = Scheduler(config, num_blocks=64, max_model_len=128)
    scheduler.whole_prompts = whole
    params = SamplingParams(max_tokens=1, pooling=PoolingParams("mean"))
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, list(range(1, 101)), params))
    first = scheduler.schedule()
    # Whole prompts: b's 100 tokens do not fit the 50 left, so no chunk of it runs (a decoder chunks it).
    assert first.num_scheduled_tokens == ({"a": 100} if whole else {"a": 100, "b": 50})
    if whole:
        scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)
        assert scheduler.schedule().num_scheduled_tokens == {"b": 100}
