"""A dflash-chat app on a scripted stream with fixed numbers, for snapshots and UI tests.

Run it by hand to see the app without any model: ``python tests/helpers/snapshot_app.py``.
"""

import threading

from dflash_mlx.text.responses import AcceptanceStats, GenerationResponse
from dflash_mlx.tui.app import ChatApp

REPLY = [
    "DFlash",
    " drafts a **block**",
    " of tokens",
    " in one pass,",
    " and the target",
    " verifies them",
    " all at once.\n\n",
    "- lossless\n",
    "- fast\n",
]
ACCEPTANCE = [7, 3, 5, 2, 9, 4, 16, 6]
CYCLE_SECONDS = 0.05
GATE_SECONDS = 30.0  # as long as wait_until's limit: only a test that never opens a gate hits it


async def wait_until(pilot, condition, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError("timed out waiting for the app")


def fake_responses(
    pieces: list[str] = REPLY, prompt_tokens: int = 12, stop: bool = True, acceptance: list[int] = ACCEPTANCE
):
    """``GenerationResponse``s with numbers a test can predict: 100 tok/s prefill, 50 ms a cycle.

    Cycle ``i`` emits ``acceptance[i - 1]`` tokens, drafting 15 (block 16); a 0 there is a
    plain cycle (no draft, one token), as the adaptive policy runs them.
    """
    generated, counts = 0, AcceptanceStats()
    for cycle, text in enumerate(pieces):
        scripted = 1 if cycle == 0 else acceptance[(cycle - 1) % len(acceptance)]
        n, num_draft = (1, 0) if scripted == 0 or cycle == 0 else (scripted, 15)
        generated += n
        if cycle:
            counts.add(num_draft, n)
        last = cycle == len(pieces) - 1
        yield GenerationResponse(
            text=text,
            tokens=list(range(n)),
            acceptance_length=n,
            mean_acceptance_length=counts.tau,
            cycle=cycle,
            prompt_tokens=prompt_tokens,
            prompt_tps=100.0,
            generation_tokens=generated,
            generation_tps=(generated - 1) / (CYCLE_SECONDS * cycle) if cycle else 0.0,
            peak_memory=1.25,
            finish_reason=("stop" if stop else "length") if last else None,
            num_draft=num_draft,
            drafting_cycles=counts.drafting_cycles,
            plain_cycles=counts.plain_cycles,
        )


class FakeStream:
    """A stand-in for the models: records each call and plays ``fake_responses``.

    With ``pause_after=k`` it waits on ``gate`` before its k-th response, so a test can look
    at the app mid-reply or press Esc there. A gate never opened raises (the app shows that as an
    error) and is recorded in ``timeouts``, so the test fails instead of playing on.
    """

    timeouts: list[str] = []

    def __init__(self, pieces: list[str] = REPLY, pause_after: int | None = None, acceptance: list[int] = ACCEPTANCE):
        self.pieces, self.pause_after, self.acceptance = pieces, pause_after, acceptance
        self.calls: list[tuple[list[dict], object]] = []
        self.gate = threading.Event()
        self.produced = 0
        self.closed = False

    def __call__(self, messages, settings):
        self.calls.append((messages, settings))
        return self._play()

    def _play(self):
        try:
            for i, response in enumerate(fake_responses(self.pieces, acceptance=self.acceptance)):
                if i == self.pause_after:
                    self.wait_for(self.gate, f"the gate before response {i}")
                self.produced += 1
                yield response
        finally:
            self.closed = True

    def wait_for(self, event: threading.Event, what: str) -> None:
        if not event.wait(GATE_SECONDS):
            FakeStream.timeouts.append(what)
            raise TimeoutError(f"The test never opened {what}.")


app = ChatApp(FakeStream())

if __name__ == "__main__":
    app.run()
