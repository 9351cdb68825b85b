"""When a request is done: EOS, a stop token id, max_tokens or the context limit."""

from __future__ import annotations

from metalserve.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Check the request after its newest output token was appended; set `stop_reason` on a stop id.

    EOS and stop ids are ignored until `min_tokens` outputs exist. A natural stop wins over a length
    limit reached by the same token.
    """
    params = request.sampling_params
    num_out = len(request.output_token_ids)
    if num_out >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last in params.eos_stop_ids(request.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and num_out >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if len(request.prompt_token_ids) + num_out >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
