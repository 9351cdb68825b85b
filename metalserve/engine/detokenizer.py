"""Incremental detokenization with stop-string detection.

Decoding each token on its own breaks multi-byte characters (a byte-level BPE splits one emoji over
several tokens) and word-leading spaces (SentencePiece). So we decode a short window of recent tokens
twice, with and without the new ones, and emit only the difference once it no longer ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

from metalserve.sampling_params import SamplingParams

# Prompt tokens kept as left context so the first output token decodes with its leading space.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, and finds stop strings that span tokens.

    While stop strings are set (and not included in the output), the last len(longest stop) - 1
    characters are held back so that streamed text never contains the start of a stop string that a
    later token completes; streamed text therefore always equals the non-streamed text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self._stops), default=0)
        self._hold_back = 0 if self._include_stop else max(longest - 1, 0)
        self._longest_stop = longest
        self._sent = 0
        self.output_text = ""
        self.stop_reason: str | None = None
        self.num_used = 0  # tokens of the last update read (up to the one that completed a stop string)

    def update(self, new_token_ids: list[int], finished: bool) -> str:
        """Add this step's tokens; return the new text that is safe to send.

        After a stop string is found, `stop_reason` holds it, the text is cut there and the rest of
        the tokens are ignored (`num_used` says how many of these were read: several tokens arrive at
        once from a verified speculative window); the caller should then finish the request.
        """
        self.num_used = 0
        if self.stop_reason is not None:
            return ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.num_used += 1
            piece = self._decode_next(final=False)
            if piece:
                self.output_text += piece
                if self._stops and self._check_stop(len(piece)):
                    return self._take(final=True)
        if finished:
            self.output_text += self._decode_next(final=True)
        return self._take(final=finished)

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )
        return text

    def _decode_next(self, final: bool) -> str:
        """The text the tokens after read_offset add, or "" while it ends in a partial character."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, new_chars: int) -> bool:
        """Look for a stop string that overlaps the newest `new_chars` characters; cut the text there."""
        start = max(len(self.output_text) - new_chars - self._longest_stop + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.output_text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.stop_reason = stop
        self.output_text = self.output_text[: index + (len(stop) if self._include_stop else 0)]
        return True

    def _take(self, final: bool) -> str:
        limit = len(self.output_text) if final else len(self.output_text) - self._hold_back
        if limit <= self._sent:
            return ""
        delta = self.output_text[self._sent : limit]
        self._sent = limit
        return delta
