"""Stop strings in streamed text: emit what is safe, hold back what might start a stop string."""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Watches streamed text for any of a set of stop strings.

    ``push`` returns the text that can be shown now and whether a stop string was hit.
    Text that could be the beginning of a stop string is held back until the next push
    proves it is not (or ``flush`` releases it at the end of the reply). When a stop string
    is found, the text before it is returned and the stop string itself (and anything after
    it) is dropped; later pushes return nothing.
    """

    def __init__(self, stop_strings: Iterable[str] = ()) -> None:
        self.stop_strings: list[str] = sorted({s for s in stop_strings if s}, key=len, reverse=True)
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return text, False
        buffer = self._pending + text
        # the earliest stop string wins; among those starting at the same place, the longest
        first_at, first = -1, None
        for stop in self.stop_strings:
            at = buffer.find(stop)
            if at != -1 and (first_at == -1 or at < first_at):
                first_at, first = at, stop
        if first is not None:
            self.stopped = True
            self.matched = first
            self._pending = ""
            return buffer[:first_at], True
        keep = self._held_suffix_length(buffer)
        self._pending = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of the reply (nothing after a stop)."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def reset(self) -> None:
        """Start over for a new reply."""
        self._pending = ""
        self.stopped = False
        self.matched = None

    def _held_suffix_length(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(self._longest - 1, len(buffer))
        for length in range(longest, 0, -1):
            suffix = buffer[len(buffer) - length :]
            if any(stop.startswith(suffix) for stop in self.stop_strings):
                return length
        return 0
