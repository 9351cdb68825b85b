"""What a dataset hands the runner: sessions of turns (a one-turn session is a plain request)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One user message to send and how many tokens to ask back."""

    text: str
    prompt_len: int  # tokens of `text` alone
    output_len: int


@dataclass(frozen=True)
class Session:
    """A conversation: its turns are sent one after another, each re-sending the whole history."""

    turns: tuple[Turn, ...]
    system: str | None = None
    system_len: int = 0

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError("a session needs at least one turn")

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def single(text: str, prompt_len: int, output_len: int) -> Session:
    """A one-request session."""
    return Session(turns=(Turn(text, prompt_len, output_len),))
