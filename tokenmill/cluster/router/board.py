"""The candidates for new requests, by role, kept between decisions: rebuilt when a worker joins, leaves
or drains, and at least every BOARD_REFRESH_S (who answers changes with time). A first try takes them as
they are; a retry, which must avoid the workers it was lost on, filters the fleet afresh."""

from __future__ import annotations

from tokenmill.cluster.policies.base import Candidates
from tokenmill.cluster.router.settings import BOARD_REFRESH_S
from tokenmill.cluster.router.worker import Worker, fits


class Board:
    def __init__(self) -> None:
        self._views: dict[str | None, Candidates | None] = {}
        self._built = -1.0e18
        self.stale = True

    def invalidate(self) -> None:
        self.stale = True

    def candidates(self, workers: list[Worker], role: str | None, now: float) -> Candidates | None:
        """The workers a new request of `role` may go to: those that answer; with none, all that are up
        (a long step, not death: the router's lost-request bound covers the wait). None: no worker is up."""
        if self.stale or now - self._built > BOARD_REFRESH_S:
            self._rebuild(now)
        if role not in self._views:
            self._views[role] = self._view(workers, role, now)
        return self._views[role]

    def _rebuild(self, now: float) -> None:
        for view in self._views.values():
            if view is not None:
                view.unseat()
        self._views.clear()
        self._built, self.stale = now, False

    def _view(self, workers: list[Worker], role: str | None, now: float) -> Candidates | None:
        ups = [w for w in workers if w.usable() and fits(w, role)]
        answering = [w for w in ups if w.answering(now)] or ups
        return Candidates(answering, seated=True) if answering else None
