"""The completion box both peers share: worker threads post results or errors, `poll` takes them."""

from __future__ import annotations

import threading
import time


class PollMixin:
    """Expects `self._cond` (a threading.Condition), `self._results` (list) and `self._errors` (list of str)."""

    _cond: threading.Condition
    _results: list[dict]
    _errors: list[str]

    def poll(self, timeout_s: float = 0.0) -> list[dict]:
        """Completions so far (waiting up to timeout_s for the first): request_id, kind, finished_at, n_tokens."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._cond:
            while not self._results and not self._errors:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._errors and not self._results:
                raise RuntimeError("; ".join(self._errors))
            out, self._results = self._results, []
        return out
