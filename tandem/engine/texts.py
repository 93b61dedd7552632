"""Each live request's streamed text (tandem.tokenizer.detokenize), and where a stop string
cuts a step's new tokens."""

from __future__ import annotations

from tandem.engine.request import Request
from tandem.tokenizer.detokenize import TextStream
from tandem.tokenizer.tokenizer import Tokenizer


class RequestTexts:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, TextStream] = {}

    def track(self, request: Request, num_emitted_chars: int | None) -> None:
        """Stream the request's text from here (`num_emitted_chars`: of its output so far,
        the characters already sent; None: all of them). Nothing without a tokenizer."""
        if self.tokenizer is not None:
            self._streams[request.request_id] = TextStream(
                self.tokenizer,
                request.prompt_token_ids,
                request.sampling_params.stop,
                request.output_token_ids,
                num_emitted_chars,
            )

    def __len__(self) -> int:
        return len(self._streams)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def add(self, request: Request, new_ids: list[int]) -> tuple[list[int], str, str | None]:
        """(the new tokens that stand, their text delta, the stop string that ended the
        request or None). Tokens after a stop string's (an accepted draft's) were never the
        request's: they leave its output and logprobs."""
        stream = self._streams.get(request.request_id)
        if stream is None or not new_ids:
            return new_ids, "", None
        text = ""
        for i, token_id in enumerate(new_ids):
            last = i == len(new_ids) - 1
            delta, stop = stream.add([token_id], last and request.status.finished)
            text += delta
            if stop is not None:
                if not last:
                    dropped = len(new_ids) - 1 - i
                    del request.output_token_ids[-dropped:]
                    del request.logprobs[len(request.logprobs) - dropped :]
                return new_ids[: i + 1], text, stop
        return new_ids, text, None
