"""The tokens that end a request: end-of-sequence (unless ignored) and its stop token
ids, as mlx-lm's stop sequences, one object for every request with the same ones."""

from __future__ import annotations

from mlx_lm.generate import StopSequences

from mlx_serve.generation import SamplingParams


class EndTokens:
    def __init__(self, eos_ids: tuple[int, ...]) -> None:
        self._eos_ids = eos_ids
        self._shared: dict[tuple[int, ...], StopSequences] = {}

    def ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self._eos_ids
        return tuple(sorted(set(eos) | set(params.stop_token_ids)))

    def stop_sequences(self, ids: tuple[int, ...]) -> StopSequences:
        stops = self._shared.get(ids)
        if stops is None:
            stops = self._shared[ids] = StopSequences([(t,) for t in ids])
        return stops
